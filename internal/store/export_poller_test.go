package store

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ExplainClaim returns the plan of the poller's claim statement.
func ExplainClaim(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tbl Table, batch int) string {
	t.Helper()
	s := New(pool, tbl, PolicyMark)
	rows, err := pool.Query(ctx, "EXPLAIN "+s.claimSQL(true), batch, "explain", int64(1e6), int64(1e6))
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}
