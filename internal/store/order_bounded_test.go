package store_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BlockedAggregates looks at a bounded number of held aggregates (G16) and
// still counts by the rule of G12. On a plain table, below the bound, the
// count is exact: an aggregate held with nothing behind its row (a delayed
// row), and one whose held row waits for the CDC path's 'ready' row right
// below it, are not blocked; one held by a dead letter and one by a running
// row are. On a partitioned table the bound is store.BlockedLookAt divided
// by its partitions: 400 held aggregates with nothing behind, then a
// blocked one, read as "0 or more" of the first so many; more blocked ones
// than the bound read as at least the bound, the oldest of those first.
func TestBlockedAggregatesBounded(t *testing.T) {
	ctx := context.Background()
	pg := testenv.Shared(t).PG

	t.Run("plain", func(t *testing.T) {
		url := pg.CreateOutboxDatabase(t)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, last_error, available_at, claimed_by, lease_until, created_at,
				aggregate_type, aggregate_id, aggregate_seq) VALUES
			('delayed-1', 'k', '{}', 'scheduled', NULL, clock_timestamp() + interval '1 hour', NULL, NULL, clock_timestamp() - interval '5 hours', 'a', 'delayed', 1),
			('cdc-1', 'k', '{}', 'ready', NULL, clock_timestamp(), NULL, NULL, clock_timestamp() - interval '4 hours', 'a', 'cdc', 1),
			('cdc-2', 'k', '{}', 'scheduled', 'held: waiting', clock_timestamp(), NULL, NULL, clock_timestamp() - interval '4 hours', 'a', 'cdc', 2),
			('cdc-3', 'k', '{}', 'scheduled', 'held: waiting', clock_timestamp(), NULL, NULL, clock_timestamp() - interval '4 hours', 'a', 'cdc', 3),
			('dead-1', 'k', '{}', 'published', NULL, clock_timestamp(), NULL, NULL, clock_timestamp() - interval '3 hours', 'a', 'dead', 1),
			('dead-2', 'k', '{}', 'failed', 'rejected: x', clock_timestamp(), NULL, NULL, clock_timestamp() - interval '3 hours', 'a', 'dead', 2),
			('dead-3', 'k', '{}', 'ready', NULL, clock_timestamp(), NULL, NULL, clock_timestamp() - interval '3 hours', 'a', 'dead', 3),
			('run-1', 'k', '{}', 'running', NULL, clock_timestamp(), 'w', clock_timestamp() + interval '1 minute', clock_timestamp() - interval '2 hours', 'a', 'run', 1),
			('run-2', 'k', '{}', 'scheduled', 'held: waiting', clock_timestamp(), NULL, NULL, clock_timestamp() - interval '2 hours', 'a', 'run', 2),
			('run-3', 'k', '{}', 'scheduled', 'held: waiting', clock_timestamp(), NULL, NULL, clock_timestamp() - interval '2 hours', 'a', 'run', 3)`); err != nil {
			t.Fatal(err)
		}
		set, err := store.New(pool, testenv.OutboxTable, store.PolicyMark).BlockedAggregates(ctx, 5)
		if err != nil {
			t.Fatal(err)
		}
		if set.Total != 2 || set.AtLeast || set.LookedAt != store.BlockedLookAt || len(set.Oldest) != 2 ||
			set.Oldest[0].WorkID != "dead-2" || set.Oldest[0].Waiting != 1 || set.Oldest[0].State != store.StateFailed ||
			set.Oldest[1].WorkID != "run-1" || set.Oldest[1].Waiting != 2 || set.Oldest[1].State != store.StateRunning {
			t.Errorf("blocked: %+v; want exactly 2: dead-2 (failed, 1 waiting), run-1 (running, 2 waiting)", set)
		}
	})

	t.Run("partitioned", func(t *testing.T) {
		url := pg.CreateDatabase(t)
		conn := connect(t, url)
		if _, err := schema.MigrateWith(ctx, conn, testenv.OutboxTable, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
			t.Fatal(err)
		}
		var parts int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox'::regclass`).Scan(&parts); err != nil {
			t.Fatal(err)
		}
		budget := max(store.BlockedLookAt/parts, store.BlockedLookAtLeast)
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
		// 400 delayed rows of aggregates h000..h399, nothing behind them,
		// and after them in aggregate order one blocked aggregate.
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at, aggregate_type, aggregate_id, aggregate_seq)
			SELECT 'h-' || g, 'k', '{}', 'scheduled', clock_timestamp() + interval '1 hour', 'a', 'h' || lpad(g::text, 3, '0'), 1
			FROM generate_series(0, 399) g`); err != nil {
			t.Fatal(err)
		}
		testenv.InsertBlockedAggregates(t, pool, testenv.OutboxTable, 1)
		set, err := st.BlockedAggregates(ctx, 5)
		if err != nil {
			t.Fatal(err)
		}
		if set.Total != 0 || !set.AtLeast || set.LookedAt != budget || len(set.Oldest) != 0 {
			t.Errorf("blocked behind %d held ones: %+v; want 0 or more of the first %d (%d partitions)", 400, set, budget, parts)
		}
		if _, err := pool.Exec(ctx, `DELETE FROM outbox`); err != nil {
			t.Fatal(err)
		}
		oldest := testenv.InsertBlockedAggregates(t, pool, testenv.OutboxTable, budget+50)
		set, err = st.BlockedAggregates(ctx, 5)
		if err != nil {
			t.Fatal(err)
		}
		if set.Total != int64(budget) || !set.AtLeast || set.LookedAt != budget || len(set.Oldest) != 5 || set.Oldest[0].WorkID != oldest {
			t.Errorf("%d blocked: %+v; want at least %d, the oldest %s first", budget+50, set, budget, oldest)
		}
		c, err := st.Counts(ctx)
		if err != nil || c.BlockedAggregates != int64(budget) || !c.BlockedAggregatesAtLeast || c.OldestBlocked == nil || c.OldestBlocked.WorkID != oldest {
			t.Errorf("counts: blocked %d (at least %v), oldest %+v, %v", c.BlockedAggregates, c.BlockedAggregatesAtLeast, c.OldestBlocked, err)
		}
	})
}

// BenchmarkCountsWithBlockedAggregates is Counts (status, the overview and
// the table metrics read it) on a plain table of n blocked aggregates
// (testenv.InsertBlockedAggregates), for docs/benchmarks-scale.md:
//
//	go test -run '^$' -bench CountsWithBlockedAggregates -benchtime 3x ./internal/store/
func BenchmarkCountsWithBlockedAggregates(b *testing.B) {
	for _, n := range []int{1000, 5000, 20000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			ctx := context.Background()
			url := testenv.Shared(b).PG.CreateOutboxDatabase(b)
			pool, err := pgxpool.New(ctx, url)
			if err != nil {
				b.Fatal(err)
			}
			defer pool.Close()
			testenv.InsertBlockedAggregates(b, pool, testenv.OutboxTable, n)
			st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
			b.ResetTimer()
			for range b.N {
				c, err := st.Counts(ctx)
				if err != nil || c.BlockedAggregates != int64(min(n, store.BlockedLookAt)) {
					b.Fatalf("counts: %d blocked, %v", c.BlockedAggregates, err)
				}
			}
		})
	}
}
