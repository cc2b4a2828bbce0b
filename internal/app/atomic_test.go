package app_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// --atomic-transactions on an existing stream without allow_atomic: the
// relay does not start, and says how to allow it (it never changes an
// existing stream). The stream it creates itself allows it.
func TestAtomicTransactionsNeedAllowAtomic(t *testing.T) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	ctx := context.Background()
	nc, err := nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	o := app.Options{
		DatabaseURL: env.PG.CreateOutboxDatabase(t), NATSURL: env.NATS.URL(), Table: testenv.OutboxTable, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark, DuplicateWindow: time.Minute,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20, Lease: 5 * time.Second, MaxAttempts: 3,
		AtomicTransactions: true,
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = app.Run(rctx, o, zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), "atomic_publish") && !strings.Contains(err.Error(), "atomic batch publish") || !strings.Contains(err.Error(), "nats stream edit "+stream+" --allow-batch") {
		t.Fatalf("--atomic-transactions on a stream without allow_atomic: app.Run returned %v, want a refusal with the fix", err)
	}

	// The stream the relay creates allows it.
	created, createdPrefix := env.StreamName(t)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), created) })
	o.Stream, o.SubjectPrefix, o.Slot = created, createdPrefix, "outbox_relay_created"
	o.DatabaseURL = env.PG.CreateOutboxDatabase(t)
	rctx2, cancel2 := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx2, o, zerolog.Nop()) }()
	testenv.WaitFor(t, 30*time.Second, "the relay's stream created", func() (bool, error) {
		st, err := js.Stream(ctx, created)
		if err != nil {
			return false, err
		}
		return st.CachedInfo().Config.AllowAtomicPublish, nil
	})
	cancel2()
	if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
		t.Errorf("app.Run: %v", err)
	}
}
