package app_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The relay reads its stream back after a restart and looks uncertain rows
// up in it (G18), each read through a consumer it creates and deletes. A
// stream at its max_consumers, or a NATS user that may not create
// consumers, made every such read fail: found only after the first crash,
// when delivery stalled (the poller spun on 110,510 failed lookups in 45 s
// in the run). Both are refused at start now, with the fix; with
// the reads turned off (--readback-limit 0) the relay starts.
func TestReadsCheckedAtStart(t *testing.T) {
	env := testenv.Shared(t)
	ctx := context.Background()
	// Slots are the cluster's: each start has its own.
	slots := 0
	options := func(natsURL, stream, prefix string) app.Options {
		slots++
		return app.Options{
			DatabaseURL: env.PG.CreateOutboxDatabase(t), NATSURL: natsURL, Table: testenv.OutboxTable, Slot: fmt.Sprintf("outbox_relay_reads_%d", slots), Publication: "outbox_relay",
			Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark, DuplicateWindow: time.Minute,
			AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
			MaxInFlight: 256, MaxInFlightBytes: 1 << 20, Lease: 5 * time.Second, MaxAttempts: 3,
		}
	}
	refused := func(t *testing.T, o app.Options, want ...string) {
		t.Helper()
		rctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		err := app.Run(rctx, o, zerolog.Nop())
		if err == nil {
			t.Fatalf("app.Run returned nil, want a refusal at start")
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Fatalf("app.Run: %v\nwant it to name %q", err, w)
			}
		}
	}
	starts := func(t *testing.T, o app.Options) {
		t.Helper()
		o.ReadBackLimit = -1
		var mu sync.Mutex
		var r *relay.Relay
		rctx, cancel := context.WithCancel(ctx)
		done := make(chan error, 1)
		o.Started = func(started *relay.Relay) { mu.Lock(); r = started; mu.Unlock() }
		go func() { done <- app.Run(rctx, o, zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)) }()
		testenv.WaitFor(t, 30*time.Second, "the relay streaming with --readback-limit 0", func() (bool, error) {
			select {
			case err := <-done:
				return false, fmt.Errorf("app.Run returned %v", err)
			default:
			}
			mu.Lock()
			defer mu.Unlock()
			return r != nil && r.Role() == relay.RoleActive, nil
		})
		cancel()
		<-done
	}

	t.Run("max_consumers", func(t *testing.T) {
		stream, prefix := env.StreamName(t)
		nc, err := nats.Connect(env.NATS.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, err := jetstream.New(nc)
		if err != nil {
			t.Fatal(err)
		}
		st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}, Duplicates: time.Minute, MaxConsumers: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
		if _, err := st.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: "app", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
			t.Fatal(err)
		}
		refused(t, options(env.NATS.URL(), stream, prefix), "max_consumers", "--readback-limit 0")
		starts(t, options(env.NATS.URL(), stream, prefix))
	})

	t.Run("no permission to create consumers", func(t *testing.T) {
		srv, err := testenv.StartNATS(testenv.NATSOptions{Conf: `authorization {
  users = [
    {user: admin, password: admin}
    {user: relayuser, password: s3cret, permissions: {
      publish: {allow: [">"], deny: ["$JS.API.CONSUMER.CREATE.>", "$JS.API.CONSUMER.DURABLE.CREATE.>"]}
      subscribe: {allow: [">"]}
    }}
  ]
}`, ReadyUser: "admin", ReadyPassword: "admin"})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Close)
		port := srv.Port()
		stream, prefix := "OUTBOX_PERM", "perm."
		relayURL := fmt.Sprintf("nats://relayuser:s3cret@127.0.0.1:%d", port)
		refused(t, options(relayURL, stream, prefix), "may not create consumers", "$JS.API.CONSUMER.CREATE."+stream+".>", "--readback-limit 0")
		starts(t, options(relayURL, stream, prefix))
	})
}
