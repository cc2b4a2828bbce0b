// Package schema makes and reads the outbox table's schema: the migrations
// (rendered from sql/migrations with every identifier quoted, applied under
// an advisory lock, CONCURRENTLY where the table is live), the layout a
// table has (partitioned, payload type), who owns it, and the grants of the
// roles (sql/roles.sql). The store and the migrate command use it; the
// statements on the rows are internal/store's.
package schema

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

// Writing a migration (sql/migrations/NNNN_name.sql). Producers insert into
// the outbox table all the time, and migrate runs beside them, on tables of
// any size (an install adopting a populated table runs every migration on
// it). So no migration may hold a lock that blocks an INSERT for longer
// than a catalog change takes:
//
//   - Every wait for a lock that conflicts with producers is bounded by
//     lock_timeout (--lock-timeout, DefaultLockTimeout). Such a request
//     (ALTER TABLE takes ACCESS EXCLUSIVE) is queued behind whoever holds
//     the table, and every INSERT queues behind it: after lock_timeout
//     migrate gives up with the holders' pids, and a retry resumes.
//   - A migration runs in its own transaction by default, recorded in it.
//     Such a migration may only change the catalog: new tables, ADD COLUMN
//     without a volatile default, ADD CONSTRAINT ... NOT VALID, functions,
//     triggers, storage parameters. Nothing that reads or rewrites the table
//     (a validated constraint, an index on an existing table, a type change)
//     may be in it, because it would run while holding the table's lock.
//   - A migration whose first line is exactly
//
//     -- outbox-relay: no-transaction
//
//     runs its statements one at a time, each committed on its own, and is
//     recorded only after the last one succeeded. A failure leaves the
//     statements before it done and the migration unrecorded, and the next
//     migrate runs the whole file again: every statement must be idempotent
//     (IF NOT EXISTS, CREATE OR REPLACE, DROP CONSTRAINT IF EXISTS and ADD
//     CONSTRAINT in one ALTER TABLE). This is where indexes and validations
//     go:
//   - An index on the outbox table or on a companion producers write
//     (<table>_aggregates): CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS
//     <name> ON ..., in a no-transaction migration. The build takes SHARE
//     UPDATE EXCLUSIVE, which INSERTs do not conflict with, and runs without
//     lock_timeout: its waits for older transactions block no one. An
//     INVALID index of that name (a build that failed or was cancelled) is
//     dropped and built again before the statement runs.
//   - A CHECK on the outbox table: ADD CONSTRAINT ... NOT VALID (in either
//     kind of migration), then, if rows already there must be checked,
//     ALTER TABLE <table> VALIDATE CONSTRAINT <name> as a statement of its
//     own in a no-transaction migration (SHARE UPDATE EXCLUSIVE, no
//     lock_timeout). If rows violate it, migrate fails naming some of them
//     and the constraint stays NOT VALID; beware that a NOT VALID CHECK still
//     applies to every UPDATE of an old row (the relay's settle, a claim, a
//     cancel), which is why 0008 refuses bad times with an INSERT trigger
//     instead.
//
//   - A table partitioned by created_at (migrate --partition-interval)
//     renders the same files with .Partitioned set. There an index build on
//     the outbox table loses CONCURRENTLY (PostgreSQL cannot build one on a
//     partitioned table) and runs only while the table holds no rows, that
//     is when migrate creates it; storage parameters go on each partition
//     (0014 creates them), and a unique index must hold created_at.
//
// TestMigrationsDoNotBlockProducers holds the embedded migrations to these
// rules; converting a migration written as `CREATE INDEX IF NOT EXISTS x ON
// {{.Table}} (...)` means putting the marker on its first line, writing
// CONCURRENTLY after INDEX, and making its other statements idempotent (or
// moving them to a migration of their own).

// DefaultLockTimeout bounds each wait of migrate for a lock, and so how long
// a producer's INSERT can queue behind one.
const DefaultLockTimeout = 3 * time.Second

// noTransactionMarker on a migration's first line runs its statements one by
// one outside a transaction (CREATE INDEX CONCURRENTLY cannot run in one).
const noTransactionMarker = "-- outbox-relay: no-transaction"

// Migration is one numbered schema change from sql/migrations.
type Migration struct {
	Version int
	Name    string
	SQL     string
	// NoTransaction: the file starts with noTransactionMarker; Statements
	// are run one by one.
	NoTransaction bool
	Statements    []string
}

// Migrations renders the embedded migrations for table t, a plain table.
func Migrations(t Table) ([]Migration, error) {
	return MigrationsFor(t, Layout{})
}

// Layout is how the outbox table is laid out: plain (the zero value) or
// partitioned by created_at in ranges of PartitionInterval (DESIGN.md,
// Partitioned table).
type Layout struct {
	PartitionInterval time.Duration
	// PayloadType is the payload column's type: jsonb (also for ""), json
	// or bytea (migrate --payload-type).
	PayloadType string
}

// PayloadTypes are the payload column's types: jsonb (PostgreSQL's
// normalised text), json (the producer's text, byte for byte) and bytea
// (any bytes: Protobuf, Avro, ...). jsonb is the default.
var PayloadTypes = []string{"jsonb", "json", "bytea"}

