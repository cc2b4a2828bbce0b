package replication

import (
	"context"
	"fmt"

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
