package store

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"sort"
	"strconv"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5"

	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

// Migration is one numbered schema change from sql/migrations.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations renders the embedded migrations for table t.
func Migrations(t Table) ([]Migration, error) {
	entries, err := fs.ReadDir(outboxsql.Migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	data := templateData{t}
	var out []Migration
	for _, e := range entries {
		file := e.Name()
		num, rest, ok := strings.Cut(strings.TrimSuffix(file, ".sql"), "_")
		version, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration file %q: want NNNN_name.sql", file)
		}
		src, err := fs.ReadFile(outboxsql.Migrations, "migrations/"+file)
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", file, err)
		}
		tmpl, err := template.New(file).Option("missingkey=error").Parse(string(src))
		if err != nil {
			return nil, fmt.Errorf("parse migration %s: %w", file, err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("render migration %s: %w", file, err)
		}
		out = append(out, Migration{Version: version, Name: rest, SQL: buf.String()})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// templateData is what migration templates see. Every method returns a
// quoted identifier.
type templateData struct{ t Table }

func (d templateData) Table() string                  { return d.t.String() }
func (d templateData) Schema() string                 { return pgx.Identifier{d.t.Schema}.Sanitize() }
func (d templateData) Name(suffix string) string      { return d.t.derived(suffix, false) }
func (d templateData) Companion(suffix string) string { return d.t.derived(suffix, true) }

// Migrate applies the migrations that table t has not had yet, in one
// transaction under an advisory lock, so running it twice or from two
// processes at once is safe. It returns the migrations it applied.
func Migrate(ctx context.Context, conn *pgx.Conn, t Table) ([]Migration, error) {
	migs, err := Migrations(t)
	if err != nil {
		return nil, err
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrate %s: begin: %w", t.Qualified(), err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rollback after commit is a no-op

	// One lock per database: schema creation in two processes at once
	// would otherwise race on catalog rows and fail with unique violations.
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtextextended('outbox-relay migrate', 0))`); err != nil {
		return nil, fmt.Errorf("migrate %s: take advisory lock: %w", t.Qualified(), err)
	}
	ver := pgx.Identifier{t.Schema, "outbox_relay_migrations"}.Sanitize()
	stmts := []string{
		`CREATE SCHEMA IF NOT EXISTS ` + pgx.Identifier{t.Schema}.Sanitize(),
		`CREATE TABLE IF NOT EXISTS ` + ver + ` (
			target     text        NOT NULL,
			version    integer     NOT NULL,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
			PRIMARY KEY (target, version))`,
	}
	for _, s := range stmts {
		if _, err := tx.Exec(ctx, s); err != nil {
			return nil, fmt.Errorf("migrate %s: create version table: %w", t.Qualified(), err)
		}
	}
	applied := map[int]bool{}
	rows, err := tx.Query(ctx, `SELECT version FROM `+ver+` WHERE target = $1`, t.Qualified())
	if err != nil {
		return nil, fmt.Errorf("migrate %s: read applied versions: %w", t.Qualified(), err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("migrate %s: read applied versions: %w", t.Qualified(), err)
	}
	for _, v := range versions {
		applied[int(v)] = true
	}
	var done []Migration
	for _, m := range migs {
		if applied[m.Version] {
			continue
		}
		if _, err := tx.Exec(ctx, m.SQL); err != nil {
			return nil, fmt.Errorf("migrate %s: apply %04d_%s: %w", t.Qualified(), m.Version, m.Name, err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO `+ver+` (target, version, name) VALUES ($1, $2, $3)`,
			t.Qualified(), m.Version, m.Name); err != nil {
			return nil, fmt.Errorf("migrate %s: record %04d_%s: %w", t.Qualified(), m.Version, m.Name, err)
		}
		done = append(done, m)
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("migrate %s: commit: %w", t.Qualified(), err)
	}
	return done, nil
}
