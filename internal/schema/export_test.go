package schema

import (
	"context"

	"github.com/jackc/pgx/v5"
)

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
