package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Every instance of a table runs with the same --ordering and --on-publish
// (DESIGN.md, Several instances; issue 20, item 5). The first instance, run
// with --ordering aggregate, holds aggregate 7 behind its refused first row.
// A second instance without --ordering aggregate used to start, and its
// poller published 7's later rows before the first one: now it is refused at
// start, names the setting, the table's value and its own, and publishes
// nothing. One with the same settings starts (and waits for the slot); one with
// another --on-publish is refused too. The documented change (stop every
// instance, migrate --record-settings, start them with the new flags) works,
// and afterwards the old flags are the ones refused.
func TestInstancesMustShareSettings(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	s := sharedSetup(t)
	h := newHarness(t, s)
	h.opts.Ordering = app.OrderingAggregate
	h.opts.MaxAttempts = 2
	ctx := context.Background()
	if _, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: s.stream, Subjects: []string{s.subjectPrefix + ">"},
		MaxMsgSize: 1024, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.js.DeleteStream(context.Background(), s.stream) })
	h.start()
	h.exec(`INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('order-7-1', 'order_event', jsonb_build_object('pad', repeat('x', 2048)), 'shop/eu', '7', 1)`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('order-7-2', 'order_event', '{}', 'shop/eu', '7', 2), ('order-7-3', 'order_event', '{}', 'shop/eu', '7', 3)`)
	testenv.WaitFor(t, 60*time.Second, "order-7-1 failed, 7-2 and 7-3 held", func() (bool, error) {
		return h.countState("failed") == 1 && h.countState("scheduled") == 2, fmt.Errorf("failed %d, scheduled %d, published %d",
			h.countState("failed"), h.countState("scheduled"), h.countState("published"))
	})

	// The held rows say which aggregate, with type and id quoted: "shop/eu"
	// and "7" would otherwise read like "shop" and "eu/7".
	for _, id := range []string{"order-7-2", "order-7-3"} {
		var le string
		if err := h.pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE work_id = $1`, id).Scan(&le); err != nil {
			t.Fatal(err)
		}
		if want := `(an earlier row of aggregate "shop/eu"/"7")`; !strings.HasPrefix(le, "held: waiting for order-7-") || !strings.HasSuffix(le, want) {
			t.Errorf("%s: last_error %q, want held ... %s", id, le, want)
		}
	}

	// second runs another instance of the table for at most d and returns
	// what Run returned (nil: it ran until d was up) and whether it stood by
	// (the first instance streams the slot).
	second := func(o app.Options, d time.Duration) (error, bool) {
		t.Helper()
		var mu sync.Mutex
		var r *relay.Relay
		o.Started = func(x *relay.Relay) { mu.Lock(); r = x; mu.Unlock() }
		o.WorkerID = "second"
		rctx, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		done := make(chan error, 1)
		go func() { done <- app.Run(rctx, o, zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)) }()
		stoodBy := false
		for {
			select {
			case err := <-done:
				return err, stoodBy
			case <-time.After(20 * time.Millisecond):
			}
			mu.Lock()
			stoodBy = stoodBy || (r != nil && r.Role() == relay.RoleWaiting)
			mu.Unlock()
		}
	}
	held := func(when string) {
		t.Helper()
		byID, _ := h.streamMsgs()
		for _, id := range []string{"order-7-2", "order-7-3"} {
			if byID[id] != nil {
				t.Errorf("%s: %s is in the stream before order-7-1", when, id)
			}
		}
		if n := h.countState("scheduled"); n != 2 {
			t.Errorf("%s: %d rows scheduled, want order-7-2 and order-7-3 still held", when, n)
		}
	}

	// The original bug: an instance without --ordering aggregate.
	unordered := h.opts
	unordered.Ordering = app.OrderingNone
	err, _ := second(unordered, 5*time.Second)
	if !errors.Is(err, store.ErrSettingsDiffer) || !strings.Contains(err.Error(), "--ordering: the table's is aggregate, this instance's none") ||
		!strings.Contains(err.Error(), "--ordering aggregate --on-publish mark") || !strings.Contains(err.Error(), "migrate --record-settings --ordering none --on-publish mark") {
		t.Errorf("an instance without --ordering aggregate: %v; want it refused, naming --ordering, both values and the change", err)
	}
	held("after an instance without --ordering aggregate tried to start")
	if t.Failed() {
		t.FailNow()
	}

	// Another --on-publish alone, and both at once.
	deleting := h.opts
	deleting.Policy = store.PolicyDelete
	err, _ = second(deleting, 5*time.Second)
	if !errors.Is(err, store.ErrSettingsDiffer) || !strings.Contains(err.Error(), "--on-publish: the table's is mark, this instance's delete") ||
		strings.Contains(err.Error(), "--ordering: ") {
		t.Fatalf("an instance with --on-publish delete: %v; want it refused naming --on-publish only", err)
	}
	unordered.Policy = store.PolicyDelete
	err, _ = second(unordered, 5*time.Second)
	if !errors.Is(err, store.ErrSettingsDiffer) || !strings.Contains(err.Error(), "--ordering: ") || !strings.Contains(err.Error(), "--on-publish: ") {
		t.Fatalf("an instance with both settings different: %v; want both named", err)
	}

	// The same settings: it starts and waits beside the first.
	err, stoodBy := second(h.opts, 3*time.Second)
	if err != nil || !stoodBy {
		t.Fatalf("an instance with the table's settings: %v, stood by %t; want it running, waiting for the slot", err, stoodBy)
	}
	held("after a second instance with the same settings ran")
	rec, found, err := store.ReadSettings(ctx, h.pool, h.opts.Table)
	if err != nil || !found || rec.Ordering != "aggregate" || rec.OnPublish != store.PolicyMark || !strings.HasPrefix(rec.RecordedBy, "run --worker-id ") {
		t.Fatalf("recorded settings %+v, found %t, %v; want aggregate and mark, recorded by the first run", rec, found, err)
	}

	// The documented change: stop every instance, record, start with the
	// new flags.
	h.stop()
	prev, found, err := store.RecordSettings(ctx, h.pool, h.opts.Table, store.Settings{Ordering: "none", OnPublish: store.PolicyMark}, "test")
	if err != nil || !found || prev.Ordering != "aggregate" {
		t.Fatalf("record settings: previous %+v, found %t, %v; want the old aggregate record", prev, found, err)
	}
	h.opts.Ordering = app.OrderingAggregate
	if err := h.launchErr(5 * time.Second); !errors.Is(err, store.ErrSettingsDiffer) {
		t.Fatalf("an instance with the old --ordering after the change: %v; want it refused", err)
	}
	h.opts.Ordering = app.OrderingNone
	h.start()
	// Unordered now, as the operator chose: the held rows are the poller's.
	testenv.WaitFor(t, 30*time.Second, "order-7-2 and order-7-3 published", func() (bool, error) {
		return h.countState("published") == 2, fmt.Errorf("published %d", h.countState("published"))
	})
}

// launchErr runs the harness's options once, for at most d, and returns
// what Run returned.
func (h *harness) launchErr(d time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return app.Run(ctx, h.opts, zerolog.Nop())
}
