package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The million-row table of G16's store tests (TestObserverStatementsAtScale,
// TestOrderStatementsAtScale): loaded once per test binary into a template
// database, and copied (testenv's CreateDatabaseFrom) into a database of each
// test's own, which then adds the rows of its other states. Loading it took
// 15 to 22 s a test; a copy takes a few.
//
// scaleRows rows, all published: created 30 days ago, one a millisecond,
// each published a second after it was created, work IDs 'w-1' to
// 'w-1000000', kinds k0 to k6. Every fifth row (g % 5 = 0, numbered k =
// g / 5 among them) is in an aggregate of type 'order': k up to 150,000 in
// 15,000 aggregates of 10 rows ('o0' to 'o14999'; aggregateRow gives the
// work ID of a seq), the other 50,000 in one long aggregate, 'long', whose
// history an ordered statement must not read down through.
const (
	scaleRows    = 1_000_000
	shortAggs    = 15_000
	shortAggSize = 10
	longHistory  = scaleRows/5 - shortAggs*shortAggSize
)

// aggregateRow is the work ID of seq of the short aggregate o<agg>.
func aggregateRow(agg, seq int) string {
	k := agg*shortAggSize + seq
	return fmt.Sprintf("w-%d", 5*k)
}

// longTop is the work ID of the long aggregate's last row.
const longTop = "w-1000000"

var scaleBase struct {
	once  sync.Once
	name  string
	taken time.Duration
	err   error
}

