package testenv

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/devenv"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// PostgresOptions configures StartPostgres (see devenv.PostgresOptions).
type PostgresOptions = devenv.PostgresOptions

// Postgres is a throwaway PostgreSQL server (devenv.Postgres, whose methods
// it has) plus what tests need of it: a database per test.
type Postgres struct {
	*devenv.Postgres
}

// StartPostgres initialises a fresh cluster in a temporary directory and
// starts it on a free port (see devenv.StartPostgres); its files are kept
// after Close when OUTBOX_RELAY_TEST_KEEP is set.
func StartPostgres(opts PostgresOptions) (*Postgres, error) {
	opts.KeepFiles = opts.KeepFiles || keepFiles()
	p, err := devenv.StartPostgres(opts)
	if err != nil {
		return nil, err
	}
	return &Postgres{p}, nil
}

var (
	dbSeq    atomic.Int64
	dbUnsafe = regexp.MustCompile(`[^a-z0-9]+`)
)

// CreateDatabase creates a database that only t uses and returns its URL. The
// database, and any replication slot in it, is dropped when t ends: slots
// would otherwise pin WAL and use up max_replication_slots for the remaining
// tests.
func (p *Postgres) CreateDatabase(t testing.TB) string {
	t.Helper()
	return p.createDatabase(t, "")
}

// CreateDatabaseFrom is CreateDatabase with a copy of database template
// (CREATE DATABASE ... TEMPLATE, STRATEGY FILE_COPY): a table that takes
// long to load is loaded once and each test gets its own copy, in the time
// it takes to copy its files. Nothing may be connected to template.
func (p *Postgres) CreateDatabaseFrom(t testing.TB, template string) string {
	t.Helper()
	return p.createDatabase(t, template)
}

// CreateDatabaseEncoded is CreateDatabase with the given server encoding
// (SQL_ASCII, LATIN1, ...), under the C locale, which goes with every
// encoding, copied from template0, the only template whose encoding may be
// changed.
func (p *Postgres) CreateDatabaseEncoded(t testing.TB, encoding string) string {
	t.Helper()
	return p.createDatabase(t, "", "ENCODING "+quoteLiteral(encoding)+" LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func (p *Postgres) createDatabase(t testing.TB, template string, with ...string) string {
	t.Helper()
	suffix := fmt.Sprintf("_%d", dbSeq.Add(1))
	san := strings.Trim(dbUnsafe.ReplaceAllString(strings.ToLower(t.Name()), "_"), "_")
	name := "t_" + san
	if len(name) > 63-len(suffix) {
		name = strings.TrimRight(name[:63-len(suffix)], "_")
	}
	name += suffix

	timeout := 30 * time.Second
	if template != "" {
		timeout = 2 * time.Minute // a copy of hundreds of MB on a loaded machine
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.URL("postgres"))
	if err != nil {
		t.Fatalf("testenv: create database %s: connect: %v", name, err)
	}
	defer conn.Close(context.Background())
	create := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		// FILE_COPY copies the files instead of writing every page to the
		// WAL (WAL_LOG, the default since PostgreSQL 15).
		create += " TEMPLATE " + pgx.Identifier{template}.Sanitize() + " STRATEGY FILE_COPY"
	}
	for _, w := range with {
		create += " " + w
	}
	if _, err := conn.Exec(ctx, create); err != nil {
		t.Fatalf("testenv: create database %s: %v", name, err)
	}
	t.Cleanup(func() { p.dropDatabase(t, name) })
	return p.URL(name)
}

// OutboxTable is the table CreateOutboxDatabase migrates.
var OutboxTable = store.Table{Schema: "public", Name: "outbox"}

// CreateOutboxDatabase is CreateDatabase with the outbox table (OutboxTable)
// migrated in it, what most relay tests start from.
func (p *Postgres) CreateOutboxDatabase(t testing.TB) string {
	t.Helper()
	url := p.CreateDatabase(t)
	migrateOutbox(t, url)
	return url
}

// migrateOutbox migrates OutboxTable in the database at url.
func migrateOutbox(t testing.TB, url string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("testenv: migrate %s: connect: %v", url, err)
	}
	defer conn.Close(context.Background())
	if _, err := schema.Migrate(ctx, conn, OutboxTable); err != nil {
		t.Fatalf("testenv: migrate %s: %v", url, err)
	}
}

