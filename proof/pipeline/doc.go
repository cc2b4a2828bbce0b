// Package pipeline holds only tests: the whole path from an application's
// transaction to a consumer's effect, with the real relay binary in between.
// Producers write with package outbox, the relay (killed with SIGKILL and
// restarted) publishes, and consumers apply with package inbox; the tests
// count the effects.
package pipeline
