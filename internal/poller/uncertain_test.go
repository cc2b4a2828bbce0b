package poller_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// G18: a row whose last attempt was uncertain is looked up in the stream
// before the poller publishes it again, past a duplicate window of 1 s:
// "in" (rescheduled after an uncertain attempt) and "redriven" (a dead
// letter redriven through the store, as the console does) are in the
// stream already and are settled as published with the sequence found, not
// sent again; "out" is not in it and is published, once.
func TestPollerResolvesUncertainFromStream(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.shortDuplicateWindow(t)
	// The earlier, uncertain attempts that did reach the broker.
	stored := map[string]uint64{}
	for _, id := range []string{"in", "redriven"} {
		m := nats.NewMsg(f.prefix + "k")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = []byte(`{}`)
		ack, err := f.js.PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		stored[id] = ack.Sequence
	}
	time.Sleep(1500 * time.Millisecond) // past the duplicate window: a republish would be stored again
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, available_at) VALUES
		('in', 'k', '{}', 'scheduled', 1, 'uncertain: no ack in time', clock_timestamp() - interval '1 second'),
		('out', 'k', '{}', 'scheduled', 1, 'uncertain: no ack in time', clock_timestamp() - interval '1 second'),
		('redriven', 'k', '{}', 'failed', 10, 'uncertain: lease expired after 10 attempts', clock_timestamp() - interval '2 seconds')`); err != nil {
		t.Fatal(err)
	}
	if _, err := store.New(f.pool, table, store.PolicyMark).Redrive(ctx, store.OpRequest{
		Selection: store.Selection{WorkIDs: []string{"redriven"}}, By: "t", Reason: "test"}); err != nil {
		t.Fatal(err)
	}
	p, m := f.poller("w1", poller.Config{}.WithDefaults())
	pollOnce(t, p)

	if n := streamMsgs(t, f.js, f.stream); n != 3 {
		t.Errorf("stream holds %d messages, want 3 (in and redriven once each, out published once)", n)
	}
	for _, id := range []string{"in", "redriven"} {
		r := f.row(id)
		if r.state != "published" || uint64(r.streamSeq) != stored[id] || r.streamName != f.stream || !strings.HasPrefix(r.lastError, "found:") {
			t.Errorf("%s: %+v, want published at the found sequence %d with a found note", id, r, stored[id])
		}
	}
	if r := f.row("out"); r.state != "published" || r.streamSeq != 3 {
		t.Errorf("out: %+v, want published at sequence 3", r)
	}
	if got := counter(t, m.UncertainResolved.WithLabelValues("found")); got != 2 {
		t.Errorf("found %v, want 2", got)
	}
	if got := counter(t, m.UncertainResolved.WithLabelValues("not_found")); got != 1 {
		t.Errorf("not_found %v, want 1", got)
	}
}

// G19 with G18: a row handed back because the broker lost it is looked up
// before the poller publishes it again. The replay of the session start
// that found the loss may have stored it already (the CDC path publishes
// what it replays whatever the row's state); past a duplicate window of
// 1 s a republish would store it twice (the chaos run's nats-lose-tail
// found 781 such repeats with a 2 s window).
func TestPollerLooksUpRowsHandedBackAsLost(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.shortDuplicateWindow(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, available_at) VALUES
		('replayed', 'k', '{}', 'scheduled', 0, 'lost: broker acknowledged seq 9 in stream X but the stream ends at 4', clock_timestamp()),
		('notreplayed', 'k', '{}', 'scheduled', 0, 'lost: broker acknowledged seq 10 in stream X but the stream ends at 4', clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	// The CDC replay's copy, stored after the hand-back.
	m := nats.NewMsg(f.prefix + "k")
	m.Header.Set(jetstream.MsgIDHeader, "replayed")
	m.Data = []byte(`{}`)
	ack, err := f.js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // past the duplicate window
	p, met := f.poller("w1", poller.Config{}.WithDefaults())
	pollOnce(t, p)

	if n := streamMsgs(t, f.js, f.stream); n != 2 {
		t.Errorf("stream holds %d messages, want 2 (replayed once, notreplayed published once)", n)
	}
	if r := f.row("replayed"); r.state != "published" || uint64(r.streamSeq) != ack.Sequence || !strings.HasPrefix(r.lastError, "found:") {
		t.Errorf("replayed: %+v, want published at the found sequence %d with a found note", r, ack.Sequence)
	}
	if r := f.row("notreplayed"); r.state != "published" || r.streamSeq != 2 {
		t.Errorf("notreplayed: %+v, want published at sequence 2", r)
	}
	if got := counter(t, met.UncertainResolved.WithLabelValues("found")); got != 1 {
		t.Errorf("found %v, want 1", got)
	}
}

// shortDuplicateWindow sets the fixture's stream's duplicate window to 1 s,
// so that a test can outlast it and see what the relay's lookups do
// without the broker's deduplication.
func (f *fixture) shortDuplicateWindow(t *testing.T) {
	t.Helper()
	ctx := context.Background()
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Duplicates = time.Second
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// A lookup that fails publishes nothing of the batch (G18): the uncertain
// row the broker did store, past a 1 s window, would be stored twice. The
// claims go back without counting an attempt and keep their notes; once
// the lookup works, the stored row is settled from the stream and the
// plain row beside it published, each once.
func TestPollerGivesBackWhatItCouldNotLookUp(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.shortDuplicateWindow(t)
	m := nats.NewMsg(f.prefix + "k")
	m.Header.Set(jetstream.MsgIDHeader, "in")
	m.Data = []byte(`{}`)
	if _, err := f.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond) // past the duplicate window
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, available_at) VALUES
		('in', 'k', '{}', 'scheduled', 1, 'uncertain: no ack in time', clock_timestamp() - interval '1 second'),
		('plain', 'k', '{}', 'scheduled', 1, 'rejected: x', clock_timestamp() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	failing.Store(true)
	p, met := f.pollerWithSink("w1", poller.Config{}.WithDefaults(), func(s sinks.Sink) sinks.Sink {
		return failingFinder{Sink: s, finder: s.(sinks.Finder), failing: &failing}
	})
	pollOnce(t, p)
	if n := streamMsgs(t, f.js, f.stream); n != 1 {
		t.Fatalf("stream holds %d messages after the failed lookup, want 1: the batch was published", n)
	}
	for id, note := range map[string]string{"in": "uncertain: no ack in time", "plain": "rejected: x"} {
		var state, lastError string
		var attempts int
		if err := f.pool.QueryRow(ctx, `SELECT state, attempts, last_error FROM outbox WHERE work_id = $1`, id).Scan(&state, &attempts, &lastError); err != nil {
			t.Fatal(err)
		}
		if state != "scheduled" || attempts != 1 || lastError != note {
			t.Errorf("%s: %s, %d attempts, %q; want scheduled, 1 attempt, %q (given back as it was)", id, state, attempts, lastError, note)
		}
	}
	if got := counter(t, met.UncertainResolved.WithLabelValues("lookup_failed")); got != 1 {
		t.Errorf("lookup_failed %v, want 1", got)
	}

	failing.Store(false)
	pollOnce(t, p)
	if n := streamMsgs(t, f.js, f.stream); n != 2 {
		t.Fatalf("stream holds %d messages, want 2 (in once, plain once)", n)
	}
	if r := f.row("in"); r.state != "published" || !strings.HasPrefix(r.lastError, "found:") {
		t.Errorf("in: %+v, want published with a found note", r)
	}
	if r := f.row("plain"); r.state != "published" {
		t.Errorf("plain: %+v, want published", r)
	}
}

// failingFinder is a sink whose stream lookup fails while failing is set.
type failingFinder struct {
	sinks.Sink
	finder  sinks.Finder
	failing *atomic.Bool
}

func (f failingFinder) FindStored(ctx context.Context, want []sinks.Wanted, from sinks.From, limit int) (map[string]sinks.Stored, bool, error) {
	if f.failing.Load() {
		return nil, false, errors.New("find stored messages: test failure")
	}
	return f.finder.FindStored(ctx, want, from, limit)
}

// G18, item 3 of issue 41: a worker killed after the broker stored its
// batch leaves the rows running; reclaimed after the lease, past the
// duplicate window, they were published again without a lookup (200 of 200
// stored twice in the run): only last_error prefixes marked a row
// uncertain. A claim now records the stream's position, and a reclaim
// looks the rows up from there before it publishes anything.
func TestReclaimPastTheWindowLooksUpFirst(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.shortDuplicateWindow(t)
	f.insertDue(20)
	// What worker a did before it was killed: claimed the batch (recording
	// where the stream stood), published it, and the broker stored every
	// message; its completion never ran.
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	seq, ok := sink.StreamPosition(ctx, 0)
	if !ok {
		t.Fatal("no stream position")
	}
	st := store.New(f.pool, table, store.PolicyMark)
	claimed, err := st.Claim(ctx, "a", time.Minute, 20, store.ClaimOptions{StreamSeq: seq, HasStreamSeq: true})
	if err != nil || len(claimed) != 20 {
		t.Fatalf("a's claim: %d rows, %v", len(claimed), err)
	}
	for _, c := range claimed {
		msg, err := poller.Message(c, wire.Format{SubjectPrefix: f.prefix}, map[string]string{})
		if err != nil {
			t.Fatal(err)
		}
		fut, err := sink.Publish(ctx, msg)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fut.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := f.count(`state = 'running' AND claimed_by = 'a' AND lookup_seq IS NOT NULL`); err != nil || n != 20 {
		t.Fatalf("%d rows running under a's claim with a lookup position (err %v), want 20", n, err)
	}
	// a's leases run out, and the window passes.
	if _, err := f.pool.Exec(ctx, `UPDATE outbox SET lease_until = clock_timestamp() - interval '1 millisecond' WHERE claimed_by = 'a'`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1500 * time.Millisecond)
	b, bm := f.poller("b", poller.Config{Batch: 20}.WithDefaults())
	pollOnce(t, b)

	if n := streamMsgs(t, f.js, f.stream); n != 20 {
		t.Errorf("stream holds %d messages, want 20: the reclaim published a's stored rows again", n)
	}
	if n, err := f.count(`state = 'published' AND claim_generation = 2 AND last_error LIKE 'found:%'`); err != nil || n != 20 {
		t.Errorf("%d rows settled from the stream by b's reclaim (err %v), want 20", n, err)
	}
	if got := counter(t, bm.UncertainResolved.WithLabelValues("found")); got != 20 {
		t.Errorf("found %v, want 20", got)
	}
}

// An uncertain row on a subject that carries steady traffic (50 messages
// a second here, after a backlog on it). The lookup started at its
// available_at less --backoff-max, the lease and 5 s, and gave up at its
// limit: at about 30 messages a second on a subject it was always
// inconclusive, and the row was published again (5 of 5 stored twice in
// the run). It now starts at the position its claim recorded.
func TestUncertainRowOnABusySubjectIsFound(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	f.shortDuplicateWindow(t)
	subject := f.prefix + "k"
	publish := func(id string) uint64 {
		m := nats.NewMsg(subject)
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = []byte(`{}`)
		ack, err := f.js.PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		return ack.Sequence
	}
	for i := range 3000 {
		publish(fmt.Sprintf("backlog-%d", i))
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
				publish(fmt.Sprintf("traffic-%d", i))
			}
		}
	}()
	defer func() { close(stop); <-done }()
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at) VALUES ('u', 'k', '{}', 'scheduled', clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	// A worker's claim and publish whose ack never came: the claim records
	// the stream's position, the message is stored, the row rescheduled
	// as uncertain.
	st := store.New(f.pool, table, store.PolicyMark)
	last, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := last.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	claimed, err := st.Claim(ctx, "dead", time.Minute, 1, store.ClaimOptions{StreamSeq: info.State.LastSeq, HasStreamSeq: true})
	if err != nil || len(claimed) != 1 {
		t.Fatalf("claim: %v, %v", claimed, err)
	}
	seq := publish("u")
	if ok, err := st.Reschedule(ctx, "u", "dead", claimed[0].ClaimGeneration, 0, "uncertain: no ack in time"); err != nil || !ok {
		t.Fatalf("reschedule: %v, %v", ok, err)
	}
	time.Sleep(1500 * time.Millisecond) // past the window, with traffic behind the row
	p, m := f.poller("w1", poller.Config{LookupLimit: 1000, BackoffMax: 5 * time.Minute}.WithDefaults())
	pollOnce(t, p)

	if r := f.row("u"); r.state != "published" || uint64(r.streamSeq) != seq || !strings.HasPrefix(r.lastError, "found:") {
		t.Errorf("u: %+v, want published at the found sequence %d with a found note", r, seq)
	}
	if got := counter(t, m.UncertainResolved.WithLabelValues("found")); got != 1 {
		t.Errorf("found %v, want 1", got)
	}
}
