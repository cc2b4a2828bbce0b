package store

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// ExplainSettle returns the plan of the settle statement with one-element
// arrays, as the tests in store_test need it.
func ExplainSettle(ctx context.Context, t *testing.T, pool *pgxpool.Pool, tbl Table, policy Policy) string {
	t.Helper()
	args := []any{[]string{"new-1"}, []int64{1}, []string{"S"}, []string{""}, []string{"x"}, []string{"y"}, []string{"e"}, []int64{1}, []string{"h"}, []string{"held"}}
	if policy == PolicyDelete {
		args = []any{[]string{"new-1"}, []string{"x"}, []string{"y"}, []string{"e"}, []int64{1}, []string{"h"}, []string{"held"}}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	rows, err := tx.Query(ctx, "EXPLAIN "+buildSettleSQL(tbl, policy), args...)
	return PlanText(t, rows, err)
}

// PlanText is the text of an EXPLAIN query's result.
func PlanText(t *testing.T, rows pgx.Rows, err error) string {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return strings.Join(lines, "\n")
}

// ParseLSN is parseLSN, for the watermark's position.
var ParseLSN = parseLSN
