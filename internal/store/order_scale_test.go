package store_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Rows with the poller that are not due yet (delayed delivery), half of
// them with a deadline: the claim and the deadline sweep used to read them
// all whenever they ran.
const delayed = 50_000

// maxBuffers is what one order statement may touch, in shared buffers
// (8 kB pages, hit or read, its index and heap pages together), on a table
// of about 50,000 heap pages. The statements read the rows of their batch:
// tens of pages. A scan of the table, or of one aggregate's published
// history, reads thousands.
const maxBuffers = 1000

// TestOrderStatementsAtScale runs every statement of order per aggregate
// (G12) on a table of 1,050,000 rows and checks that each reads only the
// rows of its batch (G16): no sequential scan of the outbox table in its
// plan, at most maxBuffers pages read, and no sequential scan counted in
// pg_stat_user_tables while the store's methods ran. The table: the shared
// million published rows (scaleDatabase: 800,000 unordered, 200,000 in
// aggregates, 15,000 aggregates of 10 rows and one of 50,000) and 50,000
// delayed rows, with the poller and due in an hour, half with a deadline;
// then a dead letter holds one aggregate (o7: its seq 5 failed, 6 to 10
// waiting behind it), the top row of the long aggregate is with the poller,
// and one unordered row is with the poller past its deadline. Each
// statement's latency (EXPLAIN ANALYZE) is logged (-v) for
// docs/benchmarks-scale.md.
func TestOrderStatementsAtScale(t *testing.T) {
	ctx := context.Background()
	url := scaleDatabase(t)
	tbl := testenv.OutboxTable
	// One connection: pg_stat_force_next_flush() flushes the statistics of
	// the backend that calls it, which must be the one that ran the
	// statements.
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}

	start := time.Now()
	heldHead, unordered := aggregateRow(7, 5), "w-1" // order/o7 seq 5; w-1 is in no aggregate
	exec(`INSERT INTO outbox (work_id, kind, payload, state, available_at, expires_at)
		SELECT 'd' || g, 'k', '{"n": 1}', 'scheduled', clock_timestamp() + interval '1 hour',
			CASE WHEN g % 2 = 0 THEN clock_timestamp() + interval '2 hours' END
		FROM generate_series(1, $1::int) g`, delayed)
	exec(`VACUUM (ANALYZE) outbox`)
	// After the statistics: the rows that just changed state are ones the
	// planner's statistics have not seen, as in a running relay.
	exec(`UPDATE outbox SET state = 'failed', published_at = NULL, stream_seq = NULL, attempts = 5, last_error = 'rejected: max_payload'
		WHERE work_id = $1`, heldHead)
	waiting := make([]string, 0, 5)
	for seq := 6; seq <= 10; seq++ {
		waiting = append(waiting, aggregateRow(7, seq))
	}
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL, last_error = 'held: waiting for ' || $2::text,
			available_at = clock_timestamp() - interval '1 minute'
		WHERE work_id = ANY($1)`, waiting, heldHead)
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL, available_at = clock_timestamp() - interval '1 minute'
		WHERE work_id = $1`, longTop)
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL,
			available_at = clock_timestamp() + interval '1 hour', expires_at = clock_timestamp() - interval '1 second'
		WHERE work_id = $1`, unordered)
	var n, pages, aggs, long int64
	if err := pool.QueryRow(ctx, `SELECT count(*), pg_relation_size('outbox') / 8192,
			count(DISTINCT aggregate_id) FILTER (WHERE aggregate_id LIKE 'o%'), count(*) FILTER (WHERE aggregate_id = 'long') FROM outbox`).
		Scan(&n, &pages, &aggs, &long); err != nil {
		t.Fatal(err)
	}
	if n != scaleRows+delayed || aggs != shortAggs || long != longHistory {
		t.Fatalf("table has %d rows, %d short aggregates and %d rows in the long one; want %d, %d and %d",
			n, aggs, long, scaleRows+delayed, shortAggs, longHistory)
	}
	t.Logf("loaded %d rows (%d heap pages) in %s", n, pages, time.Since(start).Round(time.Millisecond))

	s := store.New(pool, tbl, store.PolicyMark)
	const lease, margin = int64(time.Minute / time.Microsecond), int64(time.Second / time.Microsecond)
	statements := []struct {
		name string
		sql  string
		args []any
	}{
		{"held-aggregate refresh (HeldAggregates)", s.HeldAggregatesSQL(), nil},
		{"ordered claim (Claim, ordered)", s.ClaimSQL(true), []any{100, "w", lease, margin, int64(0)}},
		{"hand-back check (WithPoller), a held aggregate", s.WithPollerSQL(), []any{"order", "o7"}},
		{"hand-back check (WithPoller), the long aggregate", s.WithPollerSQL(), []any{"order", "long"}},
		{"hand-back check (WithPoller), a free aggregate", s.WithPollerSQL(), []any{"order", "o8"}},
		{"blocked aggregates (BlockedAggregates)", s.BlockedAggregatesSQL(), []any{5, store.BlockedLookAt, store.BlockedLookAtLeast, tbl.String()}},
		{"deadline sweep (ExpireDue)", s.ExpireDueSQL(), nil},
	}
	for _, st := range statements {
		t.Run(st.name, func(t *testing.T) {
			// Planned for these arguments, as the store runs them.
			args := append([]any{pgx.QueryExecModeExec}, st.args...)
			p := explainAnalyze(ctx, t, pool, st.sql, args...)
			text := func() string { return explainText(ctx, t, pool, st.sql, args...) }
			if scans := p.seqScans("outbox"); len(scans) > 0 {
				t.Errorf("plan scans the outbox table sequentially (%s):\n%s", strings.Join(scans, "; "), text())
			}
			if p.buffers > maxBuffers {
				t.Errorf("touched %d buffers of a table of %d pages, want at most %d:\n%s", p.buffers, pages, maxBuffers, text())
			}
			t.Logf("%s: %.3f ms (planning %.3f ms), %d buffers", st.name, p.execMs, p.planMs, p.buffers)
			if testing.Verbose() {
				t.Log(text())
			}
		})
	}

	// The methods themselves, with their answers, and no sequential scan of
	// the table counted while they ran.
	before := seqScans(ctx, t, pool)
	held, err := s.HeldAggregates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wantHeld := map[store.AggregateKey]string{{Type: "order", ID: "o7"}: heldHead, {Type: "order", ID: "long"}: longTop}
	if fmt.Sprint(held) != fmt.Sprint(wantHeld) {
		t.Errorf("held aggregates %v, want %v", held, wantHeld)
	}
	for id, want := range map[string]bool{"o7": true, "long": true, "o8": false} {
		if with, err := s.WithPoller(ctx, store.AggregateKey{Type: "order", ID: id}); err != nil || with != want {
			t.Errorf("WithPoller(order/%s) = %v, %v; want %v", id, with, err, want)
		}
	}
	blocked, err := s.BlockedAggregates(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	if oldest := blocked.Oldest; blocked.Total != 1 || blocked.AtLeast || len(oldest) != 1 || oldest[0].WorkID != heldHead || oldest[0].Waiting != 5 || oldest[0].State != store.StateFailed {
		t.Errorf("blocked aggregates: %+v; want 1: %s (failed) with 5 waiting", blocked, heldHead)
	}
	claimed, err := s.Claim(ctx, "w", time.Minute, 100, store.ClaimOptions{Ordered: true, DeadlineMargin: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if got := claimedIDs(claimed); !slices.Equal(got, []string{longTop}) {
		t.Errorf("ordered claim took %v, want [%s] (o7's rows wait behind its dead letter, %s is not due)", got, longTop, unordered)
	}
	expired, err := s.ExpireDue(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(expired, []string{unordered}) {
		t.Errorf("expired %v, want [%s]", expired, unordered)
	}
	if after := seqScans(ctx, t, pool); after != before {
		t.Errorf("the outbox table was scanned sequentially %d time(s) while the order statements ran", after-before)
	}
}

// seqScans is the outbox table's sequential scans in pg_stat_user_tables,
// with this connection's own counts flushed first.
func seqScans(ctx context.Context, t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		t.Fatal(err)
	}
	var n int64
	if err := pool.QueryRow(ctx, `SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
