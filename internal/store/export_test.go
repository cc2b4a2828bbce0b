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

// MigrateOnly applies migs (some of Migrations, or ones made with
// NewMigration) the way MigrateWith applies them all.
func MigrateOnly(ctx context.Context, conn *pgx.Conn, t Table, opts MigrateOptions, migs []Migration) ([]Migration, error) {
	return applyMigrations(ctx, conn, t, opts, migs)
}

// NewMigration reads a rendered migration as Migrations reads the embedded
// ones.
func NewMigration(version int, name, sql string) (Migration, error) {
	return newMigration(version, name, sql, Table{}, Layout{})
}

// ParseLSN is parseLSN, for the watermark's position.
var ParseLSN = parseLSN
