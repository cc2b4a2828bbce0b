package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

func aggHeaders(typ, id string, seq int) map[string]string {
	return map[string]string{wire.HeaderAggregateType: typ, wire.HeaderAggregateID: id, wire.HeaderSequence: strconv.Itoa(seq)}
}

// createHistory makes the effect tables of the ordering tests: history has
// one row per application, numbered in the order the inserts ran, which
// for one aggregate is its commit order, since the position row stays
// locked until the commit; projection has one row per aggregate.
func (f *fixture) createHistory() {
	f.t.Helper()
	if _, err := f.pool.Exec(context.Background(), `CREATE TABLE history (
		applied_order bigserial PRIMARY KEY, aggregate text NOT NULL, seq bigint NOT NULL, msg_id text NOT NULL);
		CREATE TABLE projection (aggregate text PRIMARY KEY, seq bigint NOT NULL)`); err != nil {
		f.t.Fatal(err)
	}
}

// record is the ordering tests' handler: it appends to history and sets the
// projection to the message's sequence without looking at the old one, so
// any stale write the inbox let through would show.
func record(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
	a, ok, err := inbox.AggregateOf(msg)
	if err != nil || !ok {
		return fmt.Errorf("handler got a message without a valid aggregate (%v): %w", err, inbox.ErrRejected)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO history (aggregate, seq, msg_id) VALUES ($1, $2, $3)`, a.String(), a.Seq, msg.Headers().Get(jetstream.MsgIDHeader)); err != nil {
		return err
	}
	_, err = tx.Exec(ctx, `INSERT INTO projection (aggregate, seq) VALUES ($1, $2) ON CONFLICT (aggregate) DO UPDATE SET seq = EXCLUDED.seq`, a.String(), a.Seq)
	return err
}

// historyOf returns each aggregate's applied sequences in application order.
func (f *fixture) historyOf() map[string][]int64 {
	f.t.Helper()
	rows, err := f.pool.Query(context.Background(), `SELECT aggregate, seq FROM history ORDER BY applied_order`)
	if err != nil {
		f.t.Fatal(err)
	}
	defer rows.Close()
	h := map[string][]int64{}
	for rows.Next() {
		var a string
		var s int64
		if err := rows.Scan(&a, &s); err != nil {
			f.t.Fatal(err)
		}
		h[a] = append(h[a], s)
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	return h
}

// publishShuffled stores aggs aggregates × seqs sequences in a random order,
// then, after the duplicate window, a random third of them again in another
// random order, so the stream holds repeats the broker did not drop. It
// returns how many repeats were stored.
func (f *fixture) publishShuffled(rng *rand.Rand, aggs, seqs int) (repeats int) {
	f.t.Helper()
	type m struct{ agg, seq int }
	var all []m
	for a := range aggs {
		for s := 1; s <= seqs; s++ {
			all = append(all, m{a, s})
		}
	}
	publish := func(x m) bool {
		return f.publish(fmt.Sprintf("order-%d-seq-%d", x.agg, x.seq), fmt.Sprintf(`{"order":%d,"seq":%d}`, x.agg, x.seq), aggHeaders("order", strconv.Itoa(x.agg), x.seq))
	}
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	for _, x := range all {
		if publish(x) {
			f.t.Fatalf("first publish of %v stored as a duplicate", x)
		}
	}
	rng.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
	for _, x := range all[:len(all)/3] {
		f.publishStored(fmt.Sprintf("order-%d-seq-%d", x.agg, x.seq), fmt.Sprintf(`{"order":%d,"seq":%d}`, x.agg, x.seq), aggHeaders("order", strconv.Itoa(x.agg), x.seq))
		repeats++
	}
	return repeats
}

// consumeWith runs one Consume per inbox, each on its own pool, pulling
// small batches so that every instance gets a share of each aggregate.
func (f *fixture) consumeWith(ctx context.Context, ins []*inbox.Inbox, h inbox.Handler) {
	f.t.Helper()
	for _, in := range ins {
		cc, err := f.cons.Consume(in.Wrap(ctx, h), jetstream.PullMaxMessages(8))
		if err != nil {
			f.t.Fatal(err)
		}
		f.t.Cleanup(cc.Stop)
	}
}

// waitSettled waits, longer than requireSettled, until history has rows
// rows and the consumer has nothing pending or unacked.
func (f *fixture) waitSettled(rows int, within time.Duration) {
	f.t.Helper()
	testenv.WaitFor(f.t, within, fmt.Sprintf("%d history rows and a settled consumer", rows), func() (bool, error) {
		var n int
		if err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM history`).Scan(&n); err != nil {
			return false, err
		}
		info, err := f.cons.Info(context.Background())
		if err != nil {
			return false, err
		}
		return n == rows && info.NumAckPending == 0 && info.NumPending == 0,
			fmt.Errorf("%d history rows, ack pending %d, pending %d", n, info.NumAckPending, info.NumPending)
	})
}

