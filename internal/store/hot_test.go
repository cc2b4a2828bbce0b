package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The CDC path's marks (ready -> published) must stay HOT updates: no index
// may read a column a mark changes (state, published_at, stream_seq,
// stream_name), in its key or its predicate. A non-HOT mark writes a new
// entry into every index of the table and leaves dead ones for vacuum, for
// every row the relay publishes. The indexes and triggers of order per
// aggregate (migration 0011) keep the held set without one; the second
// case is the index it did not add, a partial index on the held states,
// to show the measurement tells them apart.
func TestCDCMarksStayHOT(t *testing.T) {
	for _, c := range []struct {
		name  string
		extra string // an index created after the migrations
		hot   func(hot, upd int64) bool
		want  string
	}{
		{"as migrated", "", func(hot, upd int64) bool { return hot*100 >= upd*95 }, "at least 95% HOT"},
		{"with a partial index on the held states", `CREATE INDEX outbox_state_held_idx ON outbox (aggregate_type, aggregate_id, aggregate_seq)
			WHERE state IN ('scheduled', 'running', 'failed')`, func(hot, upd int64) bool { return hot*100 <= upd*5 }, "at most 5% HOT"},
	} {
		t.Run(c.name, func(t *testing.T) {
			hot, upd := markRows(t, c.extra)
			t.Logf("%d marks: %d updates, %d HOT (%.1f%%)", 1000, upd, hot, 100*float64(hot)/float64(max(upd, 1)))
			if upd != 1000 || !c.hot(hot, upd) {
				t.Errorf("1,000 marks made %d updates of which %d HOT, want 1,000 updates, %s", upd, hot, c.want)
			}
		})
	}
}

// markRows inserts 1,000 ready rows (half in aggregates, one dead letter in
// the table), marks them published through the CDC path's settle statement
// and returns the table's HOT and total updates over the marks.
func markRows(t *testing.T, extra string) (hot, upd int64) {
	t.Helper()
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := store.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	// One connection, so that pg_stat_force_next_flush() flushes the
	// backend that made the updates.
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
	for _, q := range []string{
		`ALTER TABLE outbox SET (autovacuum_enabled = false)`,
		`INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
			SELECT 'w' || g, 'k', jsonb_build_object('pad', repeat('x', 180)),
				CASE WHEN g % 2 = 0 THEN 'order' END, CASE WHEN g % 2 = 0 THEN 'o' || g % 50 END, CASE WHEN g % 2 = 0 THEN g END
			FROM generate_series(1, 1000) g`,
		`INSERT INTO outbox (work_id, kind, payload, state, last_error, aggregate_type, aggregate_id, aggregate_seq)
			VALUES ('dead', 'k', '{}', 'failed', 'rejected: x', 'order', 'o1', 100000)`,
		extra,
	} {
		if q == "" {
			continue
		}
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	counts := func() (hot, upd int64) {
		t.Helper()
		if _, err := pool.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, `SELECT n_tup_hot_upd, n_tup_upd FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&hot, &upd); err != nil {
			t.Fatal(err)
		}
		return hot, upd
	}
	hot0, upd0 := counts()
	s := store.New(pool, tbl, store.PolicyMark)
	// In batches of 100, as the relay settles them.
	for b := 0; b < 10; b++ {
		items := make([]store.Settle, 100)
		for i := range items {
			n := b*100 + i + 1
			items[i] = store.Settle{WorkID: fmt.Sprintf("w%d", n), Outcome: store.Published, Seq: uint64(n), Stream: "OUTBOX"}
		}
		settled, err := s.SettleRows(ctx, items)
		if err != nil {
			t.Fatal(err)
		}
		for i, ok := range settled {
			if !ok {
				t.Fatalf("%s not settled", items[i].WorkID)
			}
		}
	}
	var published int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&published); err != nil || published != 1000 {
		t.Fatalf("%d rows published (%v), want 1000", published, err)
	}
	// The statistics of the marks reach the shared counters at the next
	// flush; poll briefly in case one comes late.
	deadline := time.Now().Add(10 * time.Second)
	for {
		hot1, upd1 := counts()
		if upd1-upd0 >= 1000 || time.Now().After(deadline) {
			return hot1 - hot0, upd1 - upd0
		}
		time.Sleep(100 * time.Millisecond)
	}
}
