package poller_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// gatedSink publishes at once (the message reaches the broker) but holds
// every ack until open is closed, so a test decides how long batches stay
// in flight. Every published work ID is sent on published.
type gatedSink struct {
	sinks.Sink
	open      chan struct{}
	published chan string
}

type gatedFuture struct {
	sinks.Future
	open chan struct{}
}

func newGate(buffer int) *gatedSink {
	return &gatedSink{open: make(chan struct{}), published: make(chan string, buffer)}
}

func (g *gatedSink) wrap(s sinks.Sink) sinks.Sink { g.Sink = s; return g }

func (g *gatedSink) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	f, err := g.Sink.Publish(ctx, m)
	if err != nil {
		return nil, err
	}
	g.published <- m.ID
	return gatedFuture{f, g.open}, nil
}

func (f gatedFuture) Wait(ctx context.Context) (sinks.Ack, error) {
	select {
	case <-f.open:
	case <-ctx.Done():
		return sinks.Ack{}, ctx.Err()
	}
	return f.Future.Wait(ctx)
}

// next returns the next n work IDs published through g.
func (g *gatedSink) next(t *testing.T, n int) []string {
	t.Helper()
	var ids []string
	for len(ids) < n {
		select {
		case id := <-g.published:
			ids = append(ids, id)
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of %d publishes seen after 30s: %v", len(ids), n, ids)
		}
	}
	slices.Sort(ids)
	return ids
}

// start runs p until the returned stop is called; stop returns Run's
// result. done is closed when Run returns.
func start(p *poller.Poller) (stop func() error, done <-chan struct{}) {
	ctx, cancel := context.WithCancel(context.Background())
	ch := make(chan struct{})
	var err error
	go func() { err = p.Run(ctx); close(ch) }()
	return func() error { cancel(); <-ch; return err }, ch
}

// insertDue inserts scheduled rows w01..wNN, due in that order.
func (f *fixture) insertDue(n int) {
	f.t.Helper()
	if _, err := f.pool.Exec(context.Background(), `INSERT INTO outbox (work_id, kind, payload, state, available_at)
		SELECT 'w' || lpad(g::text, 2, '0'), 'k', jsonb_build_object('n', g), 'scheduled',
		       clock_timestamp() - interval '1 hour' + g * interval '1 second'
		FROM generate_series(1, $1) g`, n); err != nil {
		f.t.Fatal(err)
	}
}

func ids(from, to int) []string {
	var out []string
	for i := from; i <= to; i++ {
		out = append(out, fmt.Sprintf("w%02d", i))
	}
	return out
}

// pipelined is a config that keeps two batches of five rows in flight; the
// lease is long enough that no renewal runs during a test.
var pipelined = poller.Config{
	Lease: 10 * time.Minute, PollInterval: 10 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: time.Millisecond,
	MaxAttempts: 5, Batch: 5, Pipeline: 2,
}

// With two batches in flight, the first batch's claims are lost (their
// leases expire, worker b reclaims and completes those rows at generation
// 2). When a's acks finally arrive, its completion of the first batch
// matches nothing and is counted stale; its second batch completes as
// usual. a's claim of the second batch, made while the first was in flight,
// does not shield the first.
func TestLeaseLostWithTwoBatchesInFlight(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	f.insertDue(10)
	gate := newGate(100)
	a, am := f.pollerWithSink("a", pipelined, gate.wrap)
	b, bm := f.poller("b", pipelined)
	stopA, _ := start(a)
	if got := gate.next(t, 10); !slices.Equal(got, ids(1, 10)) {
		t.Fatalf("a published %v with its acks held, want both batches %v", got, ids(1, 10))
	}
	if n, err := f.count(`state = 'running' AND claimed_by = 'a' AND claim_generation = 1`); err != nil || n != 10 {
		t.Fatalf("%d rows held by a (err %v), want 10", n, err)
	}
	// The first batch's leases run out, as they would if a stalled.
	if _, err := f.pool.Exec(ctx, `UPDATE outbox SET lease_until = clock_timestamp() - interval '1 millisecond'
		WHERE work_id <= 'w05' AND claimed_by = 'a'`); err != nil {
		t.Fatal(err)
	}
	if n, err := b.Poll(ctx); err != nil || n != 5 {
		t.Fatalf("b reclaimed %d rows (err %v), want the first batch's 5", n, err)
	}
	var beforeRelease time.Time
	if err := f.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&beforeRelease); err != nil {
		t.Fatal(err)
	}
	close(gate.open)
	f.waitPublished(10)
	if err := stopA(); err != nil {
		t.Fatalf("a's Run: %v", err)
	}

	if n, err := f.count(`work_id <= 'w05' AND state = 'published' AND claim_generation = 2 AND attempts = 2
		AND published_at < '` + beforeRelease.Format(time.RFC3339Nano) + `'`); err != nil || n != 5 {
		t.Errorf("%d of the first batch published by b's claim before a's acks (err %v), want 5", n, err)
	}
	if n, err := f.count(`work_id > 'w05' AND state = 'published' AND claim_generation = 1 AND attempts = 1`); err != nil || n != 5 {
		t.Errorf("%d of the second batch published by a's claim (err %v), want 5", n, err)
	}
	if n := counter(t, am.StaleCompletions.WithLabelValues("complete")); n != 5 {
		t.Errorf("a's stale completions: %v, want 5 (the first batch)", n)
	}
	// a's publishes were stored: b's reclaim looks them up (G18) and
	// settles them from the stream instead of publishing them again.
	if n := counter(t, bm.UncertainResolved.WithLabelValues("found")); n != 5 {
		t.Errorf("b found %v of a's publishes in the stream, want 5", n)
	}
	if n := counter(t, bm.Published.WithLabelValues("poller", "duplicate")); n != 0 {
		t.Errorf("b's duplicates: %v, want 0 (it looked a's publishes up instead of sending them again)", n)
	}
	f.wantStreamMsgs(10)
}

