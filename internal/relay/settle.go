package relay

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// settleBatcher turns the rows the loop is done with (acked, handed to the
// poller, rejected) into settle statements, one at a time, in the
// background: a batch goes once it holds SettleBatch rows or its oldest row
// waited SettleDelay (at one row per transaction this groups a few marks
// per statement instead of one statement per ack; the delay holds back the
// mark and the confirmation, never the publish). A row the statement did
// not settle (its transaction streamed before it was visible) is tried
// again after a backoff. River's BatchCompleter is the model.
//
// The loop's goroutine owns it: add, due, take and the timers' handlers
// run there; only run, the background statement, runs on its own, and it
// touches nothing but the batches it is sent.
type settleBatcher struct {
	store   *store.Store
	size    int
	delay   time.Duration
	retries prometheus.Counter
	log     zerolog.Logger

	pending      []*item   // waiting for the next statement
	pendingSince time.Time // when the oldest of pending arrived
	retry        []*item   // settled too early (not visible yet), each due at its retryAt
	settling     bool      // a statement is out

	// timer wakes the loop at timerAt (zero: stopped), the earlier of the
	// oldest pending row's backstop and the next retry's retryAt; the loop
	// calls woke.
	timer   *time.Timer
	timerAt time.Time

	req  chan []*item
	resp chan settleResult
}

type settleResult struct {
	batch   []*item
	settled []bool
	err     error
}

// settleBackstop: a partial batch waits at most this many SettleDelays when
// no step of the loop comes before.
const settleBackstop = 2

func newSettleBatcher(r *Relay) *settleBatcher {
	b := &settleBatcher{
		store: r.store, size: r.cfg.SettleBatch, delay: r.cfg.SettleDelay,
		retries: r.metrics.SettleRetries, log: r.log,
		timer: time.NewTimer(time.Hour),
		req:   make(chan []*item), resp: make(chan settleResult, 1),
	}
	b.timer.Stop()
	return b
}

// add queues a row for the next statement.
func (b *settleBatcher) add(it *item) { b.pending = append(b.pending, it) }

// unsettled counts the rows queued or waiting to be tried again.
func (b *settleBatcher) unsettled() int { return len(b.pending) + len(b.retry) }

// idle says nothing is queued, out or waiting to be tried again.
func (b *settleBatcher) idle() bool { return !b.settling && b.unsettled() == 0 }

// due sends the next statement when its batch is full, its oldest row has
// waited the delay, or the loop is stopping (stopping: no waiting). It is
// checked at every step of the loop, and a trickle of transactions brings a
// step every millisecond or two: the timer is a backstop, set
// settleBackstop delays out, that wakes the loop only when no step came.
// Set for the delay itself, it fired between the groups, one wake-up of
// the process more per settle.
func (b *settleBatcher) due(stopping bool) {
	if len(b.pending) > 0 && b.pendingSince.IsZero() {
		b.pendingSince = time.Now()
	}
	if b.settling || len(b.pending) == 0 {
		return
	}
	if !stopping && len(b.pending) < b.size {
		if wait := b.delay - time.Since(b.pendingSince); wait > 0 {
			b.wakeBy(b.pendingSince.Add(settleBackstop * b.delay))
			return
		}
	}
	b.pendingSince = time.Time{}
	// Set for rows this statement takes: left running, it would wake the
	// loop for nothing.
	b.timer.Stop()
	b.timerAt = time.Time{}
	b.armRetry()
	n := min(len(b.pending), b.size)
	batch := make([]*item, n)
	copy(batch, b.pending)
	b.pending = append(b.pending[:0], b.pending[n:]...)
	b.settling = true
	b.req <- batch
}

// results delivers the statements' answers, for take.
func (b *settleBatcher) results() <-chan settleResult { return b.resp }

// wake fires when a partial batch has waited its backstop or a row is due
// to be tried again; the loop calls woke, and due at its next step.
func (b *settleBatcher) wake() <-chan time.Time { return b.timer.C }

// wakeBy sets the timer for t unless it is set for earlier.
func (b *settleBatcher) wakeBy(t time.Time) {
	if b.timerAt.IsZero() || t.Before(b.timerAt) {
		b.timer.Reset(time.Until(t))
		b.timerAt = t
	}
}

// woke queues the rows due to be tried again, and sets the timer for the
// next; due sets it for a partial batch's backstop.
func (b *settleBatcher) woke() {
	b.timerAt = time.Time{}
	now := time.Now()
	keep := b.retry[:0]
	for _, it := range b.retry {
		if !it.retryAt.After(now) {
			b.pending = append(b.pending, it)
		} else {
			keep = append(keep, it)
		}
	}
	clear(b.retry[len(keep):])
	b.retry = keep
	b.armRetry()
}

// take reads a statement's answer and returns the rows it settled; the
// others are tried again after a backoff. Streamed before visible: the
// commit is flushed but the backend has not left the proc array yet (a
// synchronous standby can hold it there); or the row is not in the table
// while a partition of it is detached (store.goneForAReason). Never
// confirm on a silent zero: try again.
func (b *settleBatcher) take(res settleResult) ([]*item, error) {
	b.settling = false
	if res.err != nil {
		return nil, res.err
	}
	now := time.Now()
	settled := make([]*item, 0, len(res.batch))
	for i, it := range res.batch {
		if res.settled[i] {
			settled = append(settled, it)
			continue
		}
		it.tries++
		b.retries.Inc()
		if it.tries == 50 || it.tries%500 == 0 {
			b.log.Warn().Str("work_id", it.workID).Uint32("xid", it.settle.Xid).Int("tries", it.tries).
				Msg("row streamed but not settled yet: its transaction is not visible yet (a commit waiting for a synchronous standby?), or it is not in the table while a partition is detached (outbox-relay status names it; prune or the relay's partition keeper attaches it back); holding the checkpoint")
		}
		it.retryAt = now.Add(min(time.Millisecond<<min(it.tries, 10), time.Second))
		b.retry = append(b.retry, it)
	}
	b.armRetry()
	return settled, nil
}

func (b *settleBatcher) armRetry() {
	if len(b.retry) == 0 {
		return
	}
	next := b.retry[0].retryAt
	for _, it := range b.retry[1:] {
		if it.retryAt.Before(next) {
			next = it.retryAt
		}
	}
	b.wakeBy(next)
}

// run is the background statement: it settles each batch it is sent and
// answers, until close or ctx ends.
func (b *settleBatcher) run(ctx context.Context) {
	for batch := range b.req {
		items := make([]store.Settle, len(batch))
		for i, it := range batch {
			items[i] = it.settle
		}
		settled, err := b.store.SettleRows(ctx, items)
		select {
		case b.resp <- settleResult{batch: batch, settled: settled, err: err}:
		case <-ctx.Done():
			return
		}
	}
}

// close ends run once it answered the statement it has.
func (b *settleBatcher) close() { close(b.req) }
