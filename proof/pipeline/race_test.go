//go:build race

package pipeline

// raceEnabled builds the relay with -race too when the tests run with it.
const raceEnabled = true