// Stopping the poller with two batches in flight finishes both (their acks
// are recorded) and claims nothing more: every row ends published or still
// claimable, none is left running.
func TestStopWithTwoBatchesInFlight(t *testing.T) {
	f := newFixture(t)
	f.insertDue(15)
	gate := newGate(100)
	a, am := f.pollerWithSink("a", pipelined, gate.wrap)
	stopA, done := start(a)
	if got := gate.next(t, 10); !slices.Equal(got, ids(1, 10)) {
		t.Fatalf("published %v with the acks held, want two batches %v", got, ids(1, 10))
	}
	stopped := make(chan error, 1)
	go func() { stopped <- stopA() }()
	select {
	case <-done:
		t.Fatal("Run returned while its two batches waited for their acks")
	default:
	}
	close(gate.open)
	if err := <-stopped; err != nil {
		t.Fatalf("Run: %v", err)
	}

	if n, err := f.count(`work_id <= 'w10' AND state = 'published' AND claim_generation = 1 AND stream_seq IS NOT NULL`); err != nil || n != 10 {
		t.Errorf("%d of the two batches in flight published (err %v), want 10", n, err)
	}
	if n, err := f.count(`work_id > 'w10' AND state = 'scheduled' AND attempts = 0 AND claim_generation = 0`); err != nil || n != 5 {
		t.Errorf("%d rows left claimable and untouched (err %v), want 5", n, err)
	}
	if n, err := f.count(`state = 'running' OR claimed_by IS NOT NULL OR lease_until IS NOT NULL`); err != nil || n != 0 {
		t.Errorf("%d rows left with a claim (err %v), want 0", n, err)
	}
	if n := counter(t, am.Claims); n != 10 {
		t.Errorf("claims: %v, want 10 (none after the stop)", n)
	}
	f.wantStreamMsgs(10)
}

// A worker that dies with two batches in flight loses nothing: once the
// leases run out another worker reclaims every row, finds the dead
// worker's publishes in the stream (G18: a reclaim is looked up, never
// published blind) and completes them. Should the first worker come back
// to life and receive its acks, none of its completions matches.
func TestDeadWorkerWithTwoBatchesInFlight(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	f.insertDue(10)
	gate := newGate(100)
	a, am := f.pollerWithSink("a", pipelined, gate.wrap)
	b, bm := f.poller("b", pipelined)
	stopA, _ := start(a)
	gate.next(t, 10)
	// What a kill leaves: rows running under a's leases, which run out.
	if _, err := f.pool.Exec(ctx, `UPDATE outbox SET lease_until = clock_timestamp() - interval '1 millisecond' WHERE claimed_by = 'a'`); err != nil {
		t.Fatal(err)
	}
	stopB := run(t, b)
	f.waitPublished(10)
	stopB()
	close(gate.open)
	if err := stopA(); err != nil {
		t.Fatalf("a's Run: %v", err)
	}

	if n, err := f.count(`state = 'published' AND claim_generation = 2 AND attempts = 2 AND stream_seq IS NOT NULL AND last_error LIKE 'found:%'`); err != nil || n != 10 {
		t.Errorf("%d rows settled by b's reclaim from the stream (err %v), want 10", n, err)
	}
	if n := counter(t, am.StaleCompletions.WithLabelValues("complete")); n != 10 {
		t.Errorf("a's stale completions: %v, want 10", n)
	}
	if n := counter(t, bm.UncertainResolved.WithLabelValues("found")); n != 10 {
		t.Errorf("b found %v of a's publishes in the stream, want 10", n)
	}
	if n := counter(t, bm.Published.WithLabelValues("poller", "duplicate")); n != 0 {
		t.Errorf("b's duplicates: %v, want 0 (it looked a's publishes up instead of sending them again)", n)
	}
	f.wantStreamMsgs(10)
}

