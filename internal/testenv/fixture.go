package testenv

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Fixture is what most tests of the delivery paths start from: a database
// of their own on the shared PostgreSQL with the outbox table migrated
// (OutboxTable), a pool on it, a connection to the shared nats-server with
// its JetStream context, and a stream name and subject prefix of their own
// (the stream itself is the test's, or the relay's, to create). Everything
// is closed when the test ends.
type Fixture struct {
	DBURL  string
	Pool   *pgxpool.Pool
	NC     *nats.Conn
	JS     jetstream.JetStream
	Stream string
	Prefix string
}

// NewFixture builds a Fixture; natsOpts are added to the connection's.
func NewFixture(t testing.TB, natsOpts ...nats.Option) *Fixture {
	t.Helper()
	env := Shared(t)
	return NewFixtureOn(t, env.PG.CreateDatabase(t), env.NATS.URL(), natsOpts...)
}

// NewFixtureOn is NewFixture on the database at dbURL (the outbox table
// migrated there, if it is not) and the nats-server at natsURL (a server of
// the test's own).
func NewFixtureOn(t testing.TB, dbURL, natsURL string, natsOpts ...nats.Option) *Fixture {
	t.Helper()
	ctx := context.Background()
	f := &Fixture{DBURL: dbURL}
	f.Stream, f.Prefix = Shared(t).StreamName(t)
	migrateOutbox(t, dbURL)
	var err error
	if f.Pool, err = pgxpool.New(ctx, dbURL); err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(f.Pool.Close)
	if f.NC, err = nats.Connect(natsURL, natsOpts...); err != nil {
		t.Fatalf("nats: %v", err)
	}
	t.Cleanup(f.NC.Close)
	if f.JS, err = jetstream.New(f.NC); err != nil {
		t.Fatal(err)
	}
	return f
}
