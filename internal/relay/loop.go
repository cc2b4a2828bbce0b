package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/checkpoint"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// item is one ready row on its way through the session: published, acked
// (or refused), settled in the table, then counted off its transaction.
type item struct {
	txn        *checkpoint.Txn
	workID     string
	commitTime time.Time
	msg        *wire.Message
	size       int
	held       int // the row's bytes in the session's budget, until its payload is dropped (free)
	fut        sinks.Future
	ack        sinks.Ack
	err        error
	settle     store.Settle
	tries      int       // settle attempts that found the row not visible yet
	retryAt    time.Time // next settle attempt
	// With --ordering aggregate: the row's aggregate, and whether its
	// handoff holds that aggregate (see order.go).
	ordered bool
	agg     store.AggregateKey
	holds   bool
	// batchHead: the first row of an atomic batch (atomic.go), whose
	// result counts the batch.
	batchHead bool
}

// The loop's invariants, asserted after every step that changes them when
// checkInvariants is set (every test of this package):
//
//   - In flight: inflight counts the rows handed to the sink (a publish, a
//     row of an atomic batch) whose answer the loop has not taken yet. It
//     never exceeds --max-in-flight, and inflightBytes never exceeds
//     --max-in-flight-bytes except for one row (or one atomic batch) alone
//     in flight: every path asks hasRoom first (publish, the waiting row,
//     an atomic batch), a parked row takes the place of the row whose ack
//     released it, and a row found stored (the read-back) is settled at
//     once without counting (foundStored).
//   - Confirmed: the checkpoint confirms a position only once every row of
//     every transaction before it is settled in the table (G3), and the
//     stream position recorded with it is below every message of every
//     transaction after it (position.go).
//
// loop is one session's state. Everything here belongs to the goroutine in
// run; the collector and settler goroutines only touch the items handed to
// them through channels.
type loop struct {
	r  *Relay
	cp *checkpoint.Checkpoint
	// budget counts the decoded rows the session holds (G15): the stream
	// takes a row's bytes, the loop gives them back in free.
	budget *replication.Budget
	// slotLSN is the consistent point of the slot this session streams,
	// as recorded: its watermark candidates are bound to it.
	slotLSN store.LSN
	// cover is what the watermark still owes (--on-publish none,
	// watermark.go); nil under the other policies.
	cover *coverage
	xids  []uint64 // handleResults' buffer of acked ids for cover

	cur           *checkpoint.Txn
	curCommitTime time.Time
	curCommitLSN  replication.LSN
	curHeaders    map[string][]string // CDCHeaders of the open transaction, built on its first row

	inflight       int
	inflightBytes  int
	waitingForRoom *item // a row waiting for in-flight capacity

	// settle takes the rows acked, handed off or rejected into the
	// table's settle statements (settle.go).
	settle *settleBatcher

	batch []replication.Event // the batch being handled; rest is its unhandled rest
	rest  []replication.Event

	// readBack: the replayed rows the stream holds already (readback.go);
	// readBackDone once the session's read is behind it.
	readBack     *readBack
	readBackDone bool
	// pollerOwns: rows handed back to the poller as lost (G19) that this
	// session's replay leaves to it (nil: none).
	pollerOwns map[string]struct{}
	// pos: the stream position of each confirmation (position.go);
	// newSlot: the session created its slot; started: the slot's
	// confirmed position the session started from.
	pos     positions
	newSlot bool
	started replication.LSN

	atomic  *atomicState // nil without --atomic-transactions
	order   *orderState  // nil without --ordering aggregate
	gated   *gateState   // nil without --standby-slot
	refresh chan heldRefresh
	// stop is the clean stop's state machine (stop.go).
	stop cleanStop

	stream *replication.Stream
	// keeper writes running-transactions records so the slot's
	// restart_lsn follows (restart.go); nil: none.
	keeper *restartKeeper

	// Counters of every ack, bound to their labels once: a label lookup
	// per message hashes the labels each time.
	publishedOK, publishedDup prometheus.Counter

	queue   chan *item // to the collector, in publish order
	results chan []*item
	wg      sync.WaitGroup
}

