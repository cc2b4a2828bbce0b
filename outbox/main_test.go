package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// newDB creates a database with the outbox table t (public.outbox when
// zero) and returns a pool on it whose statements are counted.
func newDB(t testing.TB, tbl table.Table) (*pgxpool.Pool, *queryCounter) {
	pool, qc, _ := newDBURL(t, tbl)
	return pool, qc
}

// newDBURL is newDB that also returns the database's URL.
func newDBURL(t testing.TB, tbl table.Table) (*pgxpool.Pool, *queryCounter, string) {
	t.Helper()
	return newDBWith(t, tbl, schema.MigrateOptions{})
}

// newDBWith is newDBURL with migrate's options (--payload-type,
// --partition-interval).
func newDBWith(t testing.TB, tbl table.Table, opts schema.MigrateOptions) (*pgxpool.Pool, *queryCounter, string) {
	t.Helper()
	if tbl == (table.Table{}) {
		tbl = table.Table{Schema: "public", Name: "outbox"}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	defer conn.Close(context.Background())
	if _, err := schema.MigrateWith(ctx, conn, tbl, opts); err != nil {
		t.Fatalf("migrate %+v: %v", opts, err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	qc := &queryCounter{}
	cfg.ConnConfig.Tracer = qc
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool, qc, url
}

// queryCounter counts statements sent, to check round trips.
type queryCounter struct{ n atomic.Int64 }

func (q *queryCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	q.n.Add(1)
	return ctx
}

func (q *queryCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// exampleTB lets Example functions, which get no *testing.T, share the
// package's servers through testenv. Only the methods testenv calls are
// implemented; cleanups are dropped because the servers, and the databases
// in them, go away with the test binary.
type exampleTB struct {
	testing.TB
	name string
}

func (e exampleTB) Helper()                         {}
func (e exampleTB) Name() string                    { return e.name }
func (e exampleTB) Cleanup(func())                  {}
func (e exampleTB) Logf(format string, args ...any) {}
func (e exampleTB) Errorf(format string, args ...any) {
	panic(fmt.Sprintf("example setup: "+format, args...))
}
func (e exampleTB) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf("example setup: "+format, args...))
}

// exampleDatabase returns the URL of a fresh database with the outbox table.
func exampleDatabase() string {
	tb := exampleTB{name: "example"}
	url := testenv.Shared(tb).PG.CreateDatabase(tb)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		panic(err)
	}
	defer conn.Close(ctx)
	if _, err := schema.Migrate(ctx, conn, table.Table{Schema: "public", Name: "outbox"}); err != nil {
		panic(err)
	}
	if _, err := conn.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)`); err != nil {
		panic(err)
	}
	return url
}
