package poller_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/retry"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// orderSink counts, per aggregate, the publishes whose ack has not been
// waited for yet, and records the most ever in flight together. It refuses
// the work IDs in refuse once each, at ack time, without storing them.
type orderSink struct {
	sinks.Sink
	mu       sync.Mutex
	inflight map[string]int
	most     int
	refuse   map[string]bool
}

func newOrderSink(refuse ...string) *orderSink {
	o := &orderSink{inflight: map[string]int{}, refuse: map[string]bool{}}
	for _, id := range refuse {
		o.refuse[id] = true
	}
	return o
}

func (o *orderSink) wrap(s sinks.Sink) sinks.Sink { o.Sink = s; return o }

type orderFuture struct {
	sinks.Future
	o      *orderSink
	agg    string
	refuse bool
}

func (o *orderSink) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	agg := m.Header[wire.HeaderAggregateType][0] + "/" + m.Header[wire.HeaderAggregateID][0]
	o.mu.Lock()
	o.inflight[agg]++
	o.most = max(o.most, o.inflight[agg])
	refuse := o.refuse[m.ID]
	delete(o.refuse, m.ID)
	o.mu.Unlock()
	if refuse {
		return orderFuture{o: o, agg: agg, refuse: true}, nil
	}
	f, err := o.Sink.Publish(ctx, m)
	if err != nil {
		o.done(agg)
		return nil, err
	}
	return orderFuture{Future: f, o: o, agg: agg}, nil
}

func (o *orderSink) done(agg string) {
	o.mu.Lock()
	o.inflight[agg]--
	o.mu.Unlock()
}

func (f orderFuture) Wait(ctx context.Context) (sinks.Ack, error) {
	defer f.o.done(f.agg)
	if f.refuse {
		return sinks.Ack{}, &wire.RejectedError{Reason: "max_msg_size", Err: errors.New("message size exceeds maximum allowed (test)")}
	}
	return f.Future.Wait(ctx)
}

// insertHeld commits rows agg-from..agg-to of aggregate order/agg, with
// those sequences, as the CDC path leaves them behind a blocked aggregate:
// 'scheduled', due, held.
func (f *fixture) insertHeld(agg string, from, to int) {
	f.t.Helper()
	for i := from - 1; i < to; i += 1000 {
		if _, err := f.pool.Exec(context.Background(), `INSERT INTO outbox (work_id, kind, payload, state, available_at, last_error,
				aggregate_type, aggregate_id, aggregate_seq)
			SELECT $1 || '-' || g, 'k', jsonb_build_object('n', g, 'pad', repeat('x', 180)), 'scheduled', clock_timestamp(),
				'held: waiting for ' || $1 || '-1', 'order', $1, g
			FROM generate_series($2::int, $3::int) g`, agg, i+1, min(i+1000, to)); err != nil {
			f.t.Fatal(err)
		}
	}
}

// streamOrder reads the stream and returns, per aggregate, the sequences
// in the order they are stored, and how often each work ID is stored.
func (f *fixture) streamOrder() (order map[string][]int64, counts map[string]int) {
	f.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		f.t.Fatal(err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		f.t.Fatal(err)
	}
	order, counts = map[string][]int64{}, map[string]int{}
	for got := uint64(0); got < info.State.Msgs; {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			f.t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			seq, err := strconv.ParseInt(m.Headers().Get(wire.HeaderSequence), 10, 64)
			if err != nil {
				f.t.Fatalf("%s: %v", m.Headers().Get(wire.HeaderSequence), err)
			}
			agg := m.Headers().Get(wire.HeaderAggregateID)
			order[agg] = append(order[agg], seq)
			counts[m.Headers().Get(jetstream.MsgIDHeader)]++
			n++
		}
		if n == 0 {
			f.t.Fatalf("read %d of %d messages, then nothing", got, info.State.Msgs)
		}
		got += uint64(n)
	}
	return order, counts
}