// dropDatabase is lenient about an unreachable server, because fault tests
// may end with it stopped and restarting it is their business; once
// connected, failing to clean up is reported since it leaks slots.
func (p *Postgres) dropDatabase(t testing.TB, name string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	connectCtx, connectCancel := context.WithTimeout(ctx, 5*time.Second)
	conn, err := pgx.Connect(connectCtx, p.URL("postgres"))
	connectCancel()
	if err != nil {
		t.Logf("testenv: not dropping database %s: cannot connect (server stopped?): %v", name, err)
		return
	}
	defer conn.Close(context.Background())
	if err := dropSlots(ctx, conn, name); err != nil {
		t.Errorf("testenv: drop replication slots of database %s: %v", name, err)
		return
	}
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		t.Errorf("testenv: drop database %s: %v", name, err)
	}
}

// dropSlots retries because a terminated walsender releases its slot only
// when its process has exited, and a client may briefly reconnect.
func dropSlots(ctx context.Context, conn *pgx.Conn, dbname string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		rows, err := conn.Query(ctx,
			"SELECT slot_name::text, active_pid FROM pg_replication_slots WHERE database = $1", dbname)
		if err != nil {
			return fmt.Errorf("list slots: %w", err)
		}
		type slot struct {
			name string
			pid  *int32
		}
		slots, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (slot, error) {
			var s slot
			err := r.Scan(&s.name, &s.pid)
			return s, err
		})
		if err != nil {
			return fmt.Errorf("list slots: %w", err)
		}
		if len(slots) == 0 {
			return nil
		}
		var lastErr error
		for _, s := range slots {
			if s.pid != nil {
				if _, err := conn.Exec(ctx, "SELECT pg_terminate_backend($1)", *s.pid); err != nil {
					lastErr = fmt.Errorf("terminate pid %d using slot %s: %w", *s.pid, s.name, err)
					continue
				}
			}
			if _, err := conn.Exec(ctx, "SELECT pg_drop_replication_slot($1)", s.name); err != nil {
				lastErr = fmt.Errorf("drop slot %s: %w", s.name, err)
			}
		}
		if lastErr != nil && time.Now().After(deadline) {
			return lastErr
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StandbyOptions configures StartStandby (see devenv.StandbyOptions).
type StandbyOptions = devenv.StandbyOptions

// StartStandby starts a physical streaming standby of p (see
// devenv.Postgres.StartStandby: p restarts once for the copy). Databases
// created on p, CreateDatabase's included, replicate to it; connect to
// them with the standby's URL or MultiHostURL. Its files are kept after
// Close when OUTBOX_RELAY_TEST_KEEP is set.
func (p *Postgres) StartStandby(opts StandbyOptions) (*Postgres, error) {
	opts.KeepFiles = opts.KeepFiles || keepFiles()
	s, err := p.Postgres.StartStandby(opts)
	if err != nil {
		return nil, err
	}
	return &Postgres{s}, nil
}

// MultiHostURL returns the URL of dbURL's database on all of servers, in
// their order, with target_session_attrs=read-write (see
// devenv.MultiHostURL): a client on it follows a promotion.
func MultiHostURL(t testing.TB, dbURL string, servers ...*Postgres) string {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	if err != nil {
		t.Fatalf("testenv: multi-host URL for %s: %v", dbURL, err)
	}
	ds := make([]*devenv.Postgres, len(servers))
	for i, s := range servers {
		ds[i] = s.Postgres
	}
	return devenv.MultiHostURL(cfg.Database, ds...)
}

// PublicationRowFilter returns the row filter publication pub holds for
// table (as pg_get_expr prints it), or "none".
func PublicationRowFilter(t testing.TB, q interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}, pub, table string) string {
	t.Helper()
	var f *string
	if err := q.QueryRow(context.Background(), `SELECT pg_get_expr(r.prqual, r.prrelid) FROM pg_publication_rel r
		JOIN pg_publication p ON p.oid = r.prpubid WHERE p.pubname = $1 AND r.prrelid = $2::regclass`, pub, table).Scan(&f); err != nil {
		t.Fatalf("read the row filter of publication %s on %s: %v", pub, table, err)
	}
	if f == nil {
		return "none"
	}
	return *f
}