// ValidatePayloadType checks --payload-type.
func ValidatePayloadType(s string) error {
	if slices.Contains(PayloadTypes, s) {
		return nil
	}
	return fmt.Errorf("--payload-type %q: want jsonb (the default: PostgreSQL normalises the JSON), json (the producer's JSON text, byte for byte) or bytea (any bytes, e.g. Protobuf)", s)
}

// payloadType is the column type to create.
func (l Layout) payloadType() string {
	if l.PayloadType == "" {
		return "jsonb"
	}
	return l.PayloadType
}

// Partitioned reports whether the table is partitioned.
func (l Layout) Partitioned() bool { return l.PartitionInterval > 0 }

// MinPartitionInterval is the shortest --partition-interval. Short
// intervals suit high volume with retention of hours; each partition is one
// more index probe for every statement that finds a row by work_id
// (docs/partitions.md, Partition sizing), which PartitionsAhead bounds.
const MinPartitionInterval = 5 * time.Minute

// MaxPartitionInterval is the longest --partition-interval: a year. Far
// longer intervals overflowed the duration (100000d) or made partitions
// prune could never drop.
const MaxPartitionInterval = 366 * 24 * time.Hour

// PartitionsAhead is how many intervals past the current one are kept
// created for interval d: enough to cover a day and one interval more, so a
// relay (and migrate) stopped for a day still leaves producers a partition
// for their rows, and at least two. Below an hour a day would be hundreds
// of partitions, each a probe per lookup by work_id, so the cover is 24
// intervals and one more (two hours at 5m): a longer stop sends rows to the
// DEFAULT partition, which status and the metric report.
func PartitionsAhead(d time.Duration) int {
	n := min(int((24*time.Hour+d-1)/d), 24) + 1
	return max(n, 2)
}

// ParsePartitionInterval reads --partition-interval: a Go duration of at
// least MinPartitionInterval in whole minutes, or Nd for N days.
func ParsePartitionInterval(s string) (time.Duration, error) {
	var d time.Duration
	if days, ok := strings.CutSuffix(s, "d"); ok {
		n, err := strconv.Atoi(days)
		if err == nil && n > int(MaxPartitionInterval/(24*time.Hour)) {
			return 0, fmt.Errorf("--partition-interval %s: at most %dd (prune drops whole partitions: a longer one would keep rows for years)", s, int(MaxPartitionInterval/(24*time.Hour)))
		}
		if err != nil || n <= 0 {
			return 0, fmt.Errorf("--partition-interval %q: want 1h, 1d, Nd or a Go duration of at least 5m", s)
		}
		d = time.Duration(n) * 24 * time.Hour
	} else {
		var err error
		if d, err = time.ParseDuration(s); err != nil {
			return 0, fmt.Errorf("--partition-interval %q: want 1h, 1d, Nd or a Go duration of at least 5m: %w", s, err)
		}
	}
	if d < MinPartitionInterval {
		return 0, fmt.Errorf("--partition-interval %s: at least %s (every partition costs each lookup by work_id an index probe)", s, MinPartitionInterval)
	}
	if d%time.Minute != 0 {
		return 0, fmt.Errorf("--partition-interval %s: want whole minutes", s)
	}
	if d > MaxPartitionInterval {
		return 0, fmt.Errorf("--partition-interval %s: at most %dd (prune drops whole partitions: a longer one would keep rows for years)", s, int(MaxPartitionInterval/(24*time.Hour)))
	}
	return d, nil
}

