package inbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// tableName is the inbox table; the fences and positions tables and the
// index take their names from it.
type tableName struct{ schema, name string }

func parseTable(s string) (tableName, error) {
	var t tableName
	t.name = s
	if i := strings.IndexByte(s, '.'); i >= 0 {
		t.schema, t.name = s[:i], s[i+1:]
		if t.schema == "" {
			return t, fmt.Errorf("table %q: empty schema name; use name or schema.name", s)
		}
	}
	if t.name == "" || strings.Contains(t.name, ".") || strings.ContainsRune(s, 0) {
		return t, fmt.Errorf("table %q: want name or schema.name", s)
	}
	if len(t.name) > 63 || len(t.schema) > 63 {
		return t, fmt.Errorf("table %q: names are limited to PostgreSQL's 63 bytes", s)
	}
	return t, nil
}

func (t tableName) ident(name string) string {
	if t.schema == "" {
		return pgx.Identifier{name}.Sanitize()
	}
	return pgx.Identifier{t.schema, name}.Sanitize()
}

// derived cuts to 63 bytes the same way every time, so Migrate finds again
// what it created.
func (t tableName) derived(suffix string) string {
	n := t.name + "_" + suffix
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

func (t tableName) inbox() string  { return t.ident(t.name) }
func (t tableName) fences() string { return t.ident(t.derived("fences")) }

// positions holds InSequence's and LatestWins's position per (consumer,
// aggregate).
func (t tableName) positions() string { return t.ident(t.derived("positions")) }

// positionsName is positions unquoted, for messages.
func (t tableName) positionsName() string {
	return tableName{schema: t.schema, name: t.derived("positions")}.String()
}
func (t tableName) String() string {
	if t.schema == "" {
		return t.name
	}
	return t.schema + "." + t.name
}

// Beginner is what Migrate runs on: *pgx.Conn, *pgxpool.Pool or a pgx.Tx.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Migrate creates the inbox table named table ("name" or "schema.name", in
// the search path's first schema when unqualified), its fences table
// <name>_fences and its positions table <name>_positions (Config.Order), if
// they do not exist, and adds to an inbox table created by an earlier
// version the columns that record aggregates, deadlines and dispositions. It
// is safe to run at every start and from several processes at once.
// `outbox-relay migrate --inbox <table>` runs the same.
func Migrate(ctx context.Context, db Beginner, table string) error {
	t, err := parseTable(table)
	if err != nil {
		return fmt.Errorf("inbox.Migrate: %w", err)
	}
	tx, err := db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("inbox.Migrate %s: begin: %w", t, err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // no-op after commit
	// CREATE ... IF NOT EXISTS from two sessions at once can still collide
	// on catalog rows; one lock per database serialises them.
	stmts := []string{`SELECT pg_advisory_xact_lock(hashtextextended('outbox-relay inbox migrate', 0))`}
	if t.schema != "" {
		stmts = append(stmts, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{t.schema}.Sanitize())
	}
	stmts = append(stmts,
		`CREATE TABLE IF NOT EXISTS `+t.inbox()+` (
			consumer       text        NOT NULL,
			message_id     text        NOT NULL,
			payload_sha256 bytea       NOT NULL CHECK (length(payload_sha256) = 32),
			subject        text        NOT NULL,
			stream_seq     bigint,
			received_at    timestamptz NOT NULL DEFAULT clock_timestamp(),
			PRIMARY KEY (consumer, message_id))`,
		// Serves Prune.
		`CREATE INDEX IF NOT EXISTS `+pgx.Identifier{t.derived("received_idx")}.Sanitize()+` ON `+t.inbox()+` (consumer, received_at)`,
		`CREATE TABLE IF NOT EXISTS `+t.fences()+` (
			resource   text        PRIMARY KEY,
			generation bigint      NOT NULL,
			updated_at timestamptz NOT NULL DEFAULT clock_timestamp())`,
		// One row per (consumer, aggregate), kept for as long as the
		// aggregate may still receive messages: without it an old sequence
		// would be applied again. applied_seq is the last sequence applied
		// (0: none); waiting_since and gap_reported_at track a gap until the
		// position moves; skipped_* record the last operator Skip.
		`CREATE TABLE IF NOT EXISTS `+t.positions()+` (
			consumer        text        NOT NULL,
			aggregate_type  text        NOT NULL,
			aggregate_id    text        NOT NULL,
			applied_seq     bigint      NOT NULL DEFAULT 0 CHECK (applied_seq >= 0),
			updated_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
			waiting_since   timestamptz,
			gap_reported_at timestamptz,
			skipped_after   bigint,
			skipped_through bigint,
			skip_reason     text,
			skipped_at      timestamptz,
			PRIMARY KEY (consumer, aggregate_type, aggregate_id))`,
	)
	for _, s := range stmts {
		if _, err := tx.Exec(ctx, s); err != nil {
			return fmt.Errorf("inbox.Migrate %s: %w", t, err)
		}
	}
	// ALTER TABLE takes an ACCESS EXCLUSIVE lock even when every column
	// exists, and queues every consumer's inserts behind any long
	// transaction on the inbox; Migrate runs at every start, so it alters
	// only a table that lacks the columns.
	var has bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_attribute
		WHERE attrelid = to_regclass($1) AND attname = 'disposition' AND NOT attisdropped)`, t.inbox()).Scan(&has); err != nil {
		return fmt.Errorf("inbox.Migrate %s: look for the disposition column: %w", t, err)
	}
	if !has {
		// A constant default makes this a catalog change, not a rewrite.
		if _, err := tx.Exec(ctx, `ALTER TABLE `+t.inbox()+`
			ADD COLUMN IF NOT EXISTS aggregate_type text,
			ADD COLUMN IF NOT EXISTS aggregate_id   text,
			ADD COLUMN IF NOT EXISTS aggregate_seq  bigint,
			ADD COLUMN IF NOT EXISTS expires_at     timestamptz,
			ADD COLUMN IF NOT EXISTS disposition    text NOT NULL DEFAULT 'applied'
				CHECK (disposition IN ('applied', 'superseded', 'expired'))`); err != nil {
			return fmt.Errorf("inbox.Migrate %s: add the aggregate, deadline and disposition columns: %w", t, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("inbox.Migrate %s: commit: %w", t, err)
	}
	return nil
}

// pruneBatch bounds each DELETE, so pruning a large backlog holds no long
// transaction and no lock on many rows at once.
const pruneBatch = 5000

// Prune deletes this consumer's inbox entries received more than olderThan
// ago (by the database's clock) and returns how many it deleted.
//
// An entry is what turns a repeat into a no-op: once it is gone, the same
// message is applied again. Keep entries at least as long as the message can
// still come back, which is far longer than the stream's duplicate window:
// a row the relay retries for hours, a failed row an operator redrives days
// later, a stream replayed from an old sequence. Days or weeks, not minutes.
func (in *Inbox) Prune(ctx context.Context, olderThan time.Duration) (int64, error) {
	if olderThan <= 0 {
		return 0, errors.New("inbox.Prune: olderThan must be positive (and longer than any redrive may come after)")
	}
	var total int64
	for {
		tag, err := in.pool.Exec(ctx, in.pruneSQL, in.cfg.Consumer, olderThan.Seconds(), pruneBatch)
		if err != nil {
			return total, fmt.Errorf("inbox.Prune %s: %w", in.t, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < pruneBatch {
			return total, nil
		}
	}
}
