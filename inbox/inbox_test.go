package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// nakOnAck turns the inbox's ack into a nak: the effect is committed but
// JetStream is told to deliver the message again, as after a lost ack.
type nakOnAck struct{ jetstream.Msg }

func (m nakOnAck) DoubleAck(context.Context) error { return m.Nak() }

// TestRedeliveryAfterNak: a handler failure rolls back and naks; the
// redelivery applies once; a message applied and then nak'd (lost ack) comes
// back and is acked as a duplicate. One effect.
func TestRedeliveryAfterNak(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	in := f.newInbox(f.pool, nil)
	ctx := context.Background()
	f.publish("order-103-ack", `{"order_id":103}`, nil)

	failOnce := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		if err := apply(ctx, tx, msg); err != nil {
			return err
		}
		return errors.New("downstream not ready")
	}
	out, err := in.Process(ctx, f.fetch(5*time.Second), failOnce)
	expect(t, "first delivery, handler fails", out, inbox.Retrying, err)
	f.requireEffects(0, 0)

	m := f.fetch(5 * time.Second)
	if md, _ := m.Metadata(); md.NumDelivered != 2 {
		t.Errorf("second delivery has NumDelivered %d", md.NumDelivered)
	}
	out, err = in.Process(ctx, nakOnAck{m}, apply)
	expect(t, "second delivery, applied, ack replaced by nak", out, inbox.Applied, err)

	out, err = in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "third delivery", out, inbox.Duplicate, err)
	f.requireEffects(1, 1)
	f.requireSettled()
	if s := in.Stats(); s.Applied != 1 || s.Duplicates != 1 || s.Retried != 1 || s.Rejected != 0 {
		t.Errorf("stats %+v", s)
	}
}

// TestRepublishAfterDuplicateWindow: the relay publishes a row again after
// the stream's duplicate window (a restart, a redrive), so the stream holds
// it twice. One effect.
func TestRepublishAfterDuplicateWindow(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond})
	in := f.newInbox(f.pool, nil)
	ctx := context.Background()
	if f.publish("order-103-ack", `{"order_id":103}`, nil) {
		t.Fatal("first publish stored as a duplicate")
	}
	if !f.publish("order-103-ack", `{"order_id":103}`, nil) {
		t.Fatal("a publish inside the window was not dropped by the broker")
	}
	f.publishStored("order-103-ack", `{"order_id":103}`, nil) // once the window has passed
	out, err := in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "first copy", out, inbox.Applied, err)
	out, err = in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "second copy", out, inbox.Duplicate, err)
	f.requireEffects(1, 1)
	f.requireSettled()
}

// TestTwoInstancesRace: instance A is still in its handler when AckWait
// expires and JetStream hands the message to instance B (another pool, so
// another connection). B's inbox insert waits for A's transaction and then
// finds a duplicate; B's handler never runs. Also the same delivery handed to
// two instances at once.
func TestTwoInstancesRace(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{ackWait: time.Second})
	a := f.newInbox(f.pool, nil)
	b := f.newInbox(newPool(t, f.dbURL), nil)
	ctx := context.Background()

	t.Run("redelivery after AckWait", func(t *testing.T) {
		f.publish("order-1-ack", `{"order_id":1}`, nil)
		started, release := make(chan struct{}), make(chan struct{})
		slow := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
			if err := apply(ctx, tx, msg); err != nil {
				return err
			}
			close(started)
			<-release
			return nil
		}
		var bCalled atomic.Bool
		bHandler := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
			bCalled.Store(true)
			return apply(ctx, tx, msg)
		}
		type result struct {
			out inbox.Outcome
			err error
		}
		aDone, bDone := make(chan result, 1), make(chan result, 1)
		first := f.fetch(5 * time.Second)
		go func() { o, err := a.Process(ctx, first, slow); aDone <- result{o, err} }()
		<-started
		second := f.fetch(5 * time.Second) // the redelivery, once AckWait passed
		if md, _ := second.Metadata(); md.NumDelivered != 2 {
			t.Fatalf("redelivery has NumDelivered %d", md.NumDelivered)
		}
		go func() { o, err := b.Process(ctx, second, bHandler); bDone <- result{o, err} }()
		select {
		case r := <-bDone:
			t.Fatalf("B finished (%v, %v) while A's transaction was open", r.out, r.err)
		case <-time.After(300 * time.Millisecond):
		}
		close(release)
		ra, rb := <-aDone, <-bDone
		expect(t, "A", ra.out, inbox.Applied, ra.err)
		expect(t, "B", rb.out, inbox.Duplicate, rb.err)
		if bCalled.Load() {
			t.Error("B's handler ran")
		}
		f.requireEffects(1, 1)
		f.requireSettled()
	})

	t.Run("one delivery handed to both", func(t *testing.T) {
		f.publish("order-2-ack", `{"order_id":2}`, nil)
		m := f.fetch(5 * time.Second)
		var wg sync.WaitGroup
		outs := make([]inbox.Outcome, 2)
		slowApply := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
			time.Sleep(100 * time.Millisecond)
			return apply(ctx, tx, msg)
		}
		for i, in := range []*inbox.Inbox{a, b} {
			wg.Go(func() {
				o, err := in.Process(ctx, m, slowApply)
				if err != nil {
					t.Errorf("instance %d: %v", i, err)
				}
				outs[i] = o
			})
		}
		wg.Wait()
		got := fmt.Sprint(outs)
		if got != "[applied duplicate]" && got != "[duplicate applied]" {
			t.Errorf("outcomes %s, want one applied and one duplicate", got)
		}
		f.requireEffects(2, 2)
		f.requireSettled()
	})
}

