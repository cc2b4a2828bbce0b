package store_test

import (
	"context"
	"encoding/json"
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

// orderScaleRows is the size of the table the order statements run on (G16).
const orderScaleRows = 1_000_000

// Rows with the poller that are not due yet (delayed delivery), half of
// them with a deadline: the claim and the deadline sweep used to read them
// all whenever they ran.
const delayed = 50_000

// The history of one aggregate in the table: its top row is with the
// poller, so the ordered claim's probe for it, and WithPoller for it, used
// to read down through every published row below.
const longHistory = 50_000

// maxBuffers is what one order statement may touch, in shared buffers
// (8 kB pages, hit or read, its index and heap pages together), on a table
// of about 50,000 heap pages. The statements read the rows of their batch:
// tens of pages. A scan of the table, or of one aggregate's published
// history, reads thousands.
const maxBuffers = 1000

// TestOrderStatementsAtScale runs every statement of order per aggregate
// (G12) on a table of 1,000,000 rows and checks that each reads only the
// rows of its batch (G16): no sequential scan of the outbox table in its
// plan, at most maxBuffers pages read, and no sequential scan counted in
// pg_stat_user_tables while the store's methods ran. The table: 800,000
// unordered rows (50,000 of them delayed, with the poller and due in an
// hour, half with a deadline) and 200,000 in aggregates (15,000 aggregates
// of 10 rows and one of 50,000), all published, except a dead letter
// holding one aggregate (its seq 5 failed, 6 to 10 waiting behind it), the
// top row of the long aggregate with the poller, and one unordered row with
// the poller past its deadline. Each statement's latency (EXPLAIN ANALYZE) is logged
// (-v) for docs/benchmarks.md.
func TestOrderStatementsAtScale(t *testing.T) {
	if testing.Short() {
		t.Skip("loads 1,000,000 rows")
	}
	ctx := context.Background()
	t0 := time.Now()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	conn := connect(t, url)
	if _, err := store.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	t.Logf("database migrated after %s", time.Since(t0).Round(time.Millisecond))
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
	// Autovacuum would vacuum and analyze behind the test's back. Unlogged
	// (instant on an empty table): the load writes no WAL, and nothing here
	// depends on it.
	exec(`ALTER TABLE outbox SET (autovacuum_enabled = false)`)
	exec(`ALTER TABLE outbox SET UNLOGGED`)
	const published = `'published', clock_timestamp() - interval '1 day', clock_timestamp() - interval '1 day', g`
	unordered := orderScaleRows - 150_000 - longHistory - delayed
	exec(`INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq)
		SELECT 'u' || g, 'k', '{"n": 1}', `+published+` FROM generate_series(1, $1::int) g`, unordered)
	exec(`INSERT INTO outbox (work_id, kind, payload, state, available_at, expires_at)
		SELECT 'd' || g, 'k', '{"n": 1}', 'scheduled', clock_timestamp() + interval '1 hour',
			CASE WHEN g % 2 = 0 THEN clock_timestamp() + interval '2 hours' END
		FROM generate_series(1, $1::int) g`, delayed)
	exec(`INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq, aggregate_type, aggregate_id, aggregate_seq)
		SELECT 'a' || g, 'k', '{"n": 1}', ` + published + `, 'order', 'o' || (g - 1) / 10, (g - 1) % 10 + 1
		FROM generate_series(1, 150000) g`)
	exec(`INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq, aggregate_type, aggregate_id, aggregate_seq)
		SELECT 'l' || g, 'k', '{"n": 1}', `+published+`, 'order', 'long', g
		FROM generate_series(1, $1::int) g`, longHistory)
	exec(`VACUUM (ANALYZE) outbox`)
	// After the statistics: the rows that just changed state are ones the
	// planner's statistics have not seen, as in a running relay.
	exec(`UPDATE outbox SET state = 'failed', published_at = NULL, stream_seq = NULL, attempts = 5, last_error = 'rejected: max_payload'
		WHERE work_id = 'a75'`) // order/o7, seq 5
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL, last_error = 'held: waiting for a75',
			available_at = clock_timestamp() - interval '1 minute'
		WHERE work_id IN ('a76', 'a77', 'a78', 'a79', 'a80')`)
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL, available_at = clock_timestamp() - interval '1 minute'
		WHERE work_id = $1`, fmt.Sprintf("l%d", longHistory))
	exec(`UPDATE outbox SET state = 'scheduled', published_at = NULL, stream_seq = NULL,
			available_at = clock_timestamp() + interval '1 hour', expires_at = clock_timestamp() - interval '1 second'
		WHERE work_id = 'u1'`)
	var n, pages int64
	if err := pool.QueryRow(ctx, `SELECT count(*), pg_relation_size('outbox') / 8192 FROM outbox`).Scan(&n, &pages); err != nil {
		t.Fatal(err)
	}
	if n < orderScaleRows {
		t.Fatalf("table has %d rows, want %d", n, orderScaleRows)
	}
	t.Logf("loaded %d rows (%d heap pages) in %s", n, pages, time.Since(start).Round(time.Millisecond))

	s := store.New(pool, tbl, store.PolicyMark)
	long := fmt.Sprintf("l%d", longHistory)
	const lease, margin = int64(time.Minute / time.Microsecond), int64(time.Second / time.Microsecond)
	statements := []struct {
		name string
		sql  string
		args []any
	}{
		{"held-aggregate refresh (HeldAggregates)", s.HeldAggregatesSQL(), nil},
		{"ordered claim (Claim, ordered)", s.ClaimSQL(true), []any{100, "w", lease, margin}},
		{"hand-back check (WithPoller), a held aggregate", s.WithPollerSQL(), []any{"order", "o7"}},
		{"hand-back check (WithPoller), the long aggregate", s.WithPollerSQL(), []any{"order", "long"}},
		{"hand-back check (WithPoller), a free aggregate", s.WithPollerSQL(), []any{"order", "o8"}},
		{"blocked aggregates (BlockedAggregates)", s.BlockedAggregatesSQL(), []any{5}},
		{"deadline sweep (ExpireDue)", s.ExpireDueSQL(), nil},
	}
	for _, st := range statements {
		t.Run(st.name, func(t *testing.T) {
			p := explainAnalyze(ctx, t, pool, st.sql, st.args...)
			if scans := p.seqScans("outbox"); len(scans) > 0 {
				t.Errorf("plan scans the outbox table sequentially (%s):\n%s", strings.Join(scans, "; "), p.text)
			}
			if p.buffers > maxBuffers {
				t.Errorf("touched %d buffers of a table of %d pages, want at most %d:\n%s", p.buffers, pages, maxBuffers, p.text)
			}
			t.Logf("%s: %.3f ms (planning %.3f ms), %d buffers", st.name, p.execMs, p.planMs, p.buffers)
			if testing.Verbose() {
				t.Log(p.text)
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
	wantHeld := map[store.AggregateKey]string{{Type: "order", ID: "o7"}: "a75", {Type: "order", ID: "long"}: long}
	if fmt.Sprint(held) != fmt.Sprint(wantHeld) {
		t.Errorf("held aggregates %v, want %v", held, wantHeld)
	}
	for id, want := range map[string]bool{"o7": true, "long": true, "o8": false} {
		if with, err := s.WithPoller(ctx, store.AggregateKey{Type: "order", ID: id}); err != nil || with != want {
			t.Errorf("WithPoller(order/%s) = %v, %v; want %v", id, with, err, want)
		}
	}
	total, oldest, err := s.BlockedAggregates(ctx, 5)
	if err != nil {
		t.Fatal(err)
	}
	if total != 1 || len(oldest) != 1 || oldest[0].WorkID != "a75" || oldest[0].Waiting != 5 || oldest[0].State != store.StateFailed {
		t.Errorf("blocked aggregates: %d, %+v; want 1: a75 (failed) with 5 waiting", total, oldest)
	}
	claimed, err := s.Claim(ctx, "w", time.Minute, 100, store.ClaimOptions{Ordered: true, DeadlineMargin: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if got := claimedIDs(claimed); !slices.Equal(got, []string{long}) {
		t.Errorf("ordered claim took %v, want [%s] (o7's rows wait behind its dead letter, u1 is not due)", got, long)
	}
	expired, err := s.ExpireDue(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(expired, []string{"u1"}) {
		t.Errorf("expired %v, want [u1]", expired)
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

// analyzed is one statement's EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON).
type analyzed struct {
	root           orderPlanNode
	execMs, planMs float64
	buffers        int64 // shared buffers hit or read by the whole statement
	text           string
}

type orderPlanNode struct {
	NodeType string          `json:"Node Type"`
	Relation string          `json:"Relation Name"`
	Alias    string          `json:"Alias"`
	Index    string          `json:"Index Name"`
	Hit      int64           `json:"Shared Hit Blocks"`
	Read     int64           `json:"Shared Read Blocks"`
	Plans    []orderPlanNode `json:"Plans"`
}

// seqScans lists the nodes that read relation sequentially.
func (a analyzed) seqScans(relation string) []string {
	var out []string
	var walk func(n orderPlanNode)
	walk = func(n orderPlanNode) {
		if n.NodeType == "Seq Scan" && n.Relation == relation {
			out = append(out, "Seq Scan on "+n.Relation+" "+n.Alias)
		}
		for _, c := range n.Plans {
			walk(c)
		}
	}
	walk(a.root)
	return out
}

// explainAnalyze runs sql under EXPLAIN (ANALYZE, BUFFERS) in a
// transaction it rolls back, so a claim or a sweep changes nothing; and
// again for the plan's text, in another.
func explainAnalyze(ctx context.Context, t *testing.T, pool *pgxpool.Pool, sql string, args ...any) analyzed {
	t.Helper()
	var raw []byte
	inRollback(ctx, t, pool, func(tx pgx.Tx) {
		// Planned for these arguments, as the store runs them.
		if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, append([]any{pgx.QueryExecModeExec}, args...)...).Scan(&raw); err != nil {
			t.Fatalf("explain: %v", err)
		}
	})
	var out []struct {
		Plan     orderPlanNode `json:"Plan"`
		Exec     float64       `json:"Execution Time"`
		Planning float64       `json:"Planning Time"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
		t.Fatalf("explain output %s: %v", raw, err)
	}
	a := analyzed{root: out[0].Plan, execMs: out[0].Exec, planMs: out[0].Planning, buffers: out[0].Plan.Hit + out[0].Plan.Read}
	inRollback(ctx, t, pool, func(tx pgx.Tx) {
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+sql, append([]any{pgx.QueryExecModeExec}, args...)...)
		a.text = store.PlanText(t, rows, err)
	})
	return a
}

func inRollback(ctx context.Context, t *testing.T, pool *pgxpool.Pool, f func(pgx.Tx)) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	f(tx)
}
