package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// fixture is one test's database (inbox and effects tables) and stream
// (with one durable pull consumer).
type fixture struct {
	t       *testing.T
	dbURL   string
	pool    *pgxpool.Pool
	js      jetstream.JetStream
	stream  string
	subject string
	cons    jetstream.Consumer
}

type fixtureOpts struct {
	dupWindow time.Duration // stream duplicate window; default 2m
	ackWait   time.Duration // consumer AckWait; default 30s
}

func newFixture(t *testing.T, o fixtureOpts) *fixture {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	env := testenv.Shared(t)
	f := &fixture{t: t, dbURL: env.PG.CreateDatabase(t)}
	f.pool = newPool(t, f.dbURL)
	if err := inbox.Migrate(ctx, f.pool, "inbox"); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	if _, err := f.pool.Exec(ctx, `CREATE TABLE effects (id bigserial PRIMARY KEY, msg_id text NOT NULL, data text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatalf("nats: %v", err)
	}
	t.Cleanup(nc.Close)
	if f.js, err = jetstream.New(nc); err != nil {
		t.Fatal(err)
	}
	var prefix string
	f.stream, prefix = env.StreamName(t)
	f.subject = prefix + "order.received"
	if o.dupWindow == 0 {
		o.dupWindow = 2 * time.Minute
	}
	if o.ackWait == 0 {
		o.ackWait = 30 * time.Second
	}
	s, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: f.stream, Subjects: []string{prefix + ">"}, Duplicates: o.dupWindow, Storage: jetstream.MemoryStorage})
	if err != nil {
		t.Fatalf("create stream: %v", err)
	}
	f.cons, err = s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{Durable: "billing", AckPolicy: jetstream.AckExplicitPolicy, AckWait: o.ackWait, MaxDeliver: -1})
	if err != nil {
		t.Fatalf("create consumer: %v", err)
	}
	return f
}

func newPool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// newInbox returns an inbox for consumer "billing" with fast backoff and a
// logger writing to the test.
func (f *fixture) newInbox(pool *pgxpool.Pool, mod func(*inbox.Config)) *inbox.Inbox {
	f.t.Helper()
	logger := slog.New(slog.NewTextHandler(f.t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg := inbox.Config{Consumer: "billing", BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Logger: logger}
	if mod != nil {
		mod(&cfg)
	}
	in, err := inbox.New(pool, cfg)
	if err != nil {
		f.t.Fatalf("inbox.New: %v", err)
	}
	return in
}

// publish stores a message with Nats-Msg-Id id ("" for none) and returns
// whether JetStream stored it as a duplicate.
func (f *fixture) publish(id, data string, hdr map[string]string) bool {
	f.t.Helper()
	m := &nats.Msg{Subject: f.subject, Data: []byte(data), Header: nats.Header{}}
	if id != "" {
		m.Header.Set(jetstream.MsgIDHeader, id)
	}
	for k, v := range hdr {
		m.Header.Set(k, v)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := f.js.PublishMsg(ctx, m)
	if err != nil {
		f.t.Fatalf("publish %s: %v", id, err)
	}
	return ack.Duplicate
}

// publishStored publishes until the broker stores the message rather than
// dropping it as a duplicate. Past the duplicate window the server may still
// hold the ID for up to another window (it expires IDs in sweeps), so no
// fixed wait is right; a repeat it drops changes nothing in the stream.
func (f *fixture) publishStored(id, data string, hdr map[string]string) {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for f.publish(id, data, hdr) {
		if time.Now().After(deadline) {
			f.t.Fatalf("publish %s: still dropped as a duplicate after 30s", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// fetch returns the next delivery, waiting up to wait.
func (f *fixture) fetch(wait time.Duration) jetstream.Msg {
	f.t.Helper()
	m, err := f.tryFetch(wait)
	if err != nil {
		f.t.Fatal(err)
	}
	return m
}

func (f *fixture) tryFetch(wait time.Duration) (jetstream.Msg, error) {
	batch, err := f.cons.Fetch(1, jetstream.FetchMaxWait(wait))
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	for m := range batch.Messages() {
		return m, nil
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	return nil, fmt.Errorf("no message within %v", wait)
}

// apply is the handler of most tests: one effect row per application.
func apply(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (msg_id, data) VALUES ($1, $2)`, msg.Headers().Get(jetstream.MsgIDHeader), string(msg.Data()))
	return err
}

// effects returns the effect rows' count and distinct message IDs.
func (f *fixture) effects() (rows, distinct int) {
	f.t.Helper()
	if err := f.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT msg_id) FROM effects`).Scan(&rows, &distinct); err != nil {
		f.t.Fatal(err)
	}
	return rows, distinct
}

func (f *fixture) requireEffects(rows, distinct int) {
	f.t.Helper()
	r, d := f.effects()
	if r != rows || d != distinct {
		f.t.Errorf("effects: %d rows, %d distinct message IDs; want %d and %d", r, d, rows, distinct)
	}
}

// requireSettled waits until the consumer has nothing pending or waiting
// for an ack: every delivery was acked or terminated.
func (f *fixture) requireSettled() {
	f.t.Helper()
	testenv.WaitFor(f.t, 10*time.Second, "consumer to have no unacked messages", func() (bool, error) {
		info, err := f.cons.Info(context.Background())
		if err != nil {
			return false, err
		}
		return info.NumAckPending == 0 && info.NumPending == 0, fmt.Errorf("ack pending %d, pending %d", info.NumAckPending, info.NumPending)
	})
}

func expect(t *testing.T, what string, got, want inbox.Outcome, err error) {
	t.Helper()
	if got != want {
		t.Fatalf("%s: outcome %v (err %v), want %v", what, got, err, want)
	}
}
