package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
	// stream's duplicate window, so JetStream stores both. (A repeat the
	// broker still deduplicates is dropped: the example tries again.)
	for stored := 0; stored < 2; {
		ack, err := js.Publish(ctx, prefix+"order.received", []byte(`{"order_id": 103, "total": "29.00"}`), jetstream.WithMsgID("order-103-ack"))
		if err != nil {
			panic(err)
		}
		if !ack.Duplicate {
			stored++
		}
		time.Sleep(50 * time.Millisecond)
	}

	in, err := inbox.New(pool, inbox.Config{Consumer: "billing"}) // Logger: a *slog.Logger; nil is quiet
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

// exampleSetup returns a pool on a fresh database with the inbox tables,
// and a durable consumer on a fresh stream with its subject prefix.
func exampleSetup(ctx context.Context, durable string) (*pgxpool.Pool, jetstream.JetStream, jetstream.Consumer, string, func()) {
	dbURL, natsURL, stream, prefix := exampleServers()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		panic(err)
	}
	if err := inbox.Migrate(ctx, pool, "inbox"); err != nil {
		panic(err)
	}
	nc, err := nats.Connect(natsURL)
	if err != nil {
		panic(err)
	}
	js, _ := jetstream.New(nc)
	s, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}})
	if err != nil {
		panic(err)
	}
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, MaxDeliver: -1})
	if err != nil {
		panic(err)
	}
	return pool, js, cons, prefix, func() { nc.Close(); pool.Close() }
}

// examplePublish stores a message as the relay would publish a row of
// order 103 with the given kind and sequence.
func examplePublish(ctx context.Context, js jetstream.JetStream, prefix, kind, workID string, seq int, extra nats.Header) {
	m := nats.NewMsg(prefix + kind)
	m.Data = []byte(`{"order_id": 103}`)
	m.Header.Set(jetstream.MsgIDHeader, workID)
	m.Header.Set("Outbox-Kind", kind)
	m.Header.Set("Outbox-Aggregate-Type", "order")
	m.Header.Set("Outbox-Aggregate-Id", "103")
	m.Header.Set("Outbox-Sequence", fmt.Sprint(seq))
	for k, v := range extra {
		m.Header[k] = v
	}
	if _, err := js.PublishMsg(ctx, m); err != nil {
		panic(err)
	}
}

// A history consumer: an order's events are applied in their sequence,
// whatever order the deliveries come in. Sequence 2 arrives first and
// waits (nak'd with a delay) until sequence 1 has been applied.
func Example_inSequence() {
	ctx := context.Background()
	pool, js, cons, prefix, done := exampleSetup(ctx, "ledger")
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE order_events (n bigserial, order_id bigint, seq bigint, event text)`); err != nil {
		panic(err)
	}
	examplePublish(ctx, js, prefix, "order.paid", "order-103-paid", 2, nil)
	examplePublish(ctx, js, prefix, "order.placed", "order-103-placed", 1, nil)

	in, err := inbox.New(pool, inbox.Config{
		Consumer: "ledger",
		Order:    inbox.InSequence,
		GapAfter: 10 * time.Minute, // then OnGap, an error log and Stats.Gaps
		OnGap:    func(g inbox.Gap) { fmt.Printf("sequence %d of %s/%s missing\n", g.Applied+1, g.Type, g.ID) },
	})
	if err != nil {
		panic(err)
	}
	appendEvent := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		agg, _, err := inbox.AggregateOf(msg)
		if err != nil {
			return err
		}
		_, err = tx.Exec(ctx, `INSERT INTO order_events (order_id, seq, event) VALUES ($1, $2, $3)`,
			agg.ID, agg.Seq, msg.Headers().Get(jetstream.MsgIDHeader))
		return err
	}
	for range 3 {
		batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
		if err != nil {
			panic(err)
		}
		for msg := range batch.Messages() {
			outcome, err := in.Process(ctx, msg, appendEvent)
			fmt.Println(msg.Headers().Get(jetstream.MsgIDHeader), outcome, err)
		}
	}
	var events string
	if err := pool.QueryRow(ctx, `SELECT string_agg(seq || ' ' || event, ', ' ORDER BY n) FROM order_events`).Scan(&events); err != nil {
		panic(err)
	}
	fmt.Println("events:", events)
	// Output:
	// order-103-paid waiting <nil>
	// order-103-placed applied <nil>
	// order-103-paid applied <nil>
	// events: 1 order-103-placed, 2 order-103-paid
}

// A projection of an order's current status: a newer sequence wins, an
// older one is recorded as superseded and acked, and with EnforceDeadline a
// message whose Outbox-Expires-At has passed (on the database's clock) is
// recorded as expired and terminated.
func Example_latestWins() {
	ctx := context.Background()
	pool, js, cons, prefix, done := exampleSetup(ctx, "status-view")
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE order_status (order_id bigint PRIMARY KEY, status text, version bigint)`); err != nil {
		panic(err)
	}
	examplePublish(ctx, js, prefix, "order.shipped", "order-103-shipped", 3, nil)
	examplePublish(ctx, js, prefix, "order.paid", "order-103-paid", 2, nil)
	examplePublish(ctx, js, prefix, "order.discount", "order-103-discount", 4,
		nats.Header{"Outbox-Expires-At": []string{"2020-01-01T00:00:00Z"}})

	in, err := inbox.New(pool, inbox.Config{Consumer: "status-view", Order: inbox.LatestWins, EnforceDeadline: true})
	if err != nil {
		panic(err)
	}
	setStatus := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		agg, _, err := inbox.AggregateOf(msg)
		if err != nil {
			return err
		}
		// No version check here: the inbox only calls this with a newer one.
		_, err = tx.Exec(ctx, `INSERT INTO order_status VALUES ($1, $2, $3)
			ON CONFLICT (order_id) DO UPDATE SET status = EXCLUDED.status, version = EXCLUDED.version`,
			agg.ID, msg.Headers().Get("Outbox-Kind"), agg.Seq)
		return err
	}
	batch, err := cons.Fetch(3, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		panic(err)
	}
	for msg := range batch.Messages() {
		outcome, err := in.Process(ctx, msg, setStatus)
		fmt.Println(msg.Headers().Get(jetstream.MsgIDHeader), outcome, errors.Is(err, inbox.ErrExpired))
	}
	var status string
	var version int
	if err := pool.QueryRow(ctx, `SELECT status, version FROM order_status WHERE order_id = 103`).Scan(&status, &version); err != nil {
		panic(err)
	}
	fmt.Printf("order 103: %q at version %d\n", status, version)
	var audit string
	if err := pool.QueryRow(ctx, `SELECT string_agg(message_id || ' ' || disposition, ', ' ORDER BY aggregate_seq) FROM inbox`).Scan(&audit); err != nil {
		panic(err)
	}
	fmt.Println("inbox:", audit)
	// Output:
	// order-103-shipped applied false
	// order-103-paid superseded false
	// order-103-discount expired true
	// order 103: "order.shipped" at version 3
	// inbox: order-103-paid superseded, order-103-shipped applied, order-103-discount expired
}
