package relay

import (
	"context"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// Order of work per aggregate on the CDC path (run --ordering aggregate,
// G12). Two rules keep a receiver from seeing sequence n+1 before n:
//
//   - While a row of an aggregate is with the poller (delayed, rejected,
//     near its deadline, or from before this session: 'scheduled',
//     'running', 'failed'), the aggregate is held: its later rows go to the
//     poller too, as 'held' rows, and the poller claims an aggregate's rows
//     as one run from its lowest unpublished sequence, published in order.
//   - One row of an aggregate is in flight at a time: a broker can refuse a
//     message at ack time (a stream's max message size), after the next one
//     would already have been stored. Later rows of the aggregate wait in
//     memory for that ack; other aggregates never wait.
//
// The held set is read from the table when a session starts (so it
// survives restarts), grows as this session hands rows over, and is read
// again while it is not empty, to release the aggregates whose rows the
// poller has published. With nothing held the CDC path asks nothing per row.
//
// That read alone never releases an aggregate that keeps receiving rows
// faster than it runs: each read finds the row handed over last. So a new
// row of a held aggregate asks the table first (store.WithPoller) whether
// anything of the aggregate is still with the poller; when nothing is and
// this session has no handoff of it the table may not show yet, the poller
// has caught up and the row is the CDC path's again. Its predecessors are
// all decoded by then (next_seq's lock orders the commits) and settled:
// published (acked), or still in this session's chain, behind which it
// waits.

// The CDC loop calls the rules at three points, and nowhere else decides
// anything about order: orderTurn, from admit, when a ready row arrives
// (publish it, park it behind its aggregate's row in flight, or hand it to
// the poller as held); acked, when the broker stored a row (the next row of its
// aggregate, if one waits); refused, when a row goes to the poller
// (the rows that waited behind it follow it there). Two notes keep the
// held set's bookkeeping: handedOff and settled. Without --ordering
// aggregate the loop's orderState is nil and every call does nothing.

// turn is orderTurn's answer for a row.
type turn int

const (
	sendNow  turn = iota // publish it (as room allows)
	waitTurn             // park it: its aggregate's row in flight is not acked yet
	heldBack             // to the poller (settle set): its aggregate is held
)

// orderTurn decides a new ready row's turn. A row of a held aggregate goes to
// the poller (unless the poller has caught up with the aggregate); one
// whose aggregate has a row in flight waits for that row's ack: publishing
// now could store it first if the broker refuses that one. A row sent now
// becomes its aggregate's row in flight.
func (l *loop) orderTurn(ctx context.Context, it *item) turn {
	if !it.ordered {
		return sendNow
	}
	o := l.order
	if blocker, held := o.heldBy(it.agg); held && !l.caughtUp(ctx, it.agg) {
		it.settle.Outcome = store.Held
		it.settle.Error = store.ClassHeld.Note("waiting for " + blocker + " (an earlier row of aggregate " + it.agg.String() + ")")
		return heldBack
	}
	if o.busy(it.agg) {
		return waitTurn
	}
	o.started(it)
	return sendNow
}

// acked returns the row of it's aggregate whose turn came with it's ack,
// now its aggregate's row in flight; nil if none waits (or the session is
// stopping: the rest goes to the next session).
func (l *loop) acked(it *item) *item {
	if !it.ordered || l.stop.draining() {
		return nil
	}
	return l.order.next(it)
}

// refused hands the rows that waited for it's ack to the poller behind it:
// it was rejected, and they wait behind it at the poller now.
func (l *loop) refused(it *item) {
	if !it.ordered {
		return
	}
	for _, w := range l.order.finished(it) {
		w.msg = nil
		w.settle.Outcome = store.Held
		w.settle.Error = store.ClassHeld.Note("waiting for " + it.workID + " (an earlier row of aggregate " + w.agg.String() + ")")
		l.r.metrics.Handoffs.WithLabelValues("held").Inc()
		l.handOff(w)
	}
}

// refreshed applies a read of the held aggregates from the refresher.
func (l *loop) refreshed(res heldRefresh) {
	if res.err != nil {
		l.r.log.Warn().Err(res.err).Msg("could not read the held aggregates; they stay held until the next read")
		return
	}
	l.order.refreshed(res)
}

// caughtUp asks the table, for a new row of held aggregate k, whether the
// poller has caught up with k, and if so takes k back. A failed read keeps
// k held: the row goes to the poller, which is always safe.
func (l *loop) caughtUp(ctx context.Context, k store.AggregateKey) bool {
	if !l.order.mayRelease(k) {
		return false
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	with, err := l.r.store.WithPoller(qctx, k)
	cancel()
	if err != nil {
		l.r.log.Warn().Err(err).Msg("could not read whether a held aggregate is caught up; its row goes to the poller")
		return false
	}
	if with {
		return false
	}
	l.order.release(k, time.Now())
	l.r.log.Debug().Str("aggregate_type", k.Type).Str("aggregate_id", k.ID).Msg("the poller caught up with a held aggregate; the CDC path publishes it again")
	return true
}

// orderState is the loop's per-aggregate state; it belongs to the loop's
// goroutine, except active, which the refresher reads.
type orderState struct {
	held   map[store.AggregateKey]*hold
	chains map[store.AggregateKey]*chain
	// released: aggregates taken back from the poller by this session, and
	// when; a read of the held set begun before that is older news.
	released map[store.AggregateKey]time.Time
	parked   int         // rows waiting in chains, not yet published
	active   atomic.Bool // len(held) > 0, for the refresher
}

// hold is one held aggregate: the row the others wait for, and this
// session's handoffs of the aggregate that the table may not show yet.
type hold struct {
	blocker   string
	unsettled int       // handoffs not yet committed by the settler
	settledAt time.Time // when the last one was
}

// chain is one aggregate's row in flight and the rows behind it.
type chain struct {
	inflight *item
	queue    []*item
}

type heldRefresh struct {
	startedAt time.Time
	held      map[store.AggregateKey]string
	err       error
}

func newOrderState(held map[store.AggregateKey]string) *orderState {
	o := &orderState{held: map[store.AggregateKey]*hold{}, chains: map[store.AggregateKey]*chain{}, released: map[store.AggregateKey]time.Time{}}
	for k, blocker := range held {
		o.held[k] = &hold{blocker: blocker}
	}
	o.active.Store(len(o.held) > 0)
	return o
}

// heldBy returns the row an aggregate's new rows wait for, if it is held.
func (o *orderState) heldBy(k store.AggregateKey) (string, bool) {
	h, ok := o.held[k]
	if !ok {
		return "", false
	}
	return h.blocker, true
}

// handedOff records that it (a row of k) goes to the poller: k is held
// from now on, behind it unless an earlier row already holds it.
func (o *orderState) handedOff(it *item) {
	if !it.ordered {
		return
	}
	h, ok := o.held[it.agg]
	if !ok {
		h = &hold{blocker: it.workID}
		o.held[it.agg] = h
		o.active.Store(true)
	}
	h.unsettled++
	it.holds = true
}

// mayRelease reports whether k's hold could end on the table's word: no
// handoff of k by this session is waiting for its settle. (The loop asks
// the table after every settle it saw committed, so none it misses.)
func (o *orderState) mayRelease(k store.AggregateKey) bool {
	h, ok := o.held[k]
	return ok && h.unsettled == 0
}

// release ends k's hold: the poller has nothing of k left.
func (o *orderState) release(k store.AggregateKey, now time.Time) {
	delete(o.held, k)
	for r, at := range o.released {
		// A read of the held set ends within seconds (its timeout is
		// 10 s); older entries can no longer meet one.
		if now.Sub(at) > time.Minute {
			delete(o.released, r)
		}
	}
	o.released[k] = now
	o.active.Store(len(o.held) > 0)
}

// settled records that the settle of a handed-off row committed.
func (o *orderState) settled(it *item, now time.Time) {
	if !it.holds {
		return
	}
	if h, ok := o.held[it.agg]; ok && it.holds {
		h.unsettled--
		h.settledAt = now
	}
}

// busy reports whether a row of k is in flight or waiting.
func (o *orderState) busy(k store.AggregateKey) bool {
	c, ok := o.chains[k]
	return ok && (c.inflight != nil || len(c.queue) > 0)
}

func (o *orderState) park(it *item) {
	c := o.chains[it.agg]
	c.queue = append(c.queue, it)
	o.parked++
}

func (o *orderState) started(it *item) {
	c, ok := o.chains[it.agg]
	if !ok {
		c = &chain{}
		o.chains[it.agg] = c
	}
	c.inflight = it
}

// finished ends it's flight and returns the rows of its aggregate that were
// waiting for it; the chain is gone.
func (o *orderState) finished(it *item) []*item {
	c, ok := o.chains[it.agg]
	if !ok {
		return nil
	}
	delete(o.chains, it.agg)
	o.parked -= len(c.queue)
	return c.queue
}

// next takes the next waiting row of it's aggregate after it was acked; it
// is the aggregate's row in flight from now on.
func (o *orderState) next(it *item) *item {
	c, ok := o.chains[it.agg]
	if !ok {
		return nil
	}
	c.inflight = nil
	if len(c.queue) == 0 {
		delete(o.chains, it.agg)
		return nil
	}
	n := c.queue[0]
	c.queue = c.queue[1:]
	o.parked--
	c.inflight = n
	return n
}

// refreshed applies a read of the table's held aggregates taken at
// r.startedAt. An aggregate stays held while this session has a handoff of
// it the read may not have seen (unsettled, or settled after the read
// began); otherwise the table decides.
func (o *orderState) refreshed(r heldRefresh) {
	for k, h := range o.held {
		if blocker, ok := r.held[k]; ok {
			h.blocker = blocker
			continue
		}
		if h.unsettled > 0 || h.settledAt.After(r.startedAt) {
			continue
		}
		delete(o.held, k)
	}
	for k, blocker := range r.held {
		if _, ok := o.held[k]; ok {
			continue
		}
		if at, ok := o.released[k]; ok && at.After(r.startedAt) {
			continue // taken back after this read began
		}
		o.held[k] = &hold{blocker: blocker}
	}
	for k, at := range o.released {
		if !at.After(r.startedAt) {
			delete(o.released, k)
		}
	}
	o.active.Store(len(o.held) > 0)
}

// refresher reads the held aggregates every interval while any is held, and
// sends each read to out.
func refresher(ctx context.Context, st *store.Store, o *orderState, every time.Duration, out chan<- heldRefresh) {
	pollWhile(ctx, every, o.active.Load, func() heldRefresh {
		r := heldRefresh{startedAt: time.Now()}
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		r.held, r.err = st.HeldAggregates(qctx)
		cancel()
		return r
	}, out)
}

// pollWhile runs read every interval while want reports true, and sends
// each result to out, until ctx ends. Nothing is read while nothing is
// wanted: an idle relay asks the database nothing.
func pollWhile[T any](ctx context.Context, every time.Duration, want func() bool, read func() T, out chan<- T) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !want() {
			continue
		}
		r := read()
		select {
		case out <- r:
		case <-ctx.Done():
			return
		}
	}
}