// newLoop starts a session's loop; held is the table's held aggregates
// when ordering is on, nil otherwise.
func newLoop(r *Relay, confirmed replication.LSN, held map[store.AggregateKey]string, budget *replication.Budget) *loop {
	l := &loop{
		r:       r,
		cp:      checkpoint.New(confirmed),
		started: confirmed,
		budget:  budget,
		queue:   make(chan *item, r.cfg.MaxInFlight+1),
		results: make(chan []*item, 64),
		settle:  newSettleBatcher(r),
		refresh: make(chan heldRefresh),
	}
	l.publishedOK = r.metrics.Published.WithLabelValues("cdc", "ok")
	l.publishedDup = r.metrics.Published.WithLabelValues("cdc", "duplicate")
	if held != nil {
		l.order = newOrderState(held)
	}
	if r.cfg.Standby != nil {
		l.gated = newGateState(r.cfg.Standby, r.metrics.StandbyGated, &r.gatePeak, budget)
	}
	if r.store.Policy() == store.PolicyNone {
		l.cover = &coverage{}
		l.cover.oweEarlier()
	}
	if r.cfg.AtomicTransactions {
		l.atomic = newAtomicState(r)
	}
	return l
}

// wait returns once the helper goroutines have exited (after sessCtx ends).
func (l *loop) wait() { l.wg.Wait() }

func (l *loop) run(ctx, sessCtx context.Context, events <-chan []replication.Event, confirms chan replication.LSN, stop chan struct{}, streamDone <-chan error) error {
	l.startHelpers(sessCtx)
	if l.gated != nil {
		defer l.gated.stopWaiting()
	}
	defer close(l.queue)
	defer l.settle.close()
	l.stop.readWAL, l.stop.events = stop, make(chan stopEvent, stopEvents)
	shutdown := ctx.Done()
	for {
		if err := l.takeEvents(sessCtx, confirms); err != nil {
			return err
		}
		l.settle.due(l.stop.draining())
		if l.stop.draining() && l.inflight == 0 && l.settle.idle() {
			return l.finish(sessCtx, confirms, streamDone)
		}
		var err error
		select {
		case batch := <-l.readFrom(events):
			err = l.received(sessCtx, batch, confirms)
		case r := <-l.gateReads():
			err = l.gateRead(sessCtx, r, confirms)
		case <-l.gateStarved():
			err = l.letThroughGated(sessCtx, confirms)
		case its := <-l.results:
			err = l.handleResults(sessCtx, its)
		case res := <-l.settle.results():
			err = l.handleSettled(res, confirms)
		case <-l.settle.wake():
			l.settle.woke()
		case res := <-l.refresh:
			l.refreshed(res)
		case err := <-streamDone:
			if err == nil {
				err = errors.New("replication stream ended")
			}
			return err
		case <-shutdown:
			shutdown = nil
			l.beginStop(sessCtx)
		case ev := <-l.stop.events:
			if l.step(sessCtx, ev) {
				return l.finish(sessCtx, confirms, streamDone)
			}
		}
		if err != nil {
			return err
		}
	}
}

// startHelpers starts the goroutines of the session: the collector of
// acks, the settler, and with their options the standbys' watcher and the
// held aggregates' refresher. They end with sessCtx.
func (l *loop) startHelpers(sessCtx context.Context) {
	l.wg.Add(2)
	go l.collect(sessCtx)
	go func() {
		defer l.wg.Done()
		l.settle.run(sessCtx)
	}()
	if l.gated != nil {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.gated.watch(sessCtx)
		}()
	}
	if l.keeper != nil && l.keeper.streaming {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.keeper.keep(sessCtx)
		}()
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		l.r.keepCheckingLost(sessCtx)
	}()
	if l.r.store.Policy() == store.PolicyNone {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			l.recordWatermarks(sessCtx)
		}()
	}
	if l.order != nil {
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			refresher(sessCtx, l.r.store, l.order, l.r.cfg.HeldRefresh, l.refresh)
		}()
	}
}

// takeEvents moves what was read through the loop as far as the read
// limit allows: the row waiting for in-flight room, then the rest of the
// batch being handled (or what the gate lets through). The next batch is
// read only once this one is done.
func (l *loop) takeEvents(ctx context.Context, confirms chan replication.LSN) error {
	if l.waitingForRoom != nil && !l.stop.draining() && l.hasRoom(l.waitingForRoom.size) {
		b := l.waitingForRoom
		l.waitingForRoom = nil
		if err := l.publish(ctx, b); err != nil {
			return err
		}
	}
	if l.atomic != nil {
		if err := l.atomic.takeWaiting(ctx, l); err != nil {
			return err
		}
	}
	if l.gated != nil {
		if len(l.gated.events) > 0 {
			return l.letThroughGated(ctx, confirms)
		}
		return nil
	}
	for len(l.rest) > 0 && l.mayRead() {
		ev := l.rest[0]
		// The batch would keep the row (and its payload) alive after
		// its ack gave its bytes back.
		l.rest[0] = replication.Event{}
		l.rest = l.rest[1:]
		if err := l.handleEvent(ctx, ev, confirms); err != nil {
			return err
		}
	}
	if len(l.rest) == 0 && l.batch != nil {
		replication.ReleaseBatch(l.batch)
		l.batch = nil
	}
	return nil
}