// Pipelining keeps the order per aggregate (G12): while the first row of an
// aggregate is in flight, the next claim skips the aggregate's later rows
// and takes another aggregate's first row instead.
func TestOrderedClaimsWithBatchesInFlight(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('x1', 'k', '{}', 'scheduled', clock_timestamp() - interval '3 minutes', 'order', 'x', 1),
		('x2', 'k', '{}', 'scheduled', clock_timestamp() - interval '2 minutes', 'order', 'x', 2),
		('y1', 'k', '{}', 'scheduled', clock_timestamp() - interval '1 minute', 'order', 'y', 1)`); err != nil {
		t.Fatal(err)
	}
	cfg := pipelined
	cfg.Batch, cfg.Ordered = 1, true
	gate := newGate(100)
	a, _ := f.pollerWithSink("a", cfg, gate.wrap)
	stopA, _ := start(a)
	if got := gate.next(t, 2); !slices.Equal(got, []string{"x1", "y1"}) {
		t.Fatalf("in flight together: %v, want [x1 y1] (x2 waits behind x1)", got)
	}
	close(gate.open)
	if got := gate.next(t, 1); got[0] != "x2" {
		t.Fatalf("third publish %v, want x2", got)
	}
	f.waitPublished(3)
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	var x1, x2 int64
	if err := f.pool.QueryRow(ctx, `SELECT (SELECT stream_seq FROM outbox WHERE work_id = 'x1'), (SELECT stream_seq FROM outbox WHERE work_id = 'x2')`).Scan(&x1, &x2); err != nil {
		t.Fatal(err)
	}
	if x1 >= x2 {
		t.Errorf("x1 at stream sequence %d, x2 at %d: want x1 first", x1, x2)
	}
}

// waitPublished waits until n rows are published.
func (f *fixture) waitPublished(n int) {
	f.t.Helper()
	testenv.WaitFor(f.t, time.Minute, fmt.Sprintf("%d rows published", n), func() (bool, error) {
		got, err := f.count(`state = 'published'`)
		return got == n, err
	})
}

// wantStreamMsgs checks that the stream holds n messages: every repeat was
// dropped by its Nats-Msg-Id.
func (f *fixture) wantStreamMsgs(n uint64) {
	f.t.Helper()
	s, err := f.js.Stream(context.Background(), f.stream)
	if err != nil {
		f.t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		f.t.Fatal(err)
	}
	if info.State.Msgs != n {
		f.t.Errorf("stream holds %d messages, want %d", info.State.Msgs, n)
	}
}

// Both batches in flight keep their leases while their acks take several
// leases: a second worker polling all along claims nothing, and every row
// is completed by its first claim.
func TestLeasesRenewedForEveryBatchInFlight(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	f.insertDue(2)
	cfg := poller.Config{Lease: 600 * time.Millisecond, PollInterval: 10 * time.Millisecond, BackoffMin: time.Millisecond,
		BackoffMax: time.Millisecond, MaxAttempts: 5, Batch: 1, Pipeline: 2}
	gate := newGate(10)
	a, am := f.pollerWithSink("a", cfg, func(s sinks.Sink) sinks.Sink { return gate.wrap(slow(2 * time.Second)(s)) })
	close(gate.open) // the slow sink alone holds the acks; the gate only reports publishes
	b, bm := f.poller("b", cfg)
	stopA, _ := start(a)
	if got := gate.next(t, 2); !slices.Equal(got, ids(1, 2)) {
		t.Fatalf("in flight: %v, want %v", got, ids(1, 2))
	}
	stolen := 0
	testenv.WaitFor(t, time.Minute, "both rows published", func() (bool, error) {
		n, err := b.Poll(ctx)
		stolen += n
		if err != nil {
			return false, err
		}
		done, err := f.count(`state = 'published'`)
		return done == 2, err
	})
	if err := stopA(); err != nil {
		t.Fatal(err)
	}
	if n, err := f.count(`state = 'published' AND claim_generation = 1 AND attempts = 1`); err != nil || n != 2 || stolen != 0 {
		t.Errorf("%d rows published by their first claim (err %v), %d claims by b; want 2 and 0", n, err, stolen)
	}
	// Each batch renews its own lease: without a renewal, a 600ms lease
	// would have run out during a 2s wait for the ack.
	if r := counter(t, am.LeaseRenewals); r < 2 || counter(t, bm.Claims) != 0 {
		t.Errorf("renewals %v, want at least one per batch; claims by b %v", r, counter(t, bm.Claims))
	}
}
