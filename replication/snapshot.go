package replication

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"
)

// A logical slot's restart_lsn, where the next session's walsender starts
// decoding, moves only when the walsender decodes a running-transactions
// record (xl_running_xacts) and the client then confirms a position past
// it. The server writes one at each checkpoint and, while WAL is written,
// about every 15 s (the bgwriter's LOG_SNAPSHOT_INTERVAL_MS);
// pg_log_standby_snapshot() (PostgreSQL 16+) writes one on demand.

// SnapshotSupport says whether this session may write a running-transactions
// record on demand.
type SnapshotSupport struct {
	// Exists: the server has pg_log_standby_snapshot() (PostgreSQL 16+).
	Exists bool
	// Allowed: the role may execute it. It is superuser-only unless
	// granted (GRANT EXECUTE ON FUNCTION pg_catalog.pg_log_standby_snapshot()
	// TO <relay role>; sql/roles.sql does when run as a superuser).
	Allowed bool
}

// ReadSnapshotSupport reads SnapshotSupport for the current role.
func ReadSnapshotSupport(ctx context.Context, q Querier) (SnapshotSupport, error) {
	var s SnapshotSupport
	err := q.QueryRow(ctx, `SELECT p IS NOT NULL, coalesce(has_function_privilege(p::oid, 'EXECUTE'), false)
		FROM (SELECT to_regprocedure('pg_catalog.pg_log_standby_snapshot()') AS p) f`).Scan(&s.Exists, &s.Allowed)
	if err != nil {
		return s, fmt.Errorf("read pg_log_standby_snapshot() support: %w", err)
	}
	return s, nil
}

// LogStandbySnapshot writes a running-transactions record and returns its
// position (PostgreSQL 16+, needs EXECUTE on the function).
func LogStandbySnapshot(ctx context.Context, q Querier) (LSN, error) {
	var s string
	if err := q.QueryRow(ctx, `SELECT pg_catalog.pg_log_standby_snapshot()::text`).Scan(&s); err != nil {
		return 0, fmt.Errorf("write a running-transactions record (pg_log_standby_snapshot()): %w", err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse pg_log_standby_snapshot() position %q: %w", s, err)
	}
	return lsn, nil
}

// WALInsertPosition is where the server inserts WAL now.
func WALInsertPosition(ctx context.Context, q Querier) (LSN, error) {
	var s string
	if err := q.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s); err != nil {
		return 0, fmt.Errorf("read pg_current_wal_insert_lsn(): %w", err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse WAL position %q: %w", s, err)
	}
	return lsn, nil
}

// WriteCommitRecord commits an empty transaction that has a transaction id,
// so that the server writes and flushes a commit record: the WAL, and the
// walsender's position once it decoded it, then lie past every position
// read before the call, even in an idle database, where the last record may
// not be flushed or may end just before a page header that a position read
// from pg_current_wal_insert_lsn() counts. pgoutput skips the empty
// transaction. The commit waits for no synchronous standby.
func WriteCommitRecord(ctx context.Context, q Querier) error {
	if _, err := q.Exec(ctx, `SELECT set_config('synchronous_commit', 'local', true), pg_current_xact_id()`); err != nil {
		return fmt.Errorf("write a commit record: %w", err)
	}
	return nil
}

// LogSnapshotByTemporarySlot writes running-transactions records where
// pg_log_standby_snapshot() is missing (PostgreSQL 15) or not granted, with
// the REPLICATION attribute the relay already holds: creating a logical
// slot writes one, and one more after waiting for the transactions open at
// the first (so that the new slot reaches a consistent point). The slot is
// temporary and dropped at once; name must be free. conn must be one
// connection (a temporary slot belongs to its session). timeout bounds the
// wait for open transactions: a long one would otherwise hold the call (the
// first record is written by then, and a cancelled creation drops the
// slot). Returns the new slot's consistent point, past the records.
func LogSnapshotByTemporarySlot(ctx context.Context, conn Querier, name string, timeout time.Duration) (LSN, error) {
	if _, err := conn.Exec(ctx, `SELECT pg_catalog.set_config('statement_timeout', $1, false)`, fmt.Sprint(timeout.Milliseconds())); err != nil {
		return 0, fmt.Errorf("set statement_timeout for temporary slot %s: %w", name, err)
	}
	var s string
	err := conn.QueryRow(ctx, `SELECT lsn::text FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput', true)`, name).Scan(&s)
	if _, rerr := conn.Exec(ctx, `RESET statement_timeout`); rerr != nil && err == nil {
		err = rerr
	}
	if err != nil {
		return 0, fmt.Errorf("write a running-transactions record (temporary slot %s): %w", name, err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_catalog.pg_drop_replication_slot($1)`, name); err != nil {
		return 0, fmt.Errorf("drop temporary slot %s: %w", name, err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse consistent point %q of temporary slot %s: %w", s, name, err)
	}
	return lsn, nil
}
