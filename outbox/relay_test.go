package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// TestRolledBackEnqueueIsNeverDelivered runs the relay in this process and
// enqueues in transactions that roll back between ones that commit: only the
// committed messages reach the stream. The last committed message is
// delivered after every rollback, so once it is in the stream, anything
// rolled back would have been too.
func TestRolledBackEnqueueIsNeverDelivered(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	pool, _, url := newDBURL(t, table.Table{})
	stream, prefix := env.StreamName(t)
	ctx := context.Background()

	var (
		mu      sync.Mutex
		running *relay.Relay
	)
	opts := app.Options{
		DatabaseURL: url, NATSURL: env.NATS.URL(),
		Table: table.Table{Schema: "public", Name: "outbox"}, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark,
		DuplicateWindow: 2 * time.Minute, AckTimeout: 5 * time.Second, MaxInFlight: 256, MaxInFlightBytes: 1 << 20,
		StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		PollInterval: 100 * time.Millisecond, BackoffMin: 10 * time.Millisecond, BackoffMax: 50 * time.Millisecond, Lease: 10 * time.Second,
		Started: func(r *relay.Relay) { mu.Lock(); running = r; mu.Unlock() },
	}
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	go func() { done <- app.Run(runCtx, opts, log) }()
	t.Cleanup(func() {
		stop()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("relay: %v", err)
		}
	})
	testenv.WaitFor(t, 30*time.Second, "relay streaming", func() (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		return running != nil && running.Role() == relay.RoleActive, nil
	})

	enqueue := func(commit bool, ids ...int) {
		t.Helper()
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (id int PRIMARY KEY)`); err != nil {
			t.Fatal(err)
		}
		var batch []outbox.Message
		for _, id := range ids {
			if _, err := tx.Exec(ctx, `INSERT INTO orders (id) VALUES ($1)`, id); err != nil {
				t.Fatal(err)
			}
			if id%2 == 0 {
				if err := outbox.Enqueue(ctx, tx, order(id)); err != nil {
					t.Fatal(err)
				}
			} else {
				batch = append(batch, order(id))
			}
		}
		if _, err := outbox.EnqueueBatch(ctx, tx, batch); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	enqueue(true, 1)
	enqueue(false, 2, 3, 4, 5)
	enqueue(true, 6)
	enqueue(false, 7, 8)
	enqueue(true, 9)

	nc, err := nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	testenv.WaitFor(t, 30*time.Second, "the last committed message in the stream", func() (bool, error) {
		got = got[:0]
		s, err := js.Stream(ctx, stream)
		if err != nil {
			return false, err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return false, err
		}
		for seq := uint64(1); seq <= info.State.LastSeq; seq++ {
			m, err := s.GetMsg(ctx, seq)
			if err != nil {
				return false, err
			}
			got = append(got, m.Header.Get(jetstream.MsgIDHeader))
		}
		return len(got) > 0 && got[len(got)-1] == "order-9-ack", fmt.Errorf("stream holds %v", got)
	})
	if fmt.Sprint(got) != "[order-1-ack order-6-ack order-9-ack]" {
		t.Errorf("stream holds %v, want only the committed order-1, -6 and -9", got)
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&rows); err != nil || rows != 3 {
		t.Errorf("%d outbox rows (%v), want 3", rows, err)
	}
}
