package store_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The CDC path's mark (ready -> published) must stay a HOT update: PostgreSQL
// updates a row in place only when no column an index uses changes value,
// and the indexes migrations 0011 and 0012 add for order per aggregate and
// the observers (aggregate_held_idx, expires_idx, dead_letter_idx,
// created_idx, parked_idx, the parked column and its triggers) use none
// that the mark changes. Measured as pg_stat_user_tables.n_tup_hot_upd against n_tup_upd
// over 2,000 marks of rows with 200-byte payloads: exactly as many are HOT
// as migrated as without those objects (about 93%: the rest are marks whose new
// version did not fit on its page, since rows inserted together and marked
// in one batch cannot prune each other's old versions; a matter of page
// space, fillfactor 50, not of indexes), and the measurement is shown able
// to fail by an index whose predicate uses state (what a partial index per
// state would do), which makes every mark non-HOT.
func TestCDCMarksStayHOT(t *testing.T) {
	const rows, batch = 2000, 100
	hotWithout := int64(-1)
	for _, c := range []struct {
		name     string
		alter    []string
		asBefore bool
	}{
		{name: "without 0011's and 0012's objects", asBefore: true, alter: []string{
			`DROP INDEX outbox_aggregate_held_idx`, `DROP INDEX outbox_expires_idx`, `DROP INDEX outbox_dead_letter_idx`,
			`DROP INDEX outbox_created_idx`, `DROP INDEX outbox_parked_idx`,
			`DROP TRIGGER outbox_park_upd ON outbox`, `DROP TRIGGER outbox_park_ins ON outbox`,
			`ALTER TABLE outbox DROP COLUMN parked`}},
		{name: "as migrated", asBefore: true},
		{name: "with an index on state", alter: []string{`CREATE INDEX outbox_not_published ON outbox (created_at) WHERE state <> 'published'`}},
	} {
		t.Run(c.name, func(t *testing.T) {
			ctx := context.Background()
			url := testenv.Shared(t).PG.CreateOutboxDatabase(t)
			cfg, err := pgxpool.ParseConfig(url)
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 1 // one backend: one pg_stat_force_next_flush() flushes its counts
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			for _, q := range append(c.alter, fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload) SELECT 'm-' || g, 'k', jsonb_build_object('pad', repeat('x', 200)) FROM generate_series(1, %d) g`, rows)) {
				exec(t, pool, q)
			}
			updates := func() (upd, hot int64) {
				t.Helper()
				exec(t, pool, `SELECT pg_stat_force_next_flush()`)
				if err := pool.QueryRow(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).
					Scan(&upd, &hot); err != nil {
					t.Fatal(err)
				}
				return upd, hot
			}
			upd0, hot0 := updates()
			st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
			for b := 0; b < rows; b += batch {
				items := make([]store.Settle, batch)
				for i := range items {
					items[i] = store.Settle{WorkID: fmt.Sprintf("m-%d", b+i+1), Outcome: store.Published, Seq: uint64(b + i + 1), Stream: "OUTBOX"}
				}
				if _, err := st.SettleRows(ctx, items); err != nil {
					t.Fatal(err)
				}
			}
			upd1, hot1 := updates()
			upd, hot := upd1-upd0, hot1-hot0
			t.Logf("%s: %d of %d marks HOT", c.name, hot, upd)
			if upd != rows {
				t.Fatalf("%d updates, want %d marks", upd, rows)
			}
			switch {
			case !c.asBefore:
			case hotWithout < 0:
				hotWithout = hot
				if hot < upd*9/10 {
					t.Errorf("only %d of %d marks were HOT without 0012", hot, upd)
				}
			case hot != hotWithout:
				t.Errorf("%d of %d marks were HOT updates, %d without 0012's objects", hot, upd, hotWithout)
			}
			if !c.asBefore && hot != 0 {
				t.Errorf("with an index on state %d of %d marks were HOT, want none: the measurement cannot tell", hot, upd)
			}
		})
	}
}

// Counts says where it is not exact: ready rows beyond the newest
// store.RecentRows are not counted (ReadyAtLeast), and a small table's
// published rows are counted exactly. The parked column follows every
// move in and out of failed, cancelled and expired, whoever makes it.
func TestCountsSayHowExact(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload) SELECT 'r-' || g, 'k', '{}' FROM generate_series(1, %d) g`, store.RecentRows+50))
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, created_at)
		SELECT 'p-' || g, 'k', '{}', 'published', clock_timestamp(), clock_timestamp() - interval '1 day' FROM generate_series(1, 7) g`)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error) VALUES ('f', 'k', '{}', 'failed', 'rejected: max_payload: x')`)
	c, err := s.Counts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// The newest RecentRows rows: the failed row and all but 51 of the
	// ready ones.
	if c.ByState["ready"] != store.RecentRows-1 || !c.ReadyAtLeast || c.ByState["published"] != 7 || c.PublishedEstimated || c.ByState["failed"] != 1 {
		t.Fatalf("counts: %+v", c)
	}
	exec(t, pool, `UPDATE outbox SET state = 'published', published_at = clock_timestamp() WHERE state = 'ready'`)
	if c, err = s.Counts(ctx); err != nil || c.ReadyAtLeast || c.ByState["ready"] != 0 || c.ByState["published"] != store.RecentRows+57 {
		t.Fatalf("counts after the marks: %+v, %v", c, err)
	}
	if _, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"f"}}, By: "b", Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	var parked *string
	if err := pool.QueryRow(ctx, `SELECT parked FROM outbox WHERE work_id = 'f'`).Scan(&parked); err != nil || parked != nil {
		t.Fatalf("redriven row: parked %v, %v; want NULL", parked, err)
	}
	if _, err := s.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"f"}}, By: "b", Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	if c, err = s.Counts(ctx); err != nil || c.ByState["failed"] != 0 || c.ByState["scheduled"] != 0 || c.ByState["cancelled"] != 1 {
		t.Fatalf("counts after redrive and cancel: %+v, %v", c, err)
	}
}