// wantInOrder checks that the stream holds aggregate agg's sequences
// from..to, each once, in order.
func (f *fixture) wantInOrder(order map[string][]int64, agg string, from, to int) {
	f.t.Helper()
	seqs := order[agg]
	if len(seqs) != to-from+1 {
		f.t.Errorf("aggregate %s: %d messages stored, want %d", agg, len(seqs), to-from+1)
	}
	for i, s := range seqs {
		if s != int64(from+i) {
			f.t.Fatalf("aggregate %s: message %d of the stream carries sequence %d, want %d (stored: %v...)", agg, i+1, s, from+i, seqs[:min(len(seqs), i+5)])
		}
	}
}

// G12, a released aggregate drains at the batch's rate: rows held behind a
// dead-lettered row are published, once the operator cancels it, a run per
// claim in sequence order, not one row per poll. The poll interval is an
// hour and every idle poll is counted: the 2,000 rows must drain in a few
// claims without waiting for a poll (one row per poll, as before, would
// take 2,000 polls). Two aggregates drain side by side, each with one
// publish in flight at a time.
func TestReleasedAggregateDrainsInRuns(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	const n = 2000
	for _, agg := range []string{"a", "b"} {
		if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, aggregate_type, aggregate_id, aggregate_seq)
			VALUES ($1 || '-1', 'k', '{}', 'failed', 10, 'rejected: max_msg_size: too big', 'order', $1, 1)`, agg); err != nil {
			t.Fatal(err)
		}
		f.insertHeld(agg, 2, n+1)
	}
	var idle atomic.Int64
	cfg := poller.Config{PollInterval: time.Hour, Ordered: true, Lease: time.Minute,
		Sleep: func(ctx context.Context, d time.Duration) error {
			idle.Add(1)
			return retry.Sleep(ctx, 20*time.Millisecond)
		}}.WithDefaults()
	sink := newOrderSink()
	p, m := f.pollerWithSink("w", cfg, sink.wrap)
	stop := run(t, p)
	// Blocked: nothing of either aggregate is claimed.
	time.Sleep(200 * time.Millisecond)
	if c := counter(t, m.Claims); c != 0 {
		t.Fatalf("%v rows claimed behind a dead letter", c)
	}
	st := store.New(f.pool, table, store.PolicyMark)
	res, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"a-1", "b-1"}}, By: "test", Reason: "drop the bad one"})
	if err != nil || len(res.Changed) != 2 {
		t.Fatalf("cancel: %+v, %v", res, err)
	}
	before := idle.Load()
	start := time.Now()
	for counter(t, m.Published.WithLabelValues("poller", "ok")) < 2*n {
		if time.Since(start) > 2*time.Minute {
			t.Fatalf("%v of %d rows published after 2 minutes, %d idle polls", counter(t, m.Published.WithLabelValues("poller", "ok")), 2*n, idle.Load()-before)
		}
		time.Sleep(10 * time.Millisecond)
	}
	elapsed := time.Since(start)
	f.waitPublished(2 * n)
	stop()
	t.Logf("%d rows of two released aggregates drained in %v (%.0f rows/s), %d idle polls", 2*n, elapsed, 2*n/elapsed.Seconds(), idle.Load()-before)
	// The last claim finds nothing and sleeps once; at the batch of 500,
	// 4,000 rows need 8 claims, none of which waits for a poll.
	if idle.Load()-before > 3 {
		t.Errorf("%d idle polls while draining, want at most 3: the drain waits for polls", idle.Load()-before)
	}
	if sink.most != 1 {
		t.Errorf("%d publishes of one aggregate in flight together, want 1", sink.most)
	}
	if bad, err := f.count(`state = 'published' AND attempts <> 1`); err != nil || bad != 0 {
		t.Errorf("%d published rows with other than one attempt (err %v)", bad, err)
	}
	order, counts := f.streamOrder()
	f.wantInOrder(order, "a", 2, n+1)
	f.wantInOrder(order, "b", 2, n+1)
	for id, c := range counts {
		if c != 1 {
			t.Errorf("%s stored %d times", id, c)
		}
	}
}

// A run stops at its first failure: with x3 refused at ack time, x1 and x2
// are published, x3 is rescheduled with its attempt and the reason, and
// x4..x6 are given back without an attempt, held behind x3, never
// published ahead of it. The next claims publish x3..x6 in order.
func TestRunStopsAtTheFirstFailure(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	f.insertHeld("x", 1, 6)
	// The run is claimed and refused before the first retry is due.
	cfg := poller.Config{PollInterval: 20 * time.Millisecond, Ordered: true, Lease: time.Minute,
		BackoffMin: 2 * time.Second, BackoffMax: 2 * time.Second, Rand: func(n int64) int64 { return n - 1 }}.WithDefaults()
	sink := newOrderSink("x-3")
	p, _ := f.pollerWithSink("w", cfg, sink.wrap)
	if n, err := p.Poll(ctx); err != nil || n != 6 {
		t.Fatalf("poll: %d rows, %v; want the run of 6", n, err)
	}
	rows, err := f.pool.Query(ctx, `SELECT work_id, state, attempts, coalesce(last_error, '') FROM outbox ORDER BY aggregate_seq`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		state    string
		attempts int
		lastErr  string
	}
	got := map[string]row{}
	for rows.Next() {
		var id string
		var r row
		if err := rows.Scan(&id, &r.state, &r.attempts, &r.lastErr); err != nil {
			t.Fatal(err)
		}
		got[id] = r
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 6; i++ {
		id := fmt.Sprintf("x-%d", i)
		r := got[id]
		switch {
		case i < 3:
			if r.state != "published" || r.attempts != 1 {
				t.Errorf("%s: %+v, want published after 1 attempt", id, r)
			}
		case i == 3:
			if r.state != "scheduled" || r.attempts != 1 || r.lastErr != "rejected: max_msg_size: message size exceeds maximum allowed (test)" {
				t.Errorf("%s: %+v, want scheduled, 1 attempt, the refusal", id, r)
			}
		default:
			if r.state != "scheduled" || r.attempts != 0 || r.lastErr != `held: waiting for x-3 (an earlier row of aggregate "order"/"x")` {
				t.Errorf("%s: %+v, want scheduled, no attempt, held behind x-3", id, r)
			}
		}
	}
	stop := run(t, p)
	f.waitPublished(6)
	stop()
	order, counts := f.streamOrder()
	f.wantInOrder(order, "x", 1, 6)
	if len(counts) != 6 || sink.most != 1 {
		t.Errorf("%d messages stored, at most %d in flight together; want 6 and 1", len(counts), sink.most)
	}
}

// Two workers and two batches in flight each: an aggregate's rows are in
// one claim at a time, so its sequences reach the stream in order.
func TestRunsWithSeveralWorkersStayInOrder(t *testing.T) {
	f := newFixture(t)
	const aggs, n = 6, 150
	for a := range aggs {
		f.insertHeld(strconv.Itoa(a), 1, n)
	}
	cfg := poller.Config{PollInterval: 10 * time.Millisecond, Ordered: true, Lease: time.Minute, Batch: 40, Pipeline: 2}.WithDefaults()
	sink1, sink2 := newOrderSink(), newOrderSink()
	p1, _ := f.pollerWithSink("w1", cfg, sink1.wrap)
	p2, _ := f.pollerWithSink("w2", cfg, sink2.wrap)
	stop := run(t, p1, p2)
	f.waitPublished(aggs * n)
	stop()
	order, counts := f.streamOrder()
	for a := range aggs {
		f.wantInOrder(order, strconv.Itoa(a), 1, n)
	}
	if len(counts) != aggs*n {
		t.Errorf("%d distinct messages, want %d", len(counts), aggs*n)
	}
	if bad, err := f.count(`attempts <> 1`); err != nil || bad != 0 {
		t.Errorf("%d rows with other than one attempt (err %v): an aggregate's rows were claimed twice", bad, err)
	}
}
