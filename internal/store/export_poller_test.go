package store

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ExplainClaim returns the plan of the poller's claim statement.
func ExplainClaim(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tbl Table, batch int) string {
	t.Helper()
	s := New(pool, tbl, PolicyMark)
	rows, err := pool.Query(ctx, "EXPLAIN "+s.claimSQL(true), batch, "explain", int64(1e6), int64(1e6), int64(0))
	return PlanText(t, rows, err)
}
