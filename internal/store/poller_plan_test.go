package store_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The poller's batch statements must keep their plans when the table's
// statistics lag: a backlog that has just arrived and was never analyzed,
// or statistics taken while no row was running. Both made the planner read
// the whole table per claim, or rescan the batch for every row.
func TestPollerPlansWithoutStatistics(t *testing.T) {
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	conn.Close(ctx)
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	// Autovacuum would analyze the table behind the test's back.
	if _, err := pool.Exec(ctx, `ALTER TABLE outbox SET (autovacuum_enabled = false)`); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 20000; i += 1000 {
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
			SELECT 'w' || g, 'k', jsonb_build_object('pad', repeat('x', 180)), 'scheduled' FROM generate_series($1::int, $2::int) g`, i+1, i+1000); err != nil {
			t.Fatal(err)
		}
	}
	const batch = 1000
	ids := make([]string, batch)
	gens := make([]int64, batch)
	for i := range ids {
		ids[i], gens[i] = fmt.Sprintf("w%d", 3*i+1), 1
	}
	s := store.New(pool, tbl, store.PolicyMark)
	for _, stats := range []string{"none", "analyzed before the claims"} {
		if stats != "none" {
			if _, err := pool.Exec(ctx, `ANALYZE outbox`); err != nil {
				t.Fatal(err)
			}
		}
		t.Run("claim, statistics "+stats, func(t *testing.T) {
			for _, ordered := range []bool{false, true} {
				plan := explain(ctx, t, pool, s.ClaimSQL(ordered), batch, "w", int64(time.Minute/time.Microsecond), int64(time.Second/time.Microsecond), int64(0))
				if !strings.Contains(plan, "Index Scan using outbox_poll_idx on outbox q") || sortsTheTable(plan) {
					t.Errorf("ordered %v: claim plan reads the table and sorts it:\n%s", ordered, plan)
				}
			}
		})
		for _, policy := range []store.Policy{store.PolicyMark, store.PolicyDelete} {
			t.Run(fmt.Sprintf("complete %s, statistics %s", policy, stats), func(t *testing.T) {
				streams := make([]string, len(ids))
				args := []any{ids, "w", gens, gens, streams, streams}
				if policy == store.PolicyDelete {
					args = args[:3]
				}
				plan := explain(ctx, t, pool, store.CompleteSQL(tbl, policy), args...)
				wantByKey(t, plan)
			})
		}
		t.Run("renew, statistics "+stats, func(t *testing.T) {
			wantByKey(t, explain(ctx, t, pool, store.RenewSQL(tbl), ids, "w", gens, int64(time.Minute/time.Microsecond)))
		})
	}
}

// sortsTheTable reports a sort in plan other than the ordered claim's sort
// of its runs (at most a batch of rows already taken, by their head's
// poll_at and sequence).
func sortsTheTable(plan string) bool {
	for _, line := range strings.Split(plan, "\n") {
		// The newest watermark (G17) is sorted out of the table's slot
		// records, a row or two; only a sort of the outbox counts.
		if strings.Contains(line, "Sort") && !strings.Contains(line, "Sort Key: r.poll_at, r.aggregate_seq") &&
			!strings.Contains(line, "Sort Key: w.watermark_lsn DESC") &&
			!strings.Contains(line, "Sort  (") {
			return true
		}
	}
	return false
}

// wantByKey fails unless each claim is matched to its row by a key: an
// index lookup per claim or a hash of the table, never a join filter that
// compares every row found with every claim.
func wantByKey(t *testing.T, plan string) {
	t.Helper()
	if strings.Contains(plan, "Join Filter") || !(strings.Contains(plan, "Index Cond: (work_id = u.work_id)") || strings.Contains(plan, "Hash Cond")) {
		t.Errorf("claims not matched by key:\n%s", plan)
	}
}

func explain(ctx context.Context, t *testing.T, pool *pgxpool.Pool, sql string, args ...any) string {
	t.Helper()
	// Run as the statements run: unnamed, planned for these arguments.
	rows, err := pool.Query(ctx, "EXPLAIN "+sql, append([]any{store.Unplanned}, args...)...)
	return store.PlanText(t, rows, err)
}