// TestCrashBetweenCommitAndAck: the consumer dies after its commit and
// before its ack (the hook panics, unwinding past the ack like a crash). A
// restarted consumer gets the redelivery after AckWait and acks it as a
// duplicate. One effect.
func TestCrashBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{ackWait: time.Second})
	crashing := f.newInbox(f.pool, nil)
	inbox.SetAfterCommit(crashing, func() { panic("crash after commit") })
	ctx := context.Background()
	f.publish("order-103-ack", `{"order_id":103}`, nil)

	m := f.fetch(5 * time.Second)
	crashed := make(chan any)
	go func() {
		defer func() { crashed <- recover() }()
		_, _ = crashing.Process(ctx, m, apply)
	}()
	if r := <-crashed; r != "crash after commit" {
		t.Fatalf("recovered %v", r)
	}
	f.requireEffects(1, 1)

	restarted := f.newInbox(newPool(t, f.dbURL), nil)
	again := f.fetch(5 * time.Second)
	if md, _ := again.Metadata(); md.NumDelivered != 2 {
		t.Errorf("redelivery has NumDelivered %d", md.NumDelivered)
	}
	out, err := restarted.Process(ctx, again, apply)
	expect(t, "redelivery after the crash", out, inbox.Duplicate, err)
	f.requireEffects(1, 1)
	f.requireSettled()
}

// TestForgedDuplicate: the same Nats-Msg-Id with a different payload is
// terminated, reported, and never applied.
func TestForgedDuplicate(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond, ackWait: time.Second})
	var rejections []inbox.Rejection
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.OnReject = func(r inbox.Rejection) { rejections = append(rejections, r) }
	})
	ctx := context.Background()
	f.publish("order-103-ack", `{"order_id":103,"total":"29.00"}`, nil)
	out, err := in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "original", out, inbox.Applied, err)
	f.publishStored("order-103-ack", `{"order_id":103,"total":"0.01"}`, nil)
	out, err = in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "forged", out, inbox.Rejected, err)
	if err == nil || !strings.Contains(err.Error(), "different payload") {
		t.Errorf("error %v", err)
	}
	if len(rejections) != 1 || rejections[0].Reason != "payload_mismatch" || rejections[0].MsgID != "order-103-ack" {
		t.Errorf("rejections %+v", rejections)
	}
	var data string
	if err := f.pool.QueryRow(ctx, `SELECT string_agg(data, ',') FROM effects`).Scan(&data); err != nil || !strings.Contains(data, "29.00") {
		t.Errorf("effects %q, %v", data, err)
	}
	f.requireEffects(1, 1)
	f.requireSettled()
	// Terminated: not redelivered after AckWait.
	if m, err := f.tryFetch(1500 * time.Millisecond); err == nil {
		t.Errorf("terminated message delivered again: %s", m.Data())
	}
	if s := in.Stats(); s.Rejected != 1 || s.Applied != 1 {
		t.Errorf("stats %+v", s)
	}
}