// MigrationsFor renders the embedded migrations for table t laid out as l.
func MigrationsFor(t Table, l Layout) ([]Migration, error) {
	entries, err := fs.ReadDir(outboxsql.Migrations, "migrations")
	if err != nil {
		return nil, fmt.Errorf("read embedded migrations: %w", err)
	}
	data := templateData{t: t, layout: l}
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
		m, err := newMigration(version, rest, buf.String(), t, l)
		if err != nil {
			return nil, fmt.Errorf("migration %s: %w", file, err)
		}
		out = append(out, m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	return out, nil
}

// newMigration reads a rendered migration's kind and, for a no-transaction
// one, its statements, refusing an index build that a retry could not
// repeat or that would block producers.
//
// On a partitioned table an index build on the table itself is run as a
// plain CREATE INDEX IF NOT EXISTS on the partitioned table: PostgreSQL
// cannot build one CONCURRENTLY there, and it builds one per partition.
// That is what a new table's migrations do, on no rows; the migrator
// refuses it on a table that holds rows (see statement).
func newMigration(version int, name, sql string, t Table, l Layout) (Migration, error) {
	m := Migration{Version: version, Name: name, SQL: sql}
	first, _, _ := strings.Cut(sql, "\n")
	if strings.TrimSpace(first) != noTransactionMarker {
		return m, nil
	}
	m.NoTransaction = true
	stmts, err := splitStatements(sql)
	if err != nil {
		return Migration{}, err
	}
	for i, s := range stmts {
		head := stripLeadingComments(s)
		if createIndex.MatchString(head) && !indexBuild.MatchString(head) {
			return Migration{}, fmt.Errorf("in a no-transaction migration an index is built with CREATE [UNIQUE] INDEX CONCURRENTLY IF NOT EXISTS <name> ON <table>, so that a retry repeats it and producers keep inserting: %.80q", head)
		}
		if sub := indexBuild.FindStringSubmatch(head); l.Partitioned() && sub != nil && sub[2] == t.String() {
			stmts[i] = concurrently.ReplaceAllString(head, "$1")
		}
	}
	m.Statements = stmts
	return m, nil
}

// concurrently is the word a build on a partitioned table drops (1: what
// comes before it).
var concurrently = regexp.MustCompile(`(?is)^(CREATE\s+(?:UNIQUE\s+)?INDEX\s+)CONCURRENTLY\s+`)

// templateData is what migration templates see. Every string method
// returns a quoted identifier, or a quoted literal (the ...Lit ones) for
// plpgsql that builds statements with format(); Partitioned, IntervalSeconds
// and Ahead render a partitioned table (migrate --partition-interval).
type templateData struct {
	t      Table
	layout Layout
}

func (d templateData) Table() string                     { return d.t.String() }
func (d templateData) SchemaLit() string                 { return Literal(d.t.Schema) }
func (d templateData) NameLit() string                   { return Literal(d.t.Name) }
func (d templateData) CompanionLit(suffix string) string { return Literal(d.t.Derived(suffix, true)) }
func (d templateData) QualifiedLit() string              { return Literal(d.t.Qualified()) }
func (d templateData) Partitioned() bool                 { return d.layout.Partitioned() }
func (d templateData) IntervalSeconds() int64            { return int64(d.layout.PartitionInterval / time.Second) }
func (d templateData) PayloadType() string               { return d.layout.payloadType() }
func (d templateData) Ahead() int                        { return PartitionsAhead(d.layout.PartitionInterval) }
func (d templateData) Schema() string                    { return pgx.Identifier{d.t.Schema}.Sanitize() }
func (d templateData) Name(suffix string) string         { return d.t.Derived(suffix, false) }
func (d templateData) Companion(suffix string) string    { return d.t.Derived(suffix, true) }

// MigrateOptions tunes MigrateWith; the zero value is Migrate's.
type MigrateOptions struct {
	// LockTimeout bounds each wait for a lock that blocks producers while
	// it is queued (0: DefaultLockTimeout).
	LockTimeout time.Duration
	// Progress, when set, is told about each step that can take long: an
	// index build, a validation, waiting for another migrate.
	Progress func(msg string)
	// PartitionInterval, for a table that does not exist yet, creates it
	// partitioned by created_at in ranges of this interval (at least
	// MinPartitionInterval, whole minutes). On a partitioned table it must
	// be the recorded interval or 0; on a plain table it is refused.
	PartitionInterval time.Duration
	// PayloadType, for a table that does not exist yet, is its payload
	// column's type (PayloadTypes; "": jsonb). On an existing table it must
	// be the column's type or "": migrate does not convert a table.
	PayloadType string
	// Pooled says the connection goes through a pooler in transaction mode
	// (app.DB.Pooler), where session state does not follow the client
	// from one transaction to the next: a session lock would be left on a
	// server connection that then serves someone else (and its unlock sent
	// to another), and a session setting would change that someone's
	// lock_timeout. Each migration then takes the lock as a transaction
	// lock, inside its own transaction, and sets lock_timeout there
	// (SET LOCAL), and a statement run on its own takes no setting but
	// the server's; see MigrateWith for what that leaves.
	Pooled bool
}

// ErrConvertPlain refuses --partition-interval on a table that exists as a
// plain table.
var ErrConvertPlain = errors.New("the table exists and is not partitioned: migrate --partition-interval only creates a new table partitioned; convert an existing one with the procedure in docs/partitions.md, \"Converting a plain table to a partitioned one\" (a new partitioned table beside it, producers switched to it, the old one drained by a relay and dropped)")

// Migrate is MigrateWith with the default options.
func Migrate(ctx context.Context, conn *pgx.Conn, t Table) ([]Migration, error) {
	return MigrateWith(ctx, conn, t, MigrateOptions{})
}

// MigrateWith applies the migrations that table t has not had yet, each in
// its own transaction (or statement by statement, for a no-transaction
// one), under a session advisory lock, so running it twice or from two
// processes at once is safe, and a run that failed resumes at the
// migration it failed in. It returns the migrations it applied, also when
// it fails after some. Every wait for a lock that blocks producers is
// bounded by opts.LockTimeout (see the rules at the top of this file).
func MigrateWith(ctx context.Context, conn *pgx.Conn, t Table, opts MigrateOptions) ([]Migration, error) {
	if opts.PayloadType != "" {
		if err := ValidatePayloadType(opts.PayloadType); err != nil {
			return nil, fmt.Errorf("migrate %s: %w", t.Qualified(), err)
		}
	}
	if opts.PartitionInterval != 0 && (opts.PartitionInterval < MinPartitionInterval || opts.PartitionInterval%time.Minute != 0) {
		return nil, fmt.Errorf("migrate %s: partition interval %s: want at least %s in whole minutes", t.Qualified(), opts.PartitionInterval, MinPartitionInterval)
	}
	// The layout is read under the lock, so that two migrates of a new
	// table, one with --partition-interval and one without, cannot render
	// the migrations for different layouts. The lock is reentrant:
	// applyMigrations takes it again.
	r := &migrator{conn: conn, t: t, opts: opts}
	if r.opts.LockTimeout <= 0 {
		r.opts.LockTimeout = DefaultLockTimeout
	}
	if r.opts.Progress == nil {
		r.opts.Progress = func(string) {}
	}
	if err := r.lock(ctx); err != nil {
		return nil, err
	}
	defer r.unlock()
	// Before anything reads the table's companions: they may be the
	// owner's, and so may be the code they run (migrate_owner.go).
	if _, err := r.checkOwnership(ctx); err != nil {
		return nil, err
	}
	layout, err := ReadLayout(ctx, conn, t)
	if err != nil {
		return nil, fmt.Errorf("migrate %s: %w", t.Qualified(), err)
	}
	switch {
	case layout.Exists && !layout.Partitioned() && opts.PartitionInterval > 0:
		return nil, fmt.Errorf("migrate %s --partition-interval %s: %w", t.Qualified(), opts.PartitionInterval, ErrConvertPlain)
	case layout.Exists && layout.Partitioned() && opts.PartitionInterval > 0 && layout.PartitionInterval != opts.PartitionInterval:
		return nil, fmt.Errorf("migrate %s --partition-interval %s: the table is partitioned by %s already; the interval of an existing table does not change (a new table with the procedure in docs/partitions.md, \"Converting a plain table to a partitioned one\")", t.Qualified(), opts.PartitionInterval, layout.PartitionInterval)
	case layout.Exists && opts.PayloadType != "" && opts.PayloadType != layout.payloadType():
		return nil, fmt.Errorf("migrate %s --payload-type %s: the table's payload column is %s already; migrate does not convert an existing table (docs/upgrading.md, \"Changing the payload type\")", t.Qualified(), opts.PayloadType, layout.payloadType())
	case !layout.Exists:
		layout.Layout = Layout{PartitionInterval: opts.PartitionInterval, PayloadType: opts.PayloadType}
	}
	migs, err := MigrationsFor(t, layout.Layout)
	if err != nil {
		return nil, err
	}
	done, err := applyMigrations(ctx, conn, t, opts, migs)
	if err != nil {
		return done, err
	}
	own, err := ReadOwnership(ctx, conn, t)
	if err != nil {
		return done, fmt.Errorf("migrate %s: %w", t.Qualified(), err)
	}
	if own.Exists && own.Owner == own.User {
		if err := r.warnForeignOwned(ctx, own.Owner); err != nil {
			return done, fmt.Errorf("migrate %s: %w", t.Qualified(), err)
		}
	}
	return done, nil
}

// FoundLayout is ReadLayout's answer with whether the table exists.
type FoundLayout struct {
	Layout
	Exists bool
}

// ReadLayout reads how table t is laid out: partitioned when pg_class says
// so, with the interval recorded in <table>_partitioning (migration 0014).
// A partitioned table whose record is missing (0014 not applied yet) reads
// as partitioned by MinPartitionInterval until migrate records it; no
// statement but 0014's own uses the interval before then.
func ReadLayout(ctx context.Context, q DBTX, t Table) (FoundLayout, error) {
	var kind string
	err := q.QueryRow(ctx, `SELECT c.relkind::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p')`, t.Schema, t.Name).Scan(&kind)
	if errors.Is(err, pgx.ErrNoRows) {
		return FoundLayout{}, nil
	}
	if err != nil {
		return FoundLayout{}, fmt.Errorf("read the layout of %s: %w", t.Qualified(), err)
	}
	var ptype string
	err = q.QueryRow(ctx, `SELECT coalesce((SELECT format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a
		WHERE a.attrelid = (quote_ident($1) || '.' || quote_ident($2))::regclass AND a.attname = 'payload' AND NOT a.attisdropped), '')`,
		t.Schema, t.Name).Scan(&ptype)
	if err != nil {
		return FoundLayout{}, fmt.Errorf("read the payload type of %s: %w", t.Qualified(), err)
	}
	if kind != "p" {
		return FoundLayout{Exists: true, Layout: Layout{PayloadType: ptype}}, nil
	}
	var secs *int64
	err = q.QueryRow(ctx, `SELECT (SELECT interval_seconds FROM `+t.Derived("partitioning", true)+`)`).Scan(&secs)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42P01" {
		err = nil
	}
	if err != nil {
		return FoundLayout{}, fmt.Errorf("read the partition interval of %s: %w", t.Qualified(), err)
	}
	l := FoundLayout{Exists: true, Layout: Layout{PartitionInterval: time.Hour, PayloadType: ptype}}
	if secs != nil {
		l.PartitionInterval = time.Duration(*secs) * time.Second
	}
	return l, nil
}