// mayRead is the read limit, the one decision every read path asks
// (reading the stream, taking the next event of a batch, letting events
// through the gate): whether the loop may take another event now. Rows
// acked and waiting for their mark are bounded too: when the database
// marks slower than the broker acks, reading WAL waits, instead of the
// queue (and memory) growing with the backlog (G15).
func (l *loop) mayRead() bool {
	return l.waitingForRoom == nil && !l.stop.draining() && l.settle.unsettled() < l.r.cfg.MaxUnsettled &&
		(l.order == nil || l.order.parked < l.r.cfg.MaxInFlight) && (l.atomic == nil || l.atomic.waiting == nil)
}

// readFrom returns events when the loop may read the next batch, nil (a
// case the select never takes) otherwise. With --standby-slot the batch
// goes into the gate, which holds at most gateCap events: a transaction
// larger than that waits in the stream, not in memory (gate.go).
func (l *loop) readFrom(events <-chan []replication.Event) <-chan []replication.Event {
	if !l.mayRead() {
		return nil
	}
	if l.gated != nil {
		if l.gated.full(l.gateCap()) {
			return nil
		}
	} else if len(l.rest) > 0 {
		return nil
	}
	return events
}

// received takes a batch read from the stream.
func (l *loop) received(ctx context.Context, batch []replication.Event, confirms chan replication.LSN) error {
	if l.gated == nil {
		l.batch, l.rest = batch, batch
		return nil
	}
	for _, ev := range batch {
		l.gated.push(ev)
	}
	l.gated.noteDepth()
	replication.ReleaseBatch(batch)
	return l.letThroughGated(ctx, confirms)
}

// handleResults takes a group of acks from the collector.
func (l *loop) handleResults(ctx context.Context, its []*item) error {
	xids := l.xids[:0]
	for _, it := range its {
		if err := l.handleResult(ctx, it); err != nil {
			return err
		}
		// The rows of a transaction come one after another: each id
		// once per run.
		if x := it.settle.XactID; l.cover != nil && x != 0 && it.settle.Outcome == store.Published &&
			(len(xids) == 0 || xids[len(xids)-1] != x) {
			xids = append(xids, x)
		}
	}
	if len(xids) > 0 {
		l.cover.add(xids)
	}
	l.xids = xids[:0]
	l.assertInvariants()
	l.r.metrics.InFlight.Set(float64(l.inflight))
	l.r.metrics.InFlightBytes.Set(float64(l.inflightBytes))
	l.r.metrics.BufferedBytes.Set(float64(l.budget.Held()))
	return nil
}