func TestNoMsgIDRejected(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	var reasons []string
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.OnReject = func(r inbox.Rejection) { reasons = append(reasons, r.Reason) }
	})
	f.publish("", `{"x":1}`, nil)
	out, err := in.Process(context.Background(), f.fetch(5*time.Second), apply)
	expect(t, "no Nats-Msg-Id", out, inbox.Rejected, err)
	if err == nil || !strings.Contains(err.Error(), "Nats-Msg-Id") {
		t.Errorf("error %v", err)
	}
	if fmt.Sprint(reasons) != "[no_msg_id]" {
		t.Errorf("reasons %v", reasons)
	}
	f.requireEffects(0, 0)
	f.requireSettled()
}

// TestHandlerFailureLimit: a handler that always fails is retried with
// backoff up to MaxDeliveries, then terminated; ErrRejected terminates at
// once. Nothing is applied.
func TestHandlerFailureLimit(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	var reasons []string
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.MaxDeliveries = 3
		c.OnReject = func(r inbox.Rejection) { reasons = append(reasons, r.Reason) }
	})
	ctx := context.Background()
	failing := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		if err := apply(ctx, tx, msg); err != nil {
			return err
		}
		if strings.Contains(string(msg.Data()), "invalid") {
			return fmt.Errorf("order has no lines: %w", inbox.ErrRejected)
		}
		return errors.New("payment service down")
	}
	f.publish("order-1-ack", `{"order_id":1}`, nil)
	var outs []inbox.Outcome
	start := time.Now()
	for range 3 {
		out, _ := in.Process(ctx, f.fetch(5*time.Second), failing)
		outs = append(outs, out)
	}
	if fmt.Sprint(outs) != "[retrying retrying rejected]" {
		t.Errorf("outcomes %v", outs)
	}
	// Delays: 10ms doubled per delivery, in the upper half: at least 5+10ms.
	if el := time.Since(start); el < 15*time.Millisecond {
		t.Errorf("three deliveries within %v: no backoff", el)
	}
	f.publish("order-2-ack", `{"order_id":2,"invalid":true}`, nil)
	out, err := in.Process(ctx, f.fetch(5*time.Second), failing)
	expect(t, "ErrRejected", out, inbox.Rejected, err)
	if !errors.Is(err, inbox.ErrRejected) {
		t.Errorf("err %v", err)
	}
	if fmt.Sprint(reasons) != "[max_deliveries rejected]" {
		t.Errorf("reasons %v", reasons)
	}
	f.requireEffects(0, 0)
	f.requireSettled()
}

// TestFence: an operation whose claim generation is lower than the highest
// accepted for its resource is rejected, atomically with the operation.
func TestFence(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	in := f.newInbox(f.pool, nil)
	ctx := context.Background()
	fenced := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		resource := msg.Headers().Get("X-Resource")
		if err := in.FenceMsg(ctx, tx, resource, msg); err != nil {
			return err
		}
		if err := apply(ctx, tx, msg); err != nil {
			return err
		}
		if strings.Contains(string(msg.Data()), "fail") {
			return fmt.Errorf("after fencing: %w", inbox.ErrRejected)
		}
		return nil
	}
	for i, c := range []struct {
		resource, gen, data string
		want                inbox.Outcome
	}{
		{"mailbox-7", "2", `{}`, inbox.Applied},
		{"mailbox-7", "1", `{}`, inbox.Rejected},         // stale
		{"mailbox-7", "2", `{}`, inbox.Applied},          // equal is not stale
		{"mailbox-7", "", `{}`, inbox.Rejected},          // CDC path: generation 0
		{"mailbox-7", "5", `{"fail":1}`, inbox.Rejected}, // fence raised and rolled back with the operation
		{"mailbox-7", "3", `{}`, inbox.Applied},          // so 3 is still fine
		{"mailbox-8", "", `{}`, inbox.Applied},           // another resource
		{"mailbox-7", "x", `{}`, inbox.Rejected},         // malformed header
	} {
		hdr := map[string]string{"X-Resource": c.resource}
		if c.gen != "" {
			hdr["Outbox-Claim-Generation"] = c.gen
		}
		f.publish(fmt.Sprintf("op-%d", i), c.data, hdr)
		out, err := in.Process(ctx, f.fetch(5*time.Second), fenced)
		if out != c.want {
			t.Errorf("op %d (%s gen %q): %v (%v), want %v", i, c.resource, c.gen, out, err, c.want)
		}
		if i == 1 && (!errors.Is(err, inbox.ErrStale) || !strings.Contains(err.Error(), "generation 1 is lower than 2")) {
			t.Errorf("stale op error: %v", err)
		}
	}
	var gen int64
	if err := f.pool.QueryRow(ctx, `SELECT generation FROM inbox_fences WHERE resource = 'mailbox-7'`).Scan(&gen); err != nil || gen != 3 {
		t.Errorf("fence of mailbox-7 at %d (%v), want 3", gen, err)
	}
	f.requireEffects(4, 4)
}