// scaleDatabase returns the URL of a database of t's own holding the
// million-row table (migrated, VACUUM (ANALYZE)d, autovacuum off for it: the
// tests analyze when they have added their rows, and a vacuum or analyze
// behind their backs would change the plans they check).
func scaleDatabase(t *testing.T) string {
	t.Helper()
	if testing.Short() {
		t.Skip("loads a million rows")
	}
	pg := testenv.Shared(t).PG
	scaleBase.once.Do(func() {
		start := time.Now()
		scaleBase.name = "scale_base"
		scaleBase.err = loadScaleBase(pg, scaleBase.name)
		scaleBase.taken = time.Since(start)
	})
	if scaleBase.err != nil {
		t.Fatalf("load the million-row table: %v", scaleBase.err)
	}
	start := time.Now()
	url := pg.CreateDatabaseFrom(t, scaleBase.name)
	t.Logf("the million-row table: loaded once in %s, copied in %s", scaleBase.taken.Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
	return url
}

func loadScaleBase(pg *testenv.Postgres, name string) error {
	ctx := context.Background()
	admin, err := pgx.Connect(ctx, pg.URL("postgres"))
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, pg.URL(name))
	if err != nil {
		return err
	}
	// A template must have no connection when it is copied.
	defer conn.Close(ctx)
	if _, err := schema.Migrate(ctx, conn, testenv.OutboxTable); err != nil {
		return fmt.Errorf("migrate: %w", err)
	}
	// The migrations' indexes (other than the primary key) are built after
	// the load, from their own definitions: faster than a million inserts
	// into each.
	rows, err := conn.Query(ctx, `SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index
		WHERE indrelid = 'outbox'::regclass AND NOT indisprimary`)
	if err != nil {
		return err
	}
	var drop, build []string
	var idx, def string
	if _, err := pgx.ForEachRow(rows, []any{&idx, &def}, func() error {
		drop, build = append(drop, `DROP INDEX `+idx), append(build, def)
		return nil
	}); err != nil {
		return err
	}
	if len(build) < 4 {
		return fmt.Errorf("indexes of the outbox table: %v", build)
	}
	load := append(drop,
		`ALTER TABLE outbox SET (autovacuum_enabled = false)`,
		fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload, state, created_at, available_at, published_at, stream_seq, stream_name,
			aggregate_type, aggregate_id, aggregate_seq)
		SELECT 'w-' || g, 'k' || (g %% 7), '{"n":1}', 'published', b.t + g * interval '1 ms', b.t + g * interval '1 ms',
			b.t + g * interval '1 ms' + interval '1 s', g, 'OUTBOX',
			CASE WHEN g %% 5 = 0 THEN 'order' END,
			CASE WHEN g %% 5 = 0 THEN CASE WHEN g / 5 <= %[2]d THEN 'o' || (g / 5 - 1) / %[3]d ELSE 'long' END END,
			CASE WHEN g %% 5 = 0 THEN CASE WHEN g / 5 <= %[2]d THEN (g / 5 - 1) %% %[3]d + 1 ELSE g / 5 - %[2]d END END
		FROM generate_series(1, %[1]d) g, (SELECT clock_timestamp() - interval '30 days' AS t) b`,
			scaleRows, shortAggs*shortAggSize, shortAggSize),
		`SET maintenance_work_mem = '128MB'`,
	)
	load = append(load, build...)
	load = append(load, `VACUUM (ANALYZE) outbox`)
	for _, q := range load {
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("%w\n%s", err, q)
		}
	}
	return nil
}

// planNode is a node of EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON).
type planNode struct {
	NodeType string     `json:"Node Type"`
	Relation string     `json:"Relation Name"`
	Alias    string     `json:"Alias"`
	Index    string     `json:"Index Name"`
	Hit      int64      `json:"Shared Hit Blocks"`
	Read     int64      `json:"Shared Read Blocks"`
	Plans    []planNode `json:"Plans"`
}

// walk calls f on n and every node below it.
func (n planNode) walk(f func(planNode)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

// analyzed is one statement's EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON).
type analyzed struct {
	root           planNode
	execMs, planMs float64
	buffers        int64 // shared buffers hit or read by the whole statement
	jitFunctions   int   // 0: no JIT
}

// seqScans lists the nodes that read relation sequentially.
func (a analyzed) seqScans(relation string) []string {
	var out []string
	a.root.walk(func(n planNode) {
		if n.NodeType == "Seq Scan" && n.Relation == relation {
			out = append(out, "Seq Scan on "+n.Relation+" "+n.Alias)
		}
	})
	return out
}

// indexes lists the indexes the plan reads, in plan order.
func (a analyzed) indexes() []string {
	var out []string
	a.root.walk(func(n planNode) {
		if n.Index != "" {
			out = append(out, n.Index)
		}
	})
	return out
}

// beginner is a *pgx.Conn or a *pgxpool.Pool.
type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// explainAnalyze runs sql with args (as the store ran it: a leading
// pgx.QueryExecMode among args applies) under EXPLAIN (ANALYZE, BUFFERS) in
// a transaction it rolls back, so a claim, a sweep or a prune changes
// nothing.
func explainAnalyze(ctx context.Context, t *testing.T, db beginner, sql string, args ...any) analyzed {
	t.Helper()
	var raw []byte
	inRollback(ctx, t, db, func(tx pgx.Tx) {
		if err := tx.QueryRow(ctx, "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "+sql, args...).Scan(&raw); err != nil {
			t.Fatalf("explain: %v\n%s", err, sql)
		}
	})
	var out []struct {
		Plan     planNode `json:"Plan"`
		Exec     float64  `json:"Execution Time"`
		Planning float64  `json:"Planning Time"`
		JIT      *struct {
			Functions int `json:"Functions"`
		} `json:"JIT"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || len(out) != 1 {
		t.Fatalf("explain output %s: %v", raw, err)
	}
	a := analyzed{root: out[0].Plan, execMs: out[0].Exec, planMs: out[0].Planning, buffers: out[0].Plan.Hit + out[0].Plan.Read}
	if out[0].JIT != nil {
		a.jitFunctions = out[0].JIT.Functions
	}
	return a
}

// explainText is the text of sql's EXPLAIN (ANALYZE, BUFFERS), run as
// explainAnalyze runs it.
func explainText(ctx context.Context, t *testing.T, db beginner, sql string, args ...any) string {
	t.Helper()
	var text string
	inRollback(ctx, t, db, func(tx pgx.Tx) {
		rows, err := tx.Query(ctx, "EXPLAIN (ANALYZE, BUFFERS) "+sql, args...)
		text = store.PlanText(t, rows, err)
	})
	return text
}

func inRollback(ctx context.Context, t *testing.T, db beginner, f func(pgx.Tx)) {
	t.Helper()
	tx, err := db.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // the plan only: what the statement did must not stay
	f(tx)
}