// migrateLockKey is one lock per database: schema creation in two processes
// at once would otherwise race on catalog rows and fail with unique
// violations. Earlier versions took it as a transaction lock; the two kinds
// share one key space, so old and new migrates still exclude each other.
const migrateLockKey = `hashtextextended('outbox-relay migrate', 0)`

func applyMigrations(ctx context.Context, conn *pgx.Conn, t Table, opts MigrateOptions, migs []Migration) ([]Migration, error) {
	r := &migrator{conn: conn, t: t, opts: opts}
	if r.opts.LockTimeout <= 0 {
		r.opts.LockTimeout = DefaultLockTimeout
	}
	if r.opts.Progress == nil {
		r.opts.Progress = func(string) {}
	}
	if err := r.lock(ctx); err != nil {
		return nil, err
	}
	defer r.unlock()
	var prevTimeout string
	if err := conn.QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&prevTimeout); err != nil {
		return nil, fmt.Errorf("migrate %s: read lock_timeout: %w", t.Qualified(), err)
	}
	if err := r.setLockTimeout(ctx, r.timeoutSetting()); err != nil {
		return nil, err
	}
	defer func() { _ = r.setLockTimeout(context.Background(), prevTimeout) }()

	ver, err := r.versionTable(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := conn.Query(ctx, `SELECT version FROM `+ver+` WHERE target = $1`, t.Qualified())
	if err != nil {
		return nil, fmt.Errorf("migrate %s: read applied versions: %w", t.Qualified(), err)
	}
	versions, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("migrate %s: read applied versions: %w", t.Qualified(), err)
	}
	applied := map[int]bool{}
	for _, v := range versions {
		applied[int(v)] = true
	}
	record := `INSERT INTO ` + ver + ` (target, version, name) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING`
	var done []Migration
	for _, m := range migs {
		if applied[m.Version] {
			continue
		}
		what := fmt.Sprintf("apply %04d_%s", m.Version, m.Name)
		if m.NoTransaction {
			for i, s := range m.Statements {
				if err := r.statement(ctx, s); err != nil {
					return done, r.explain(ctx, fmt.Sprintf("%s (statement %d of %d, run on its own; those before it are done and are run again, harmlessly, by the next migrate)", what, i+1, len(m.Statements)), err)
				}
			}
			if _, err := conn.Exec(ctx, record, t.Qualified(), m.Version, m.Name); err != nil {
				return done, fmt.Errorf("migrate %s: record %04d_%s: %w", t.Qualified(), m.Version, m.Name, err)
			}
		} else if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if r.opts.Pooled {
				again, err := r.lockTx(ctx, tx, ver, m.Version)
				if err != nil || again {
					return err
				}
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, record, t.Qualified(), m.Version, m.Name)
			return err
		}); errors.Is(err, errAppliedMeanwhile) {
			continue
		} else if err != nil {
			// Explained after the rollback: the aborted transaction could
			// not look up who holds the lock.
			return done, r.explain(ctx, what+" (rolled back: nothing of it is applied)", err)
		}
		done = append(done, m)
	}
	return done, nil
}

