// Package devenv runs throwaway PostgreSQL and NATS JetStream servers as
// child processes: each in its own temporary directory on a free port, able
// to be killed, stopped and started again on the same data, and removed
// afterwards. The demo (`outbox-relay demo`) starts its servers with it and
// the tests do through internal/testenv.
//
// It must not import package testing, directly or through anything else,
// because the outbox-relay binary links it for the demo
// (cmd/outbox-relay's deps test checks that). What only tests need (shared
// servers, a database per test, waiting for conditions) is in testenv.
//
// Binaries: PostgreSQL's from PostgresOptions (Version or BinDir), else
// OUTBOX_RELAY_TEST_PG_BIN, else OUTBOX_RELAY_TEST_PG_VERSION, else the
// highest /usr/lib/postgresql/*/bin; a major version is Debian's package or
// one `make pg-versions` installed (PostgresBinDir). A server can get a
// physical standby (StartStandby) to fail over to. nats-server from
// NATSOptions.Bin, by default
// the version pinned in the product's go.mod (PinnedNATSServer). The demo
// also accepts a nats-server of the user's (FindNATSServer).
package devenv
