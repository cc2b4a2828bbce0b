// Package replication is the relay's side of PostgreSQL logical replication:
// the slot and the publication (created, checked, looked up), and one
// streaming connection that decodes pgoutput into committed outbox rows.
// It knows nothing of NATS.
//
// # Positions
//
// Every transaction arrives as Begin, its outbox rows, Commit, with two
// positions: the commit LSN (where its COMMIT record starts; the
// Outbox-Commit-LSN header) and the end LSN (just past it). Only whole
// committed transactions are decoded, in commit order; a rolled-back one
// never appears (G2).
//
// # Confirmation
//
// The slot's confirmed_flush_lsn is the relay's only checkpoint. The stream
// reports to the server, in standby status updates, only the positions the
// caller sends on the confirms channel of Stream.Run: the end LSN of a transaction whose
// messages the broker acknowledged and whose rows' new state committed, and
// of every transaction before it (internal/checkpoint keeps that prefix).
// The server may then recycle WAL up to it; a restart resumes just past it,
// so nothing confirmed is replayed and nothing unconfirmed is skipped (G3).
// Start always asks for 0/0, which the server reads as "from the slot's
// confirmed position", never the server's current one.
//
// When nothing is in flight the stream confirms the keepalive's WAL position,
// so an idle outbox in a busy database does not hold WAL without bound (G10).
//
// The PostgreSQL documentation of the protocol: "Streaming Replication
// Protocol" and "Logical Streaming Replication Protocol" (pgoutput's message
// formats).
//
// # The relay's own
//
// The repository's layout puts this package at the top level
// (replication/, sinks/), so it can be imported; it is not a public API.
// Its exported names serve the relay's other packages and change with
// them in any release, and its signatures use internal packages
// (internal/wire), which nothing outside this module can name. The public
// packages are outbox and inbox (docs/layout.md).
package replication
