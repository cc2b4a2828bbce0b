// Package e2e holds process-level fault tests: they build the outbox-relay
// binary, run it as a child process against real PostgreSQL and nats-server
// processes (internal/testenv), and break it the way production breaks it
// (kill -9 under load, SIGTERM, bad flags and environment), then check the
// guarantees of DESIGN.md on the data: what is in the stream, what the table
// says, and how far the replication slot was confirmed.
//
// The package has no non-test code besides this comment.
package e2e
