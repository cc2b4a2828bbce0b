package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// exampleTB lets Example functions, which get no *testing.T, share the
// package's servers through testenv. Only the methods testenv calls are
// implemented; cleanups are dropped because the servers go away with the
// test binary.
type exampleTB struct{ testing.TB }

func (exampleTB) Helper()             {}
func (exampleTB) Name() string        { return "example" }
func (exampleTB) Cleanup(func())      {}
func (exampleTB) Logf(string, ...any) {}
func (exampleTB) Errorf(format string, args ...any) {
	panic(fmt.Sprintf("example setup: "+format, args...))
}
func (exampleTB) Fatalf(format string, args ...any) {
	panic(fmt.Sprintf("example setup: "+format, args...))
}

// exampleServers returns a fresh database URL, a NATS URL and a stream
// name with its subject prefix.
func exampleServers() (dbURL, natsURL, stream, prefix string) {
	env := testenv.Shared(exampleTB{})
	stream, prefix = env.StreamName(exampleTB{})
	return env.PG.CreateDatabase(exampleTB{}), env.NATS.URL(), stream, prefix
}

// A consumer that charges each order once, however often it is delivered.
func Example() {
	ctx := context.Background()
	dbURL, natsURL, stream, prefix := exampleServers()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	if err := inbox.Migrate(ctx, pool, "inbox"); err != nil {
		panic(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (order_id bigint NOT NULL, amount numeric NOT NULL)`); err != nil {
		panic(err)
	}

	nc, err := nats.Connect(natsURL)
	if err != nil {
		panic(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}, Duplicates: 100 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "billing", AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: -1})
	if err != nil {
		panic(err)
	}
	// The relay publishes order 103 twice, the second time after the
	// stream's duplicate window, so JetStream stores both.
	for range 2 {
		if _, err := js.Publish(ctx, prefix+"order.received", []byte(`{"order_id": 103, "total": "29.00"}`), jetstream.WithMsgID("order-103-ack")); err != nil {
			panic(err)
		}
		time.Sleep(200 * time.Millisecond)
	}

	quiet := zerolog.Nop()
	in, err := inbox.New(pool, inbox.Config{Consumer: "billing", Logger: &quiet})
	if err != nil {
		panic(err)
	}
	charge := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		_, err := tx.Exec(ctx, `INSERT INTO charges (order_id, amount) SELECT (d->>'order_id')::bigint, (d->>'total')::numeric FROM (SELECT $1::jsonb AS d) x`, msg.Data())
		return err
	}
	batch, err := cons.Fetch(2, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		panic(err)
	}
	for msg := range batch.Messages() {
		outcome, err := in.Process(ctx, msg, charge)
		fmt.Println(msg.Headers().Get(jetstream.MsgIDHeader), outcome, err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n); err != nil {
		panic(err)
	}
	fmt.Println("charges:", n)
	// Output:
	// order-103-ack applied <nil>
	// order-103-ack duplicate <nil>
	// charges: 1
}