// finish sends the final confirmation and lets the stream send its last
// status update and return. After a stop that reached its watermark
// candidate with every transaction before it settled, the confirmation is
// the candidate's position (watermark.go), and the candidate is recorded.
func (l *loop) finish(ctx context.Context, confirms chan replication.LSN, streamDone <-chan error) error {
	final := l.cp.Confirmed()
	reached := l.stop.reached && l.cp.Open() == 0
	if reached && !l.pastStop(final) {
		final = replication.LSN(l.stop.cand.LSN)
	}
	record := reached && l.cover.owes()
	l.pos.confirmed(final, l.cp)
	sendConfirm(confirms, final)
	close(confirms)
	select {
	case err := <-streamDone:
		if err != nil {
			return fmt.Errorf("final confirmation: %w", err)
		}
	case <-time.After(max(10*time.Second, 2*l.r.cfg.StatusInterval)):
		return errors.New("final confirmation: stream did not finish")
	}
	l.r.log.Info().Str("lsn", final.String()).Msg("stopped; slot confirmed")
	l.recordFinalPosition(ctx, final)
	switch {
	case record:
		l.recordAtStop(ctx, max(time.Second, l.r.cfg.DrainTimeout/stopReachShare))
	case l.cover != nil && l.cover.owes() && l.stop.reached:
		// Reached, but a transaction was left open or unsettled (the
		// drain timed out, or one past the candidate came through first).
		l.r.log.Warn().Msg("stopped; no watermark recorded at the stop (a transaction before its candidate was not settled in time): the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
	}
	return nil
}

func (l *loop) hasRoom(size int) bool {
	if l.inflight == 0 {
		return true // one message always fits, however large
	}
	return l.inflight < l.r.cfg.MaxInFlight && l.inflightBytes+size <= l.r.cfg.MaxInFlightBytes
}

func (l *loop) handleEvent(ctx context.Context, ev replication.Event, confirms chan replication.LSN) error {
	switch ev.Type {
	case replication.EventBegin:
		if l.pastStop(ev.CommitLSN) {
			l.reachedStop()
			return nil
		}
		if !l.readBackDone {
			l.readBackDone = true
			if err := l.startReadBack(ctx, ev.CommitTime, l.cp.Confirmed()); err != nil {
				return err
			}
		}
		l.cur = l.cp.Begin(ev.Xid, ev.CommitLSN)
		l.pos.begin(l.cur)
		l.cur.CommitTime = ev.CommitTime
		l.curCommitTime = ev.CommitTime
		if l.cp.Open() == 1 {
			l.r.oldestOpen.Store(ev.CommitTime.UnixNano())
		}
		l.curCommitLSN = ev.CommitLSN
		l.curHeaders = nil
	case replication.EventRow:
		if l.cur == nil {
			return errors.New("row outside a transaction")
		}
		return l.handleRow(ctx, ev.Row, ev.Row.Size())
	case replication.EventCommit:
		if l.cur == nil {
			return errors.New("commit outside a transaction")
		}
		if l.atomic != nil {
			if err := l.atomic.commit(ctx, l); err != nil {
				return err
			}
		}
		l.cp.Commit(l.cur, ev.EndLSN)
		l.cur = nil
		l.advance(confirms)
	case replication.EventPosition:
		if l.pastStop(ev.EndLSN) {
			l.reachedStop()
		}
	}
	return nil
}

// handleRow takes a ready row, and the bytes it holds in the budget, and
// does what admit decided.
func (l *loop) handleRow(ctx context.Context, row *replication.Row, held int) error {
	// A row inserted in another state belongs to the poller.
	if row.State != store.StateReady {
		l.budget.Release(held)
		return nil
	}
	it := &item{txn: l.cur, workID: row.WorkID, commitTime: l.curCommitTime, held: held}
	it.settle = store.Settle{WorkID: row.WorkID, Xid: l.cur.Xid, XactID: row.XactID}
	l.cp.Add(l.cur)
	if l.order != nil && row.Aggregate != nil {
		it.ordered, it.agg = true, store.AggregateKey{Type: row.Aggregate.Type, ID: row.Aggregate.ID}
	}
	switch a, why := l.admit(ctx, it, row); a {
	case toPoller:
		l.r.metrics.Handoffs.WithLabelValues(why).Inc()
		l.handOff(it)
	case parked:
		l.order.park(it)
	case batched:
		return l.atomic.add(ctx, l, it)
	case waits:
		l.waitingForRoom = it
	case send:
		return l.publish(ctx, it)
	}
	return nil
}

func (l *loop) publish(ctx context.Context, it *item) error {
	if ack, ok := l.found(it); ok {
		return l.foundStored(ctx, it, ack)
	}
	if l.expiring(it) {
		return nil
	}
	if err := l.fence(ctx); err != nil {
		return err
	}
	fut, err := l.r.sink.Publish(ctx, it.msg)
	if err != nil {
		if re, ok := l.refusal(it, err); ok {
			l.reject(it, re)
			return nil
		}
		l.r.metrics.Published.WithLabelValues("cdc", "error").Inc()
		return fmt.Errorf("%w: %w", errOutage, err)
	}
	return l.published(it, fut)
}

// expiring hands a row to the poller (which ends it expired, G13) when its
// deadline is now within --deadline-margin on the database's clock. It is
// asked when the row is read and again when it is published: a row can
// wait between the two (for room in flight behind a broker that answers
// late, for its aggregate's turn), and it was published past its deadline
// (the chaos run's broker-slow: 28 rows stored 74 to 83 ms past it).
func (l *loop) expiring(it *item) bool {
	if it.msg == nil || it.msg.ExpiresAt.IsZero() || it.msg.ExpiresAt.After(l.r.deadlineNow().Add(l.r.cfg.DeadlineMargin)) {
		return false
	}
	it.settle.Outcome = store.Delayed
	l.r.metrics.Handoffs.WithLabelValues("deadline").Inc()
	l.handOff(it)
	return true
}

// fence checks, before a publish, that this session's walsender may still
// hold the slot (replication.Stream.Fence): a row taken from a batch
// before the process was paused past wal_sender_timeout would otherwise
// go out after another instance took the slot over and published it (32
// rows stored twice after a SIGSTOP and a SIGCONT).
func (l *loop) fence(ctx context.Context) error {
	if l.stream == nil {
		return nil
	}
	return l.stream.Fence(ctx)
}

// foundStored settles a row the read-back found stored (G18) as acked
// with the stored sequence, at once and through the same path as an ack.
// It publishes nothing, so it never waits for room in flight nor enters
// the collector's queue: counted in flight there without a room check, the
// found rows of a replay filled the queue, and the loop and the collector
// blocked on each other (--atomic-transactions with 100-row transactions
// and --max-in-flight 8 or 64: the slot frozen, SIGTERM ignored).
func (l *loop) foundStored(ctx context.Context, it *item, ack sinks.Ack) error {
	l.r.metrics.ReadBackFound.Inc()
	l.inflight++
	l.inflightBytes += it.size
	it.ack, it.err = ack, nil
	return l.handleResult(ctx, it)
}

// checkInvariants makes the loop assert its invariants (tests).
var checkInvariants bool

// assertInvariants panics when the in-flight bound is broken.
func (l *loop) assertInvariants() {
	if !checkInvariants {
		return
	}
	if l.inflight < 0 || l.inflight > max(l.r.cfg.MaxInFlight, 1) ||
		l.inflightBytes < 0 || l.inflight > 1 && l.inflightBytes > l.r.cfg.MaxInFlightBytes && l.atomic == nil {
		panic(fmt.Sprintf("relay loop: in flight %d rows, %d bytes, against --max-in-flight %d and --max-in-flight-bytes %d",
			l.inflight, l.inflightBytes, l.r.cfg.MaxInFlight, l.r.cfg.MaxInFlightBytes))
	}
}

// published counts a row in flight with its future.
func (l *loop) published(it *item, fut sinks.Future) error {
	it.fut = fut
	l.inflight++
	l.inflightBytes += it.size
	l.assertInvariants()
	l.r.metrics.InFlight.Set(float64(l.inflight))
	l.r.metrics.InFlightBytes.Set(float64(l.inflightBytes))
	l.queue <- it // never blocks: its capacity exceeds MaxInFlight
	return nil
}

// reject hands a row the broker will never take to the poller (G7): the
// stream goes on, and the row is retried later and dead-lettered after max
// attempts, with the reason kept in last_error.
func (l *loop) reject(it *item, re *wire.RejectedError) {
	l.r.log.Warn().Str("work_id", it.workID).Str("reason", re.Reason).Err(re.Err).Msg("broker rejected row; handing it to the poller")
	l.r.metrics.Published.WithLabelValues("cdc", "rejected").Inc()
	l.r.metrics.Failures.WithLabelValues("rejected", re.Reason).Inc()
	l.r.metrics.Handoffs.WithLabelValues("rejected").Inc()
	it.settle.Outcome = store.Rejected
	it.settle.Error = store.ClassRejected.Note(re.Reason + ": " + re.Err.Error())
	it.settle.RetryMs = l.r.cfg.RejectRetry.Milliseconds()
	l.handOff(it)
	l.refused(it)
}

// handOff queues a row for the settler that moves it to the poller, and
// holds its aggregate behind it.
func (l *loop) handOff(it *item) {
	l.free(it)
	l.order.handedOff(it)
	l.settle.add(it)
}

// free gives the row's bytes back to the budget once the loop holds its
// payload no more: acked, or handed to the poller (which reads it from the
// table again).
func (l *loop) free(it *item) {
	l.budget.Release(it.held)
	it.held = 0
}

// collect waits for every future in publish order and hands the answers
// to the loop in groups. A group is what was published before its first
// answer was waited for: the collector waits for its last message first
// (acks mostly arrive in order, so the others are in by then), then checks
// each in order (a completed group can hold failures). A trickle of small
// transactions then wakes the collector and the loop once per group the
// stream handed over, not once per ack.
func (l *loop) collect(ctx context.Context) {
	defer l.wg.Done()
	for {
		it, ok := <-l.queue
		if !ok {
			return
		}
		batch := append(make([]*item, 0, 16), it)
	more:
		for len(batch) < maxCollect {
			select {
			case n, ok := <-l.queue:
				if !ok {
					break more
				}
				batch = append(batch, n)
			default:
				break more
			}
		}
		last := batch[len(batch)-1]
		last.ack, last.err = last.fut.Wait(ctx)
		for _, n := range batch[:len(batch)-1] {
			n.ack, n.err = n.fut.Wait(ctx)
		}
		select {
		case l.results <- batch:
		case <-ctx.Done():
			return
		}
	}
}

// maxCollect bounds the acks handed to the loop at once.
const maxCollect = 256

func (l *loop) handleResult(ctx context.Context, it *item) error {
	l.inflight--
	l.inflightBytes -= it.size
	if it.batchHead {
		l.atomic.counted(l, it)
	}
	if it.err != nil {
		if errors.Is(it.err, sinks.ErrBatchRefused) {
			return l.atomic.republish(ctx, l, it)
		}
		if re, ok := l.refusal(it, it.err); ok {
			l.reject(it, re)
			return nil
		}
		l.r.metrics.Published.WithLabelValues("cdc", "error").Inc()
		// An outage: no per-row writes. End the session; the next one
		// resumes from the slot and republishes under the same IDs.
		return fmt.Errorf("%w: %w", errOutage, it.err)
	}
	it.settle.Error = ""
	l.r.unrecognised.forget(it.workID)
	if it.ack.Duplicate {
		l.publishedDup.Inc()
		l.r.metrics.Duplicates.Inc()
		// The broker kept the message it already had under this ID: the
		// same content after a restart, or a reused work_id whose new
		// content is lost. Only the stored message can tell, so the row
		// says which one it points at.
		it.settle.Error = store.DuplicateNote(it.ack.Stream, it.ack.Sequence)
		l.r.repeats.Add(it.workID, it.ack.Stream, it.ack.Sequence)
		l.pos.earlier(it.ack.Stream, it.ack.Sequence, it.txn)
	} else {
		l.publishedOK.Inc()
		l.pos.acked(it.ack.Stream, it.ack.Sequence)
	}
	l.r.metrics.CommitToAck.Observe(time.Since(it.commitTime).Seconds())
	it.settle.Outcome = store.Published
	it.settle.Seq = it.ack.Sequence
	it.settle.Stream = it.ack.Stream
	l.r.acked.raise(it.ack.Stream, it.ack.Sequence, it.workID)
	// Only what the mark needs stays: the message (payload and headers)
	// and its future are garbage from here.
	it.msg, it.fut = nil, nil
	l.free(it)
	l.settle.add(it)
	if next := l.acked(it); next != nil {
		// Its turn: the predecessor is stored. It was counted against the
		// WAL reading (parked), not against in-flight room.
		return l.publish(ctx, next)
	}
	return nil
}

// handleSettled takes a settle statement's answer: the rows it settled
// count off their transactions (and their aggregates), which may move the
// confirmation; the batcher tries the others again.
func (l *loop) handleSettled(res settleResult, confirms chan replication.LSN) error {
	settled, err := l.settle.take(res)
	if err != nil {
		return err
	}
	now := time.Now()
	heldOver := false
	for _, it := range settled {
		l.cp.Settle(it.txn)
		l.order.settled(it, now)
		heldOver = heldOver || it.settle.Outcome == store.Held
	}
	l.advance(confirms)
	if heldOver && l.r.cfg.HandedOver != nil {
		l.r.cfg.HandedOver()
	}
	return nil
}

func (l *loop) advance(confirms chan replication.LSN) {
	if lsn, moved := l.cp.Advance(); moved {
		l.r.metrics.ConfirmedLSN.Set(float64(lsn))
		l.pos.confirmed(lsn, l.cp)
		sendConfirm(confirms, lsn)
		if t := l.cp.Oldest(); t != nil {
			l.r.oldestOpen.Store(t.CommitTime.UnixNano())
		} else {
			l.r.oldestOpen.Store(0)
		}
	}
}

// sendConfirm offers the newest position; an older one still waiting in the
// channel is replaced, since the newer one covers it.
func sendConfirm(ch chan replication.LSN, lsn replication.LSN) {
	select {
	case ch <- lsn:
		return
	default:
	}
	select {
	case <-ch:
	default:
	}
	ch <- lsn
}