// TestConsumeWrap runs the inbox under Consume with two instances sharing
// the durable consumer, on a stream that holds every message twice.
func TestConsumeWrap(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond})
	const n = 200
	for round := range 2 {
		for i := range n {
			id, data := fmt.Sprintf("order-%d-ack", i), fmt.Sprintf(`{"order_id":%d}`, i)
			if round == 0 {
				if f.publish(id, data, nil) {
					t.Fatalf("first publish of %s stored as a duplicate", id)
				}
			} else {
				f.publishStored(id, data, nil)
			}
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	a := f.newInbox(f.pool, nil)
	b := f.newInbox(newPool(t, f.dbURL), nil)
	for _, in := range []*inbox.Inbox{a, b} {
		cc, err := f.cons.Consume(in.Wrap(ctx, apply))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Stop()
	}
	f.requireSettled()
	f.requireEffects(n, n)
	sa, sb := a.Stats(), b.Stats()
	if sa.Applied+sb.Applied != n || sa.Duplicates+sb.Duplicates != n {
		t.Errorf("stats %+v and %+v: want %d applied and %d duplicates in all", sa, sb, n, n)
	}
}

func TestMigrateAndPrune(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	ctx := context.Background()
	// Concurrent and repeated migrations of a quoted, schema-qualified name.
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if err := inbox.Migrate(ctx, f.pool, `my app.In"box`); err != nil {
				t.Errorf("migrate: %v", err)
			}
		})
	}
	wg.Wait()
	for _, bad := range []string{"", ".x", "a.", "a.b.c"} {
		if err := inbox.Migrate(ctx, f.pool, bad); err == nil {
			t.Errorf("Migrate(%q) accepted", bad)
		}
	}
	if _, err := inbox.New(f.pool, inbox.Config{}); err == nil || !strings.Contains(err.Error(), "Consumer") {
		t.Errorf("New without a consumer: %v", err)
	}

	mine := f.newInbox(f.pool, func(c *inbox.Config) { c.Table = `my app.In"box` })
	other := f.newInbox(f.pool, func(c *inbox.Config) { c.Table = `my app.In"box`; c.Consumer = "shipping" })
	for i := range 4 {
		f.publish(fmt.Sprintf("m-%d", i), `{}`, nil)
		m := f.fetch(5 * time.Second)
		for _, in := range []*inbox.Inbox{mine, other} {
			if out, err := in.Process(ctx, m, apply); out != inbox.Applied {
				t.Fatalf("process: %v %v", out, err)
			}
		}
	}
	if _, err := f.pool.Exec(ctx, `UPDATE "my app"."In""box" SET received_at = received_at - interval '10 days' WHERE message_id IN ('m-0', 'm-1')`); err != nil {
		t.Fatal(err)
	}
	n, err := mine.Prune(ctx, 7*24*time.Hour)
	if err != nil || n != 2 {
		t.Fatalf("Prune: %d, %v; want 2 (only this consumer's old entries)", n, err)
	}
	var left int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM "my app"."In""box"`).Scan(&left); err != nil || left != 6 {
		t.Errorf("%d entries left (%v), want 6", left, err)
	}
	if _, err := mine.Prune(ctx, 0); err == nil {
		t.Error("Prune(0) accepted")
	}
}