func sumStats(ins []*inbox.Inbox) inbox.Stats {
	var s inbox.Stats
	for _, in := range ins {
		x := in.Stats()
		s.Applied += x.Applied
		s.Duplicates += x.Duplicates
		s.Retried += x.Retried
		s.Rejected += x.Rejected
		s.AckFailed += x.AckFailed
		s.Waited += x.Waited
		s.Gaps += x.Gaps
		s.Superseded += x.Superseded
		s.Expired += x.Expired
	}
	return s
}

// jitter holds the position lock a little while, so that instances overlap
// on one aggregate more often.
func jitter(h inbox.Handler) inbox.Handler {
	return func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		time.Sleep(time.Duration(rand.IntN(2000)) * time.Microsecond)
		return h(ctx, tx, msg)
	}
}

const (
	nAggregates = 20
	nSequences  = 10
)

// TestInSequenceShuffled: 20 aggregates × 10 sequences stored in a shuffled
// order with repeats, consumed by three instances at once. Every aggregate's
// effects are applied in order 1..10, each once.
func TestInSequenceShuffled(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond})
	f.createHistory()
	seed := rand.Uint64()
	t.Logf("shuffle seed %d", seed)
	repeats := f.publishShuffled(rand.New(rand.NewPCG(seed, 0)), nAggregates, nSequences)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var ins []*inbox.Inbox
	for range 3 {
		ins = append(ins, f.newInbox(newPool(t, f.dbURL), func(c *inbox.Config) {
			c.Order = inbox.InSequence
			c.BackoffMin, c.BackoffMax = 5*time.Millisecond, 40*time.Millisecond
			c.OnGap = func(g inbox.Gap) { t.Errorf("gap reported: %+v", g) }
		}))
	}
	f.consumeWith(ctx, ins, jitter(record))
	f.waitSettled(nAggregates*nSequences, 90*time.Second)

	want := []int64{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	h := f.historyOf()
	if len(h) != nAggregates {
		t.Errorf("%d aggregates in history, want %d", len(h), nAggregates)
	}
	for a, seqs := range h {
		if !slices.Equal(seqs, want) {
			t.Errorf("%s applied in order %v, want %v", a, seqs, want)
		}
	}
	f.requireHistoryDistinct(nAggregates * nSequences)
	var atTen int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM inbox_positions WHERE consumer = 'billing' AND applied_seq = 10 AND waiting_since IS NULL`).Scan(&atTen); err != nil || atTen != nAggregates {
		t.Errorf("%d positions at 10 with nothing waiting (%v), want %d", atTen, err, nAggregates)
	}
	s := sumStats(ins)
	t.Logf("stats %+v, %d repeats stored", s, repeats)
	if s.Applied != nAggregates*nSequences || s.Duplicates != uint64(repeats) || s.Superseded != 0 || s.Rejected != 0 || s.Gaps != 0 {
		t.Errorf("stats %+v: want %d applied, %d duplicates, nothing superseded, rejected or reported", s, nAggregates*nSequences, repeats)
	}
	if s.Waited == 0 {
		t.Error("no message waited: the shuffle did not reorder anything, so the test proved nothing")
	}
}

func (f *fixture) requireHistoryDistinct(n int) {
	f.t.Helper()
	var rows, distinct int
	if err := f.pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT msg_id) FROM history`).Scan(&rows, &distinct); err != nil {
		f.t.Fatal(err)
	}
	if rows != n || distinct != n {
		f.t.Errorf("history: %d rows, %d distinct messages; want %d of each", rows, distinct, n)
	}
}

