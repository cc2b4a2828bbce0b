package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// recorder keeps the statements a pool runs, with their arguments.
type recorder struct {
	mu    sync.Mutex
	stmts []recorded
}

type recorded struct {
	sql  string
	args []any
}

func (r *recorder) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	r.mu.Lock()
	r.stmts = append(r.stmts, recorded{d.SQL, d.Args})
	r.mu.Unlock()
	return ctx
}

func (r *recorder) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (r *recorder) take() []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := r.stmts
	r.stmts = nil
	return out
}

// G16: every statement the table metrics, the console, status and prune run
// on a table of a million rows (mostly published, a fifth of them in
// aggregates, a few hundred ready, scheduled, running, failed, cancelled and
// expired, one dead letter holding an aggregate) reads it through an index:
// the outbox table's seq_scan does not move while the statement runs, no
// plan (EXPLAIN ANALYZE of the very statement with its arguments) has a Seq
// Scan of it, and none reads more than a small part of the table's pages.
// The latencies it logs are in docs/benchmarks-scale.md.
func TestObserverStatementsAtScale(t *testing.T) {
	ctx := context.Background()
	url := scaleDatabase(t)
	tbl := testenv.OutboxTable

	// The store's statements run on one connection, so that the statistics
	// it reports are flushed by one pg_stat_force_next_flush() on it.
	rec := &recorder{}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1
	cfg.ConnConfig.Tracer = rec
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := store.New(pool, tbl, store.PolicyMark)
	ex := connect(t, url)

	start := time.Now()
	// The million published rows are the shared table's (scaleDatabase);
	// the rows of the other states are this test's.
	load := []string{
		`INSERT INTO outbox (work_id, kind, payload, state) SELECT 'ready-' || g, 'k1', '{}', 'ready' FROM generate_series(1, 200) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, created_at, available_at)
		SELECT 'sched-' || g, 'k2', '{}', 'scheduled', clock_timestamp() - interval '2 days', clock_timestamp() - g * interval '1 s'
		FROM generate_series(1, 100) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, claimed_by, lease_until)
		SELECT 'run-' || g, 'k2', '{}', 'running', 'worker', clock_timestamp() + interval '1 minute' FROM generate_series(1, 20) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, last_error, attempts, created_at, available_at)
		SELECT 'failed-' || g, 'k3', '{}', 'failed', 'rejected: max_payload: too big', 5,
			clock_timestamp() - g * interval '1 hour', clock_timestamp() - g * interval '1 minute'
		FROM generate_series(1, 50) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, created_at, redriven_at, redriven_by, redrive_reason)
		SELECT 'canc-' || g, 'k4', '{}', 'cancelled', clock_timestamp() - interval '40 days', clock_timestamp() - interval '40 days', 'op', 'test'
		FROM generate_series(1, 30) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, created_at, expires_at, last_error)
		SELECT 'exp-' || g, 'k4', '{}', 'expired', clock_timestamp() - interval '40 days', clock_timestamp() - interval '39 days', 'expired: deadline passed; never attempted'
		FROM generate_series(1, 30) g`,
		// One dead letter holding its aggregate: 5 rows wait behind it.
		`INSERT INTO outbox (work_id, kind, payload, state, last_error, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('held-1', 'k5', '{}', 'failed', 'rejected: max_payload: too big', 'order', 'held', 1)`,
		`INSERT INTO outbox (work_id, kind, payload, state, last_error, aggregate_type, aggregate_id, aggregate_seq)
		SELECT 'held-' || g, 'k5', '{}', 'scheduled', 'held: waiting for held-1', 'order', 'held', g FROM generate_series(2, 6) g`,
	}
	load = append(load, `VACUUM (ANALYZE) outbox`)
	for _, q := range load {
		if _, err := ex.Exec(ctx, q); err != nil {
			t.Fatalf("load: %v\n%s", err, q)
		}
	}
	var pages int64
	if err := ex.QueryRow(ctx, `SELECT pg_relation_size('outbox') / current_setting('block_size')::bigint`).Scan(&pages); err != nil {
		t.Fatal(err)
	}
	t.Logf("loaded %d rows (%d pages) in %s", scaleRows+436, pages, time.Since(start).Round(time.Millisecond))

	seqScans := func() int64 {
		t.Helper()
		// Flush what the store's connection and this one counted.
		if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		if _, err := ex.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := ex.QueryRow(ctx, `SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// maxBlocks bounds the pages one statement may touch (buffer accesses,
	// EXPLAIN's BUFFERS): a small part of the table, or for a statement
	// that deletes a batch, a few per row of it.
	maxBlocks := pages / 20

	// check runs one store call and holds every statement it ran to G16.
	check := func(t *testing.T, name string, call func() error) {
		t.Helper()
		rec.take()
		before := seqScans()
		rec.take()
		if err := call(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		stmts := rec.take()
		if after := seqScans(); after != before {
			t.Errorf("%s: the outbox table was scanned sequentially %d times", name, after-before)
		}
		rec.take()
		for i, s := range stmts {
			if !strings.Contains(s.sql, tbl.String()) {
				continue // the clock, the catalog
			}
			// The statement as the store ran it, its arguments included.
			p := explainAnalyze(ctx, t, ex, s.sql, s.args...)
			if scans := p.seqScans("outbox"); len(scans) > 0 {
				t.Errorf("%s: statement %d scans the outbox table sequentially:\n%s", name, i, s.sql)
			}
			if p.buffers > maxBlocks {
				t.Errorf("%s: statement %d touched %d pages, more than %d (a twentieth of the table):\n%s", name, i, p.buffers, maxBlocks, s.sql)
			}
			jit := ""
			if p.jitFunctions > 0 {
				jit = fmt.Sprintf(", JIT (%d functions)", p.jitFunctions)
			}
			t.Logf("%-28s stmt %d: %7.2f ms (planning %.2f ms), %5d pages, indexes %v%s", name, i, p.execMs, p.planMs, p.buffers, p.indexes(), jit)
		}
	}

	t.Run("Counts", func(t *testing.T) {
		var c store.Counts
		check(t, "Counts", func() (err error) { c, err = st.Counts(ctx); return err })
		want := map[string]int64{"ready": 200, "scheduled": 105, "running": 20, "failed": 51, "cancelled": 30, "expired": 30}
		for s, n := range want {
			if c.ByState[s] != n {
				t.Errorf("%s: %d, want %d", s, c.ByState[s], n)
			}
		}
		// The planner's estimate after VACUUM ANALYZE: within a percent.
		if p := c.ByState["published"]; !c.PublishedEstimated || p < scaleRows*99/100 || p > scaleRows*101/100 {
			t.Errorf("published: %d (estimated %v), want about %d", p, c.PublishedEstimated, scaleRows)
		}
		if c.ReadyAtLeast || c.Watermark != nil || c.PublishedByWatermark != 0 || c.PublishedByWatermarkAtLeast ||
			c.FailedByReason["rejected: max_payload"] != 51 || c.BlockedAggregates != 1 ||
			c.OldestBlocked == nil || c.OldestBlocked.WorkID != "held-1" || c.OldestBlocked.Waiting != 5 {
			t.Errorf("counts: %+v, oldest blocked %+v", c, c.OldestBlocked)
		}
		// The oldest due scheduled row became due 100 s ago.
		if c.OldestEligibleSeconds < 100 || c.OldestEligibleSeconds > 3600 {
			t.Errorf("oldest eligible: %.1fs, want about 100", c.OldestEligibleSeconds)
		}
	})
	t.Run("OldestReady", func(t *testing.T) {
		var age float64
		check(t, "OldestReadySeconds", func() (err error) { age, err = st.OldestReadySeconds(ctx); return err })
		if age <= 0 || age > 3600 {
			t.Errorf("oldest ready: %.1fs", age)
		}
	})
	t.Run("RecentFailures", func(t *testing.T) {
		var m map[string]int64
		check(t, "RecentFailures", func() (err error) { m, err = st.RecentFailures(ctx, 10*time.Minute); return err })
		// failed-1..9 became due within the last 10 minutes, and held-1.
		if m["rejected: max_payload"] != 10 {
			t.Errorf("recent failures: %v, want 10", m)
		}
	})
	lists := []struct {
		name string
		f    store.ListFilter
		want int
	}{
		{"all", store.ListFilter{}, 50},
		{"published", store.ListFilter{State: "published"}, 50},
		{"ready", store.ListFilter{State: "ready"}, 50},
		{"scheduled", store.ListFilter{State: "scheduled"}, 50},
		{"running", store.ListFilter{State: "running"}, 20},
		{"failed", store.ListFilter{State: "failed"}, 50},
		{"failed kind", store.ListFilter{State: "failed", Kind: "k5"}, 1},
		{"failed rejected", store.ListFilter{State: "failed", ErrorClass: "rejected"}, 50},
		{"cancelled", store.ListFilter{State: "cancelled"}, 30},
		{"expired older than a day", store.ListFilter{State: "expired", MinAge: 24 * time.Hour}, 30},
		{"published last hour", store.ListFilter{State: "published", MaxAge: time.Hour}, 0},
		{"older than 29 days", store.ListFilter{MinAge: 29 * 24 * time.Hour}, 50},
	}
	for _, l := range lists {
		t.Run("ListRows "+l.name, func(t *testing.T) {
			f := l.f
			f.Limit, f.PayloadChars = 50, 100
			var rows []store.ListedRow
			check(t, "ListRows "+l.name, func() (err error) { rows, err = st.ListRows(ctx, f); return err })
			if len(rows) != l.want {
				t.Fatalf("%d rows, want %d", len(rows), l.want)
			}
			if len(rows) == 0 {
				return
			}
			// The next page, after the last row of this one.
			last := rows[len(rows)-1]
			f.After = &store.Cursor{CreatedAt: last.CreatedAt, WorkID: last.WorkID}
			var next []store.ListedRow
			check(t, "ListRows "+l.name+" page 2", func() (err error) { next, err = st.ListRows(ctx, f); return err })
			for _, r := range next {
				if !r.CreatedAt.After(last.CreatedAt) && !(r.CreatedAt.Equal(last.CreatedAt) && r.WorkID > last.WorkID) {
					t.Fatalf("page 2 has %s, not after %s", r.WorkID, last.WorkID)
				}
			}
		})
	}
	t.Run("ListWorkIDs", func(t *testing.T) {
		var ids []string
		var more bool
		check(t, "ListWorkIDs failed", func() (err error) {
			ids, more, err = st.ListWorkIDs(ctx, store.ListFilter{State: "failed"}, 20)
			return err
		})
		if len(ids) != 20 || !more {
			t.Errorf("%d IDs, more %v", len(ids), more)
		}
	})
	t.Run("Cancel and RecentHistory", func(t *testing.T) {
		check(t, "Cancel by work ID", func() error {
			_, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"failed-50"}}, By: "op", Reason: "test"})
			return err
		})
		var h []store.History
		check(t, "RecentHistory", func() (err error) { h, err = st.RecentHistory(ctx, 100); return err })
		if len(h) != 1 {
			t.Errorf("history: %+v", h)
		}
	})
	t.Run("Prune", func(t *testing.T) {
		// Old enough: the rows published in the table's first two seconds,
		// and the cancelled and expired rows of 40 days ago.
		var secs float64
		if err := ex.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - (SELECT published_at FROM outbox WHERE work_id = 'w-2000'))::float8`).
			Scan(&secs); err != nil {
			t.Fatal(err)
		}
		older := time.Duration(secs * float64(time.Second))
		const batch = 500
		maxBlocks = 8 * batch
		var dry, res store.PruneResult
		check(t, "Prune dry run", func() (err error) {
			dry, err = st.Prune(ctx, store.PruneRequest{OlderThan: older, Batch: batch, IncludeCancelled: true, DryRun: true})
			return err
		})
		check(t, "Prune", func() (err error) {
			res, err = st.Prune(ctx, store.PruneRequest{OlderThan: older, Batch: batch, IncludeCancelled: true})
			return err
		})
		// The clock moves on between the reads of the cutoff: a row a
		// millisecond.
		if res.Published < 2000 || res.Published > 62000 || dry.Published < 2000 || dry.Published > res.Published ||
			res.Cancelled != 30 || res.Expired != 30 || dry.Cancelled != 30 || dry.Expired != 30 {
			t.Errorf("prune: %+v, dry run %+v; want 2000 published or a few more, 30 cancelled, 30 expired", res, dry)
		}
		var left int64
		if err := ex.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE created_at < $1 AND state IN ('published', 'cancelled', 'expired')
			AND coalesce(published_at, expires_at, redriven_at) < $1`, res.Cutoff).Scan(&left); err != nil || left != 0 {
			t.Errorf("%d rows older than the cutoff left, %v", left, err)
		}
	})
	// --on-publish none (G17): 20,000 rows left 'ready' as inserted and a
	// watermark covering them (and the 200 ready rows of the load), then
	// 200 rows it does not cover. The figures that split 'ready' by the
	// watermark still read only the newest rows, and the filters and the
	// prune still walk created_idx; the watermark is read from the small
	// outbox_slots (a Seq Scan there is fine, and not counted).
	t.Run("none", func(t *testing.T) {
		for _, q := range []string{
			`INSERT INTO outbox (work_id, kind, payload) SELECT 'none-' || g, 'k1', '{}' FROM generate_series(1, 20000) g`,
			`INSERT INTO outbox_slots (slot_name) VALUES ('outbox_relay')`,
			`UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`,
			`INSERT INTO outbox (work_id, kind, payload) SELECT 'fly-' || g, 'k1', '{}' FROM generate_series(1, 200) g`,
			`ANALYZE outbox`,
		} {
			if _, err := ex.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		maxBlocks = pages / 20
		var c store.Counts
		check(t, "Counts under none", func() (err error) { c, err = st.Counts(ctx); return err })
		if c.ByState["ready"] != 200 || c.ReadyAtLeast || c.PublishedByWatermark != store.RecentRows-200 || !c.PublishedByWatermarkAtLeast ||
			!c.PublishedEstimated || c.Watermark == nil {
			t.Errorf("counts under none: %+v", c)
		}
		var age float64
		check(t, "OldestReadySeconds under none", func() (err error) { age, err = st.OldestReadySeconds(ctx); return err })
		if age <= 0 || age > 600 {
			t.Errorf("oldest ready under none: %.1fs, want the fly- rows' age", age)
		}
		for _, l := range []struct {
			state string
			first string
		}{{"ready", "fly-"}, {"published", "w-"}} {
			var rows []store.ListedRow
			check(t, "ListRows "+l.state+" under none", func() (err error) {
				rows, err = st.ListRows(ctx, store.ListFilter{State: l.state, Limit: 50, PayloadChars: 100})
				return err
			})
			if len(rows) != 50 || !strings.HasPrefix(rows[0].WorkID, l.first) {
				t.Errorf("%s under none: %d rows, first %+v", l.state, len(rows), rows[0])
			}
		}
		var rows []store.ListedRow
		check(t, "ListRows published last hour under none", func() (err error) {
			rows, err = st.ListRows(ctx, store.ListFilter{State: "published", MaxAge: time.Hour, Limit: 50})
			return err
		})
		if len(rows) != 50 || !rows[0].Covered {
			t.Errorf("published in the last hour under none: %d rows, first %+v", len(rows), rows)
		}
		// The prune's walk of the oldest rows left (w-2001..w-4000), with the
		// covered condition in it.
		var secs float64
		if err := ex.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - (SELECT published_at FROM outbox WHERE work_id = 'w-4000'))::float8`).
			Scan(&secs); err != nil {
			t.Fatal(err)
		}
		var dry store.PruneResult
		check(t, "Prune dry run under none", func() (err error) {
			dry, err = st.Prune(ctx, store.PruneRequest{OlderThan: time.Duration(secs * float64(time.Second)), Batch: 500, DryRun: true})
			return err
		})
		// The prune above took w-2000 or a few more (the clock moves on): so
		// up to 2000 rows, or a few more for the same reason.
		if dry.Published < 1000 || dry.Published > 62000 || dry.Covered != 0 {
			t.Errorf("prune dry run under none: %+v, want up to about 2000 published, none covered", dry)
		}
	})
}