type migrator struct {
	conn *pgx.Conn
	t    Table
	opts MigrateOptions
}

// lock takes the session advisory lock by polling rather than waiting in
// pg_advisory_lock: a statement waiting there holds a snapshot, and the
// other migrate's CREATE INDEX CONCURRENTLY would wait for that snapshot
// while this one waits for its lock (with pg_advisory_lock,
// TestMigrateConcurrentAndQuoted fails on "deadlock detected").
func (r *migrator) lock(ctx context.Context) error {
	if r.opts.Pooled {
		return nil
	}
	told := false
	for {
		var ok bool
		if err := r.conn.QueryRow(ctx, `SELECT pg_try_advisory_lock(`+migrateLockKey+`)`).Scan(&ok); err != nil {
			return fmt.Errorf("migrate %s: take advisory lock: %w", r.t.Qualified(), err)
		}
		if ok {
			return nil
		}
		if !told {
			r.opts.Progress("waiting for another migrate of this database to finish")
			told = true
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migrate %s: wait for another migrate of this database: %w", r.t.Qualified(), ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// unlock releases the advisory lock; a connection that broke has already
// released it with its session.
func (r *migrator) unlock() {
	if r.opts.Pooled {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = r.conn.Exec(ctx, `SELECT pg_advisory_unlock(`+migrateLockKey+`)`)
}

func (r *migrator) timeoutSetting() string {
	ms := r.opts.LockTimeout.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return strconv.FormatInt(ms, 10) + "ms"
}

func (r *migrator) setLockTimeout(ctx context.Context, v string) error {
	if r.opts.Pooled {
		return nil
	}
	if _, err := r.conn.Exec(ctx, `SELECT set_config('lock_timeout', $1, false)`, v); err != nil {
		return fmt.Errorf("migrate %s: set lock_timeout %s: %w", r.t.Qualified(), v, err)
	}
	return nil
}

var (
	identRE = `(?:"(?:[^"]|"")+"|[A-Za-z_][A-Za-z0-9_$]*)`
	// createIndex is any index build; indexBuild the one form a
	// no-transaction migration may use (1: index name, 2: table).
	createIndex = regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\b`)
	indexBuild  = regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+IF\s+NOT\s+EXISTS\s+(` + identRE + `)\s+ON\s+(?:ONLY\s+)?(` + identRE + `(?:\.` + identRE + `)?)`)
	// validate is a VALIDATE CONSTRAINT alone in its statement (1: table,
	// 2: constraint): with another subcommand beside it, ALTER TABLE would
	// take that one's lock for the whole scan.
	validate = regexp.MustCompile(`(?is)^ALTER\s+TABLE\s+(?:ONLY\s+)?(` + identRE + `(?:\.` + identRE + `)?)\s+VALIDATE\s+CONSTRAINT\s+(` + identRE + `)\s*$`)
	// indexOnTable is the table of a plain index build (1: table).
	indexOnTable = regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\s+IF\s+NOT\s+EXISTS\s+` + identRE + `\s+ON\s+(?:ONLY\s+)?(` + identRE + `(?:\.` + identRE + `)?)`)
	// dropIndexConcurrently takes what an index build takes.
	dropIndexConcurrently = regexp.MustCompile(`(?is)^DROP\s+INDEX\s+CONCURRENTLY\b`)
)

// pooledAttempts bounds how often a pooled migrate runs a statement of a
// no-transaction migration again after a deadlock with another migrate.
const pooledAttempts = 10

// statement runs one statement of a no-transaction migration.
//
// Pooled, no lock keeps another migrate's statements away from this one's,
// and two that take SHARE UPDATE EXCLUSIVE on one table (an index build
// waiting for older snapshots, the other waiting for the lock with its
// snapshot taken) can deadlock: PostgreSQL cancels one, which is run again.
// An index is checked valid after its build: CREATE INDEX CONCURRENTLY IF
// NOT EXISTS also returns at once when another migrate's build of it is
// still going, and that build may yet fail.
func (r *migrator) statement(ctx context.Context, s string) error {
	if !r.opts.Pooled {
		return r.statementOnce(ctx, s)
	}
	head := stripLeadingComments(s)
	for attempt := 1; ; attempt++ {
		err := r.statementOnce(ctx, s)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "40P01" && attempt < pooledAttempts {
			r.opts.Progress("deadlock with another migrate (no session lock behind a transaction pooler): running the statement again")
			time.Sleep(time.Duration(attempt) * 100 * time.Millisecond)
			continue
		}
		if err != nil || !indexBuild.MatchString(head) {
			return err
		}
		sub := indexBuild.FindStringSubmatch(head)
		valid, err := r.indexValid(ctx, sub[2], unquoteIdent(sub[1]))
		if err != nil || valid {
			return err
		}
		if attempt == pooledAttempts {
			return fmt.Errorf("index %s is still not valid after %d builds: run migrate again", unquoteIdent(sub[1]), attempt)
		}
	}
}

// indexValid reports whether the index is there and valid.
func (r *migrator) indexValid(ctx context.Context, table, name string) (bool, error) {
	var valid bool
	err := r.conn.QueryRow(ctx, `SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE i.indrelid = to_regclass($1) AND c.relname = $2`, table, name).Scan(&valid)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("look at index %s: %w", name, err)
	}
	return valid, nil
}

func (r *migrator) statementOnce(ctx context.Context, s string) error {
	head := stripLeadingComments(s)
	switch {
	case createIndex.MatchString(head) && !indexBuild.MatchString(head):
		// A build on a partitioned table (newMigration): refused on a
		// populated one, where it would hold producers for the whole build.
		sub := indexOnTable.FindStringSubmatch(head)
		if sub == nil {
			break
		}
		var populated bool
		if err := r.conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+sub[1]+`)`).Scan(&populated); err != nil {
			return fmt.Errorf("look for rows in %s before building an index on it: %w", sub[1], err)
		}
		if populated {
			return fmt.Errorf("%s is partitioned and holds rows: an index cannot be built on it without blocking producers for the whole build; build it by hand (CREATE INDEX ... ON ONLY the table, CREATE INDEX CONCURRENTLY on each partition, ALTER INDEX ... ATTACH PARTITION) and run migrate again: %.80q", sub[1], head)
		}
	case indexBuild.MatchString(head):
		sub := indexBuild.FindStringSubmatch(head)
		name, table := unquoteIdent(sub[1]), sub[2]
		if err := r.dropInvalidIndex(ctx, table, name); err != nil {
			return err
		}
		r.opts.Progress(fmt.Sprintf("building index %s on %s concurrently (it waits for older transactions to end; producers keep inserting)", name, table))
		return r.withoutLockTimeout(ctx, s)
	case validate.MatchString(head):
		sub := validate.FindStringSubmatch(head)
		table, name := sub[1], unquoteIdent(sub[2])
		r.opts.Progress(fmt.Sprintf("validating constraint %s on %s (reads the whole table; producers keep inserting)", name, table))
		err := r.withoutLockTimeout(ctx, s)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23514" {
			return r.violations(ctx, table, name, err)
		}
		return err
	case dropIndexConcurrently.MatchString(head):
		return r.withoutLockTimeout(ctx, s)
	}
	if r.opts.Pooled {
		// Its own transaction, so the lock and the bound hold for it and
		// leave with it (it is none of the CONCURRENTLY kind, which cannot
		// run in one).
		return r.exclusive(ctx, func(q DBTX) error {
			if _, err := q.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, r.timeoutSetting()); err != nil {
				return fmt.Errorf("set lock_timeout: %w", err)
			}
			_, err := q.Exec(ctx, s)
			return err
		})
	}
	_, err := r.conn.Exec(ctx, s)
	return err
}

// exclusive runs fn under the migrate lock: the session's, which this
// migrate holds already, or, pooled, a transaction lock for fn's own
// transaction (two migrates creating the same catalog objects at once fail
// on a unique violation in the catalog).
func (r *migrator) exclusive(ctx context.Context, fn func(q DBTX) error) error {
	if !r.opts.Pooled {
		return fn(r.conn)
	}
	return pgx.BeginFunc(ctx, r.conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(`+migrateLockKey+`)`); err != nil {
			return fmt.Errorf("take advisory lock: %w", err)
		}
		return fn(tx)
	})
}