// TestLatestWinsShuffled: the same stream under LatestWins. Every
// projection ends at sequence 10, no aggregate's applied sequences ever go
// down, and every message is either applied or recorded as superseded.
func TestLatestWinsShuffled(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond})
	f.createHistory()
	seed := rand.Uint64()
	t.Logf("shuffle seed %d", seed)
	repeats := f.publishShuffled(rand.New(rand.NewPCG(seed, 0)), nAggregates, nSequences)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var ins []*inbox.Inbox
	for range 3 {
		ins = append(ins, f.newInbox(newPool(t, f.dbURL), func(c *inbox.Config) { c.Order = inbox.LatestWins }))
	}
	f.consumeWith(ctx, ins, jitter(record))
	testenv.WaitFor(t, 60*time.Second, "every message decided and the consumer settled", func() (bool, error) {
		var decided int
		if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM inbox`).Scan(&decided); err != nil {
			return false, err
		}
		info, err := f.cons.Info(ctx)
		if err != nil {
			return false, err
		}
		return decided == nAggregates*nSequences && info.NumAckPending == 0 && info.NumPending == 0,
			fmt.Errorf("%d decided, ack pending %d, pending %d", decided, info.NumAckPending, info.NumPending)
	})

	var below int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM projection WHERE seq <> 10`).Scan(&below); err != nil {
		t.Fatal(err)
	}
	var projections int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM projection`).Scan(&projections); err != nil || projections != nAggregates || below != 0 {
		t.Errorf("%d projections, %d not at sequence 10 (%v)", projections, below, err)
	}
	for a, seqs := range f.historyOf() {
		ok := seqs[len(seqs)-1] == 10
		for i := 1; i < len(seqs); i++ {
			ok = ok && seqs[i] > seqs[i-1]
		}
		if !ok {
			t.Errorf("%s applied %v: want strictly increasing, ending at 10", a, seqs)
		}
	}
	// Every message is in the inbox once, with its aggregate, as applied or
	// superseded, and what is applied is exactly what the history holds.
	var applied, superseded, withAgg int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE disposition = 'applied'), count(*) FILTER (WHERE disposition = 'superseded'),
			count(*) FILTER (WHERE aggregate_type = 'order' AND aggregate_seq BETWEEN 1 AND 10) FROM inbox`).Scan(&applied, &superseded, &withAgg); err != nil {
		t.Fatal(err)
	}
	var history int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM history`).Scan(&history); err != nil {
		t.Fatal(err)
	}
	s := sumStats(ins)
	t.Logf("stats %+v, %d repeats stored; inbox: %d applied, %d superseded", s, repeats, applied, superseded)
	if applied+superseded != nAggregates*nSequences || withAgg != nAggregates*nSequences || applied != history {
		t.Errorf("inbox: %d applied + %d superseded (%d with their aggregate), history %d; want %d in all and applied = history",
			applied, superseded, withAgg, history, nAggregates*nSequences)
	}
	if s.Applied != uint64(applied) || s.Superseded != uint64(superseded) || s.Duplicates != uint64(repeats) || s.Waited != 0 || s.Rejected != 0 {
		t.Errorf("stats %+v disagree with the inbox (%d applied, %d superseded) or the %d repeats", s, applied, superseded, repeats)
	}
	if superseded == 0 {
		t.Error("nothing superseded: the shuffle did not reorder anything, so the test proved nothing")
	}
	// The superseded ones are really older than something applied before
	// them: each is below its aggregate's final sequence.
	var wrong int
	if err := f.pool.QueryRow(ctx, `SELECT count(*) FROM inbox i JOIN projection p ON p.aggregate = i.aggregate_type || '/' || i.aggregate_id
		WHERE i.disposition = 'superseded' AND i.aggregate_seq > p.seq`).Scan(&wrong); err != nil || wrong != 0 {
		t.Errorf("%d superseded messages newer than their projection (%v)", wrong, err)
	}
}

// TestInSequenceConcurrentPair: instance A is applying sequence 2 of an
// aggregate when instance B gets sequence 3. B waits for A's transaction on
// the position row, then finds 3 in turn and applies it: never before 2,
// and without a needless redelivery.
func TestInSequenceConcurrentPair(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	f.createHistory()
	cfg := func(c *inbox.Config) { c.Order = inbox.InSequence }
	a := f.newInbox(f.pool, cfg)
	b := f.newInbox(newPool(t, f.dbURL), cfg)
	ctx := context.Background()
	// Sequence 1 first, so that the position row exists and only its lock
	// (not the unique key of a first insert) can hold B.
	f.publish("order-1-seq-1", `{}`, aggHeaders("order", "1", 1))
	out, err := a.Process(ctx, f.fetch(5*time.Second), record)
	expect(t, "sequence 1", out, inbox.Applied, err)
	f.publish("order-1-seq-2", `{}`, aggHeaders("order", "1", 2))
	f.publish("order-1-seq-3", `{}`, aggHeaders("order", "1", 3))
	m1, m2 := f.fetch(5*time.Second), f.fetch(5*time.Second)

	started, release := make(chan struct{}), make(chan struct{})
	var releaseOnce sync.Once
	unblock := func() { releaseOnce.Do(func() { close(release) }) }
	// On a failure too: a handler left blocked keeps its connection, and
	// closing the pool would wait for it forever.
	defer unblock()
	slow := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		if err := record(ctx, tx, msg); err != nil {
			return err
		}
		close(started)
		<-release
		return nil
	}
	type result struct {
		out inbox.Outcome
		err error
	}
	aDone, bDone := make(chan result, 1), make(chan result, 1)
	go func() { o, err := a.Process(ctx, m1, slow); aDone <- result{o, err} }()
	<-started
	go func() { o, err := b.Process(ctx, m2, record); bDone <- result{o, err} }()
	select {
	case r := <-bDone:
		t.Fatalf("B finished (%v, %v) while A held sequence 2 open", r.out, r.err)
	case <-time.After(300 * time.Millisecond):
	}
	unblock()
	ra, rb := <-aDone, <-bDone
	expect(t, "A, sequence 2", ra.out, inbox.Applied, ra.err)
	expect(t, "B, sequence 3", rb.out, inbox.Applied, rb.err)
	if h := f.historyOf()["order/1"]; !slices.Equal(h, []int64{1, 2, 3}) {
		t.Errorf("history %v, want [1 2 3]", h)
	}
	f.requireSettled()
}

// TestInSequenceGap: sequence 5 of order/7 is never sent. 6 and 7 wait;
// after GapAfter the gap is reported once (callback, counter, position
// row), while order/8 is not held up. An operator's Skip lets 6 and 7
// apply; a 5 that arrives after all is superseded.
func TestInSequenceGap(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	f.createHistory()
	const gapAfter = 800 * time.Millisecond
	gaps := make(chan inbox.Gap, 10)
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.Order = inbox.InSequence
		c.GapAfter = gapAfter
		c.OnGap = func(g inbox.Gap) { gaps <- g }
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	for _, s := range []int{1, 2, 3, 4, 6, 7} {
		f.publish(fmt.Sprintf("order-7-seq-%d", s), `{}`, aggHeaders("order", "7", s))
	}
	for _, s := range []int{2, 1} {
		f.publish(fmt.Sprintf("order-8-seq-%d", s), `{}`, aggHeaders("order", "8", s))
	}
	f.consumeWith(ctx, []*inbox.Inbox{in}, record)

	var g inbox.Gap
	select {
	case g = <-gaps:
	case <-time.After(20 * time.Second):
		t.Fatalf("no gap reported; stats %+v, history %v", in.Stats(), f.historyOf())
	}
	if el := time.Since(start); el < gapAfter {
		t.Errorf("gap reported after %v, before the %v bound", el, gapAfter)
	}
	if g.Type != "order" || g.ID != "7" || g.Applied != 4 || (g.Waiting != 6 && g.Waiting != 7) || g.Age < gapAfter || g.Since.IsZero() || g.MsgID == "" {
		t.Errorf("gap %+v", g)
	}
	h := f.historyOf()
	if !slices.Equal(h["order/7"], []int64{1, 2, 3, 4}) || !slices.Equal(h["order/8"], []int64{1, 2}) {
		t.Errorf("history %v: want order/7 at 1..4 and order/8 at 1..2", h)
	}
	// Still waiting, and reported once however often 6 and 7 come back.
	time.Sleep(500 * time.Millisecond)
	select {
	case g := <-gaps:
		t.Errorf("gap reported again: %+v", g)
	default:
	}
	if s := in.Stats(); s.Gaps != 1 || s.Waited < 3 || s.Rejected != 0 {
		t.Errorf("stats %+v: want one gap, several waits, no rejection", s)
	}
	var reported bool
	if err := f.pool.QueryRow(ctx, `SELECT gap_reported_at IS NOT NULL FROM inbox_positions WHERE aggregate_type = 'order' AND aggregate_id = '7'`).Scan(&reported); err != nil || !reported {
		t.Errorf("position row does not show the reported gap (%v)", err)
	}
	if info, err := f.cons.Info(ctx); err != nil || info.NumAckPending != 2 {
		t.Errorf("ack pending %v (%v): 6 and 7 should wait unacked, not be terminated", info.NumAckPending, err)
	}

	// The operator decides 5 will never come.
	if err := in.Skip(ctx, "order", "7", 5, ""); err == nil {
		t.Error("Skip without a reason accepted")
	}
	if err := in.Skip(ctx, "order", "7", 5, "row order-7-seq-5 cancelled at the relay, ticket OPS-12"); err != nil {
		t.Fatalf("Skip: %v", err)
	}
	f.waitSettled(8, 20*time.Second)
	if h := f.historyOf()["order/7"]; !slices.Equal(h, []int64{1, 2, 3, 4, 6, 7}) {
		t.Errorf("order/7 history %v after the skip", h)
	}
	var after, through int64
	var reason string
	if err := f.pool.QueryRow(ctx, `SELECT skipped_after, skipped_through, skip_reason FROM inbox_positions WHERE aggregate_type = 'order' AND aggregate_id = '7'`).Scan(&after, &through, &reason); err != nil ||
		after != 4 || through != 5 || !strings.Contains(reason, "OPS-12") {
		t.Errorf("skip recorded as %d..%d %q (%v)", after, through, reason, err)
	}
	if err := in.Skip(ctx, "order", "7", 5, "again"); err == nil || !strings.Contains(err.Error(), "already at 7") {
		t.Errorf("Skip behind the position: %v", err)
	}

	// 5 arrives after all (redriven at the relay): recorded, not applied.
	f.publish("order-7-seq-5", `{}`, aggHeaders("order", "7", 5))
	testenv.WaitFor(t, 10*time.Second, "the late 5 to be superseded", func() (bool, error) {
		var d string
		err := f.pool.QueryRow(ctx, `SELECT disposition FROM inbox WHERE message_id = 'order-7-seq-5'`).Scan(&d)
		return d == "superseded", fmt.Errorf("disposition %q, %v", d, err)
	})
	f.requireSettled()
	if h := f.historyOf()["order/7"]; !slices.Equal(h, []int64{1, 2, 3, 4, 6, 7}) {
		t.Errorf("order/7 history %v after the late 5", h)
	}
}

// TestEnforceDeadline: the deadline is decided on the database's clock in
// the effect's transaction. An expired message is recorded and terminated,
// a future one applied; a message applied in time and repeated after its
// deadline is a duplicate, not an expiry.
func TestEnforceDeadline(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond, ackWait: time.Second})
	var mu sync.Mutex
	var rejections []inbox.Rejection
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.EnforceDeadline = true
		c.OnReject = func(r inbox.Rejection) { mu.Lock(); rejections = append(rejections, r); mu.Unlock() }
	})
	ctx := context.Background()
	var dbNow time.Time
	if err := f.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	deadline := func(d time.Duration) map[string]string {
		return map[string]string{wire.HeaderExpiresAt: dbNow.Add(d).UTC().Format(time.RFC3339Nano)}
	}
	process := func(id string, hdr map[string]string) (inbox.Outcome, error) {
		t.Helper()
		f.publish(id, `{}`, hdr)
		return in.Process(ctx, f.fetch(5*time.Second), apply)
	}

	out, err := process("late", deadline(-time.Minute))
	expect(t, "expired a minute ago", out, inbox.Expired, err)
	if !errors.Is(err, inbox.ErrExpired) || !errors.Is(err, inbox.ErrRejected) {
		t.Errorf("error %v, want ErrExpired", err)
	}
	out, err = process("in-time", deadline(time.Hour))
	expect(t, "an hour left", out, inbox.Applied, err)
	out, err = process("no-deadline", nil)
	expect(t, "no deadline", out, inbox.Applied, err)
	out, err = process("unreadable", map[string]string{wire.HeaderExpiresAt: "tomorrow"})
	expect(t, "unreadable deadline", out, inbox.Rejected, err)

	// Applied in time, repeated after the deadline (on the database clock,
	// and stored by the broker past its duplicate window): a duplicate.
	var tightFrom time.Time
	if err := f.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&tightFrom); err != nil {
		t.Fatal(err)
	}
	tight := deadline(tightFrom.Sub(dbNow) + 2*time.Second)
	out, err = process("tight", tight)
	expect(t, "2s left", out, inbox.Applied, err)
	testenv.WaitFor(t, 10*time.Second, "the tight deadline passed on the database clock", func() (bool, error) {
		var passed bool
		err := f.pool.QueryRow(ctx, `SELECT clock_timestamp() > $1::timestamptz`, tight[wire.HeaderExpiresAt]).Scan(&passed)
		return passed, err
	})
	f.publishStored("tight", `{}`, tight)
	out, err = in.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "repeat after the deadline", out, inbox.Duplicate, err)

	f.requireEffects(3, 3)
	f.requireSettled()
	// Terminated: the expired message does not come back after AckWait.
	if m, err := f.tryFetch(1500 * time.Millisecond); err == nil {
		t.Errorf("delivered again: %s", m.Headers().Get(jetstream.MsgIDHeader))
	}
	var disp string
	var expires time.Time
	if err := f.pool.QueryRow(ctx, `SELECT disposition, expires_at FROM inbox WHERE message_id = 'late'`).Scan(&disp, &expires); err != nil ||
		disp != "expired" || !expires.Equal(dbNow.Add(-time.Minute).Truncate(time.Microsecond)) {
		t.Errorf("inbox row of the expired message: %q, expires_at %v (%v)", disp, expires, err)
	}
	mu.Lock()
	var reasons []string
	for _, r := range rejections {
		reasons = append(reasons, r.Reason)
	}
	mu.Unlock()
	if fmt.Sprint(reasons) != "[expired malformed_expires_at]" {
		t.Errorf("rejection reasons %v", reasons)
	}
	if s := in.Stats(); s.Expired != 1 || s.Applied != 3 || s.Rejected != 1 || s.Duplicates != 1 {
		t.Errorf("stats %+v", s)
	}

	// Without EnforceDeadline the header is not looked at.
	lax := f.newInbox(f.pool, nil)
	f.publish("late-lax", `{}`, deadline(-time.Minute))
	out, err = lax.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "expired, not enforced", out, inbox.Applied, err)
}

// TestDeadlineInSequence: under InSequence an expired sequence is the
// consumer's own decision, so the position moves past it and the next one
// applies. Under LatestWins the projection keeps the version it has, so an
// older message than the expired one still applies.
func TestDeadlineInSequence(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	f.createHistory()
	ctx := context.Background()
	var dbNow time.Time
	if err := f.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&dbNow); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		order inbox.Order
		seqs  []int // in delivery order; the second one is expired
		want  []inbox.Outcome
		final []int64
	}{
		{"history", inbox.InSequence, []int{1, 2, 3}, []inbox.Outcome{inbox.Applied, inbox.Expired, inbox.Applied}, []int64{1, 3}},
		{"projection", inbox.LatestWins, []int{1, 3, 2}, []inbox.Outcome{inbox.Applied, inbox.Expired, inbox.Applied}, []int64{1, 2}},
	} {
		in := f.newInbox(f.pool, func(cf *inbox.Config) { cf.Order = c.order; cf.EnforceDeadline = true; cf.Consumer = c.name })
		for i, seq := range c.seqs {
			hdr := aggHeaders(c.name, "1", seq)
			expires := time.Hour
			if i == 1 {
				expires = -time.Hour
			}
			hdr[wire.HeaderExpiresAt] = dbNow.Add(expires).UTC().Format(time.RFC3339)
			f.publish(fmt.Sprintf("%s-%d", c.name, seq), `{}`, hdr)
			out, err := in.Process(ctx, f.fetch(5*time.Second), record)
			expect(t, fmt.Sprintf("%s seq %d", c.name, seq), out, c.want[i], err)
		}
		if h := f.historyOf()[c.name+"/1"]; !slices.Equal(h, c.final) {
			t.Errorf("%s: history %v, want %v", c.name, h, c.final)
		}
	}
}

// TestMalformedAggregate: under an ordering rule a message whose aggregate
// headers are partial or whose sequence is not a positive integer is
// terminated, never applied; one without any is applied unordered. Without
// a rule the headers are not looked at.
func TestMalformedAggregate(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	var reasons atomic.Int64
	strict := f.newInbox(f.pool, func(c *inbox.Config) {
		c.Order = inbox.InSequence
		c.OnReject = func(r inbox.Rejection) {
			if r.Reason == "malformed_aggregate" {
				reasons.Add(1)
			}
		}
	})
	ctx := context.Background()
	bad := []map[string]string{
		aggHeaders("order", "1", 0),
		aggHeaders("order", "1", -3),
		{wire.HeaderAggregateType: "order", wire.HeaderAggregateID: "1", wire.HeaderSequence: "x"},
		{wire.HeaderAggregateType: "order", wire.HeaderAggregateID: "1", wire.HeaderSequence: "1.5"},
		{wire.HeaderAggregateType: "order", wire.HeaderAggregateID: "1"},
		{wire.HeaderAggregateType: "order", wire.HeaderSequence: "1"},
		{wire.HeaderAggregateID: "1", wire.HeaderSequence: "1"},
		{wire.HeaderSequence: "1"},
	}
	for i, hdr := range bad {
		f.publish(fmt.Sprintf("bad-%d", i), `{}`, hdr)
		out, err := strict.Process(ctx, f.fetch(5*time.Second), apply)
		if out != inbox.Rejected || !errors.Is(err, inbox.ErrRejected) {
			t.Errorf("headers %v: %v (%v), want rejected", hdr, out, err)
		}
	}
	if int(reasons.Load()) != len(bad) {
		t.Errorf("%d malformed_aggregate rejections, want %d", reasons.Load(), len(bad))
	}
	f.publish("plain", `{}`, nil)
	out, err := strict.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "no aggregate headers under InSequence", out, inbox.Applied, err)

	lax := f.newInbox(f.pool, nil)
	f.publish("bad-unordered", `{}`, bad[0])
	out, err = lax.Process(ctx, f.fetch(5*time.Second), apply)
	expect(t, "malformed headers, no rule", out, inbox.Applied, err)
	f.requireEffects(2, 2)
	f.requireSettled()
}

// TestMigrateUpgrade: an inbox table created before the ordering columns
// keeps working unmigrated for an unordered inbox, and Migrate adds the
// columns (old rows read as applied) and the positions table.
func TestMigrateUpgrade(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	ctx := context.Background()
	if _, err := f.pool.Exec(ctx, `CREATE TABLE old_inbox (
			consumer text NOT NULL, message_id text NOT NULL,
			payload_sha256 bytea NOT NULL CHECK (length(payload_sha256) = 32),
			subject text NOT NULL, stream_seq bigint,
			received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
			PRIMARY KEY (consumer, message_id));
		CREATE TABLE old_inbox_fences (resource text PRIMARY KEY, generation bigint NOT NULL, updated_at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	old := f.newInbox(f.pool, func(c *inbox.Config) { c.Table = "old_inbox" })
	f.publish("before", `{}`, nil)
	if out, err := old.Process(ctx, f.fetch(5*time.Second), apply); out != inbox.Applied {
		t.Fatalf("unordered inbox on an unmigrated table: %v %v", out, err)
	}
	for range 2 {
		if err := inbox.Migrate(ctx, f.pool, "old_inbox"); err != nil {
			t.Fatalf("migrate: %v", err)
		}
	}
	var disp string
	if err := f.pool.QueryRow(ctx, `SELECT disposition FROM old_inbox WHERE message_id = 'before'`).Scan(&disp); err != nil || disp != "applied" {
		t.Errorf("old row's disposition %q (%v)", disp, err)
	}
	ordered := f.newInbox(f.pool, func(c *inbox.Config) { c.Table = "old_inbox"; c.Order = inbox.LatestWins })
	f.publish("after", `{}`, aggHeaders("order", "1", 1))
	if out, err := ordered.Process(ctx, f.fetch(5*time.Second), apply); out != inbox.Applied {
		t.Fatalf("ordered inbox after the upgrade: %v %v", out, err)
	}
	var seq int64
	if err := f.pool.QueryRow(ctx, `SELECT applied_seq FROM old_inbox_positions WHERE aggregate_id = '1'`).Scan(&seq); err != nil || seq != 1 {
		t.Errorf("position %d (%v)", seq, err)
	}
	if _, err := inbox.New(f.pool, inbox.Config{Consumer: "x", Order: 9}); err == nil {
		t.Error("New accepted an unknown Order")
	}
}
