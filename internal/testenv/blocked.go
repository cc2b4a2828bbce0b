package testenv

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// Execer is a *pgx.Conn or a *pgxpool.Pool.
type Execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// InsertBlockedAggregates inserts n blocked aggregates (G12) into table t in
// one statement, for the tests that hold the observer statements to their
// time limits (G16): aggregate ("order", "blk-000001") and on, in aggregate
// order as in age, each of three rows: seq 1 published, seq 2 the blocking
// row (by turns failed, a dead letter; scheduled, retrying in an hour;
// running under a lease), seq 3 scheduled and waiting behind it.
// Written as the relay leaves them, parked set, so no trigger runs per row.
// It returns the work ID of the oldest blocking row, "blk-000001-2".
func InsertBlockedAggregates(t testing.TB, db Execer, tbl store.Table, n int) string {
	t.Helper()
	start := time.Now()
	_, err := db.Exec(context.Background(), `INSERT INTO `+tbl.String()+` (work_id, kind, payload, state, parked, created_at, available_at,
			attempts, last_error, claimed_by, lease_until, published_at, stream_seq, aggregate_type, aggregate_id, aggregate_seq)
		SELECT a.id || '-' || s, 'order.changed', '{}', st.state, CASE WHEN st.state = 'failed' THEN 'failed' END,
			b.t + g * interval '1 ms' + s * interval '1 us',
			CASE WHEN st.state = 'scheduled' AND s = 2 THEN b.t + interval '2 hours' ELSE b.t + g * interval '1 ms' END,
			CASE s WHEN 2 THEN 5 ELSE 0 END,
			CASE WHEN s = 2 AND st.state = 'failed' THEN 'rejected: max_payload: too big'
				WHEN s = 2 AND st.state = 'scheduled' THEN 'uncertain: timeout'
				WHEN s > 2 THEN 'held: waiting for ' || a.id || '-2' END,
			CASE WHEN st.state = 'running' THEN 'worker-1' END,
			CASE WHEN st.state = 'running' THEN clock_timestamp() + interval '10 minutes' END,
			CASE WHEN s = 1 THEN b.t + g * interval '1 ms' END, CASE WHEN s = 1 THEN g END,
			'order', a.id, s
		FROM generate_series(1, $1::int) g, generate_series(1, 3) s,
			(SELECT clock_timestamp() - interval '1 hour' AS t) b,
			LATERAL (SELECT 'blk-' || lpad(g::text, 6, '0') AS id) a,
			LATERAL (SELECT CASE WHEN s = 1 THEN 'published' WHEN s > 2 THEN 'scheduled'
				ELSE (ARRAY['failed', 'scheduled', 'running'])[g % 3 + 1] END AS state) st`, n)
	if err != nil {
		t.Fatalf("testenv: insert %d blocked aggregates: %v", n, err)
	}
	if _, err := db.Exec(context.Background(), `ANALYZE `+tbl.String()); err != nil {
		t.Fatalf("testenv: analyze %s: %v", tbl.Qualified(), err)
	}
	t.Logf("testenv: %d blocked aggregates (%d rows) inserted in %s", n, 3*n, time.Since(start).Round(time.Millisecond))
	return fmt.Sprintf("blk-%06d-2", 1)
}