// errAppliedMeanwhile ends the transaction of a migration that another
// migrate applied while this one read the versions (pooled only: there the
// lock is taken per migration).
var errAppliedMeanwhile = errors.New("applied by another migrate meanwhile")

// lockTx takes, inside a migration's own transaction, what a migrate on
// its own session takes once for the whole run (pooled only): the lock,
// as a transaction lock, and the lock_timeout, as a local setting. It
// reports errAppliedMeanwhile when another migrate applied the migration
// while this one waited for the lock.
func (r *migrator) lockTx(ctx context.Context, tx pgx.Tx, ver string, version int) (bool, error) {
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(`+migrateLockKey+`)`); err != nil {
		return false, fmt.Errorf("take advisory lock: %w", err)
	}
	if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, r.timeoutSetting()); err != nil {
		return false, fmt.Errorf("set lock_timeout: %w", err)
	}
	var done bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+ver+` WHERE target = $1 AND version = $2)`, r.t.Qualified(), version).Scan(&done); err != nil {
		return false, fmt.Errorf("read applied versions: %w", err)
	}
	if done {
		return true, errAppliedMeanwhile
	}
	return false, nil
}

// withoutLockTimeout runs a statement that takes only SHARE UPDATE
// EXCLUSIVE, which no INSERT, UPDATE or DELETE conflicts with, so that
// waiting for it blocks no producer; its waits for older transactions
// (CREATE INDEX CONCURRENTLY waits for every older snapshot in the
// database) would otherwise fail it behind any long report query.
func (r *migrator) withoutLockTimeout(ctx context.Context, s string) error {
	if err := r.setLockTimeout(ctx, "0"); err != nil {
		return err
	}
	_, err := r.conn.Exec(ctx, s)
	if rerr := r.setLockTimeout(context.Background(), r.timeoutSetting()); err == nil {
		err = rerr
	}
	return err
}

// dropInvalidIndex drops the INVALID index a failed or cancelled CREATE
// INDEX CONCURRENTLY left: IF NOT EXISTS would see it and build nothing.
// The advisory lock means no other migrate is building it now.
//
// Pooled, no lock keeps another migrate away: an index it is building now
// is invalid too until its build ends, so a build in progress is waited
// for, and looked at again, rather than dropped.
func (r *migrator) dropInvalidIndex(ctx context.Context, table, name string) error {
	var schema string
	var valid, building bool
	for {
		err := r.conn.QueryRow(ctx, `SELECT n.nspname, i.indisvalid,
				EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.index_relid = i.indexrelid)
			FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE i.indrelid = to_regclass($1) AND c.relname = $2`, table, name).Scan(&schema, &valid, &building)
		if errors.Is(err, pgx.ErrNoRows) || (err == nil && valid) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("look for an invalid index %s: %w", name, err)
		}
		if !r.opts.Pooled || !building {
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for another migrate's build of index %s: %w", name, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
	r.opts.Progress(fmt.Sprintf("dropping the invalid index %s that an interrupted build left, to build it again", name))
	if err := r.withoutLockTimeout(ctx, `DROP INDEX CONCURRENTLY IF EXISTS `+pgx.Identifier{schema, name}.Sanitize()); err != nil {
		return fmt.Errorf("drop invalid index %s: %w", name, err)
	}
	return nil
}

// violations names some of the rows that failed a VALIDATE CONSTRAINT.
func (r *migrator) violations(ctx context.Context, table, name string, cause error) error {
	var expr string
	if err := r.conn.QueryRow(ctx, `SELECT pg_get_expr(conbin, conrelid) FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2`,
		table, name).Scan(&expr); err != nil {
		return cause
	}
	find := fmt.Sprintf("SELECT * FROM %s WHERE (%s) IS FALSE", table, expr)
	rowsNote := ""
	if table == r.t.String() {
		find = fmt.Sprintf("SELECT work_id FROM %s WHERE (%s) IS FALSE", table, expr)
		if rows, err := r.conn.Query(ctx, find+" LIMIT 5"); err == nil {
			if ids, err := pgx.CollectRows(rows, pgx.RowTo[string]); err == nil && len(ids) > 0 {
				rowsNote = fmt.Sprintf(" (work_id %q, ...)", ids)
			}
		}
	}
	return fmt.Errorf("validate constraint %s: rows already in %s violate it%s. It stays NOT VALID: new rows are checked, and so is every update, so a settle, claim or cancel of one of these rows fails until it is fixed. Correct or delete them (%s), then run migrate again; it resumes at this migration: %w",
		name, table, rowsNote, find, cause)
}

// explain wraps a failed step; a lock timeout says what was waited for, who
// holds the table, and that a retry is safe.
func (r *migrator) explain(ctx context.Context, what string, err error) error {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "55P03" {
		return fmt.Errorf("migrate %s: %s: %w", r.t.Qualified(), what, err)
	}
	return fmt.Errorf("migrate %s: %s: gave up after waiting lock_timeout %s (--lock-timeout) for a lock%s: while migrate waits for the table's lock every producer's INSERT queues behind it. Let that transaction end (or end it: pg_terminate_backend(pid)) and run migrate again; it resumes here, migrations before this one stay applied: %w",
		r.t.Qualified(), what, r.opts.LockTimeout, r.lockHolders(ctx), err)
}

// lockHolders lists the sessions whose transactions began more than
// lock_timeout ago and hold a lock on the table or its companions: the ones
// migrate most likely waited for.
func (r *migrator) lockHolders(ctx context.Context) string {
	rows, err := r.conn.Query(ctx, `SELECT l.pid, l.mode, l.relation::regclass::text, coalesce(a.state, ''),
			coalesce(to_char(a.xact_start AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'), ''), coalesce(a.usename::text, '')
		FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE l.granted AND l.locktype = 'relation' AND l.pid <> pg_backend_pid()
		  AND a.xact_start < clock_timestamp() - $3::interval
		  AND l.relation IN (SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		                     WHERE n.nspname = $1 AND c.relkind IN ('r', 'p')
		                       AND (c.relname = $2 OR left(c.relname, length($2) + 1) = $2 || '_'))
		ORDER BY a.xact_start LIMIT 5`, r.t.Schema, r.t.Name, r.timeoutSetting())
	if err != nil {
		return ""
	}
	type holder struct {
		pid                          int32
		mode, rel, state, since, who string
	}
	hs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (holder, error) {
		var h holder
		err := row.Scan(&h.pid, &h.mode, &h.rel, &h.state, &h.since, &h.who)
		return h, err
	})
	if err != nil || len(hs) == 0 {
		return " (held by a transaction that has since ended, or by one that began less than lock_timeout ago; pg_locks shows current holders)"
	}
	parts := make([]string, len(hs))
	for i, h := range hs {
		parts[i] = fmt.Sprintf("pid %d holds %s on %s (role %s, %s, transaction started %s)", h.pid, h.mode, h.rel, h.who, h.state, h.since)
	}
	return ": " + strings.Join(parts, "; ")
}

// splitStatements cuts a migration into its statements at the semicolons
// outside quotes, dollar quotes and comments.
func splitStatements(sql string) ([]string, error) {
	var out []string
	start := 0
	flush := func(end int) {
		s := strings.TrimSpace(sql[start:end])
		if stripLeadingComments(s) != "" {
			out = append(out, s)
		}
		start = end + 1
	}
	identChar := func(c byte) bool {
		return c == '_' || c == '$' || c >= '0' && c <= '9' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= 0x80
	}
	for i := 0; i < len(sql); {
		c := sql[i]
		switch {
		case c == ';':
			flush(i)
			i++
		case c == '-' && strings.HasPrefix(sql[i:], "--"):
			j := strings.IndexByte(sql[i:], '\n')
			if j < 0 {
				i = len(sql)
			} else {
				i += j + 1
			}
		case c == '/' && strings.HasPrefix(sql[i:], "/*"):
			end := blockCommentEnd(sql[i:])
			if end < 0 {
				return nil, fmt.Errorf("unterminated comment at byte %d", i)
			}
			i += end
		case c == '\'':
			escapes := i > 0 && (sql[i-1] == 'E' || sql[i-1] == 'e') && (i < 2 || !identChar(sql[i-2]))
			j := i + 1
			for ; j < len(sql); j++ {
				if escapes && sql[j] == '\\' {
					j++
					continue
				}
				if sql[j] == '\'' {
					if j+1 < len(sql) && sql[j+1] == '\'' {
						j++
						continue
					}
					break
				}
			}
			if j >= len(sql) {
				return nil, fmt.Errorf("unterminated string at byte %d", i)
			}
			i = j + 1
		case c == '"':
			j := i + 1
			for ; j < len(sql); j++ {
				if sql[j] == '"' {
					if j+1 < len(sql) && sql[j+1] == '"' {
						j++
						continue
					}
					break
				}
			}
			if j >= len(sql) {
				return nil, fmt.Errorf("unterminated quoted identifier at byte %d", i)
			}
			i = j + 1
		case c == '$' && (i == 0 || !identChar(sql[i-1])):
			tag := dollarTag.FindString(sql[i:])
			if tag == "" {
				i++
				continue
			}
			end := strings.Index(sql[i+len(tag):], tag)
			if end < 0 {
				return nil, fmt.Errorf("unterminated %s quote at byte %d", tag, i)
			}
			i += len(tag) + end + len(tag)
		default:
			i++
		}
	}
	flush(len(sql))
	return out, nil
}

var dollarTag = regexp.MustCompile(`^\$(?:[A-Za-z_][A-Za-z0-9_]*)?\$`)

// stripLeadingComments drops the whitespace and comments before a
// statement's first word.
func stripLeadingComments(s string) string {
	for {
		s = strings.TrimSpace(s)
		switch {
		case strings.HasPrefix(s, "--"):
			_, rest, ok := strings.Cut(s, "\n")
			if !ok {
				return ""
			}
			s = rest
		case strings.HasPrefix(s, "/*"):
			end := blockCommentEnd(s)
			if end < 0 {
				return ""
			}
			s = s[end:]
		default:
			return s
		}
	}
}

// blockCommentEnd is the length of the block comment s starts with
// (PostgreSQL's nest), or -1 if it does not end.
func blockCommentEnd(s string) int {
	depth := 0
	for j := 0; j+1 < len(s); j++ {
		switch s[j : j+2] {
		case "/*":
			depth++
			j++
		case "*/":
			depth--
			j++
			if depth == 0 {
				return j + 1
			}
		}
	}
	return -1
}

// unquoteIdent turns an identifier as written in SQL into the name the
// catalog holds.
func unquoteIdent(s string) string {
	if strings.HasPrefix(s, `"`) {
		return strings.ReplaceAll(s[1:len(s)-1], `""`, `"`)
	}
	return strings.ToLower(s)
}
