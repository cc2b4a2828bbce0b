//go:build race

package e2e

// raceEnabled builds the relay with -race too when the tests run with it, so
// a data race in the relay under load fails the test that provoked it.
const raceEnabled = true
