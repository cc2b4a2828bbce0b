package relay

import (
	"context"
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// A transaction whole on the broker (run --atomic-transactions, G20). The
// rows of a transaction that this path publishes wait in the loop until
// its Commit event, then go to the broker as one atomic batch: stored all
// together or not at all. Everything else about a row is as without the
// option: rows for the poller (delayed, near their deadline, refused by
// BuildMessage or by the sink) leave before the batch, each row keeps its
// Nats-Msg-Id, its ack settles it, and the slot is confirmed past a
// transaction only once every row of it is settled (G3).
//
// Bounds. A batch holds at most AtomicBatchMax rows (the server's
// max_batch_size, 1,000 by default), MaxInFlight rows, and the bytes of
// atomicBytes: a transaction larger than that goes as consecutive batches,
// in commit order, each stored whole (counted in
// outbox_relay_atomic_split_transactions_total). So the rows held for a
// batch are bounded like rows in flight (G15), and a 10-million-row
// transaction is streamed batch by batch, never held.
//
// A batch the broker refuses whole (sinks.ErrBatchRefused: a Nats-Msg-Id
// it already holds, as in a replay after a crash or a transaction partly
// stored row by row before; a row it refuses; a batch it found incomplete)
// stored nothing: each of its rows is published again alone, and each
// gets its own answer (a duplicate that names the stored sequence, a
// rejection that hands the row to the poller, a new message). Such a
// transaction is whole on the broker once its last row is stored.
//
// With --ordering aggregate a row waits for its aggregate's previous row's
// ack, which would cut a transaction into pieces: the combination is
// refused at start (app.Options.validate).
type atomicState struct {
	batcher  sinks.Batcher
	maxRows  int
	maxBytes int

	open      []*item // the open transaction's rows not yet in a batch
	openBytes int
	parts     int // batches of the open transaction made so far

	// waiting is a batch that waits for in-flight room; reading waits
	// with it (loop.mayRead).
	waiting      []*item
	waitingBytes int

	stored, refused, split prometheus.Counter
}

func newAtomicState(r *Relay) *atomicState {
	b, _ := r.sink.(sinks.Batcher)
	return &atomicState{
		batcher:  b,
		maxRows:  max(2, min(r.cfg.AtomicBatchMax, r.cfg.MaxInFlight)),
		maxBytes: atomicBytes(r.cfg),
		stored:   r.metrics.AtomicBatches.WithLabelValues("stored"),
		refused:  r.metrics.AtomicBatches.WithLabelValues("refused"),
		split:    r.metrics.AtomicSplit,
	}
}

// atomicBytes is the most bytes of rows one batch holds: what may be in
// flight, and a quarter of the session's byte budget, so that the rows
// waiting for a batch, a batch waiting for room and the rows in flight
// never spend the budget while the Commit is still unread.
func atomicBytes(c Config) int {
	return max(1, min(c.MaxInFlightBytes, c.MaxBufferedBytes/4))
}

// add takes a ready row of the open transaction, with its message built.
func (a *atomicState) add(ctx context.Context, l *loop, it *item) error {
	if ack, ok := l.found(it); ok {
		// Stored before the restart (the read-back, G18): settled with
		// its sequence, not sent again; the rest of its transaction goes
		// as a batch.
		return l.foundStored(ctx, it, ack)
	}
	if len(a.open) > 0 && a.openBytes+it.size > a.maxBytes {
		if err := a.flush(ctx, l); err != nil {
			return err
		}
	}
	a.open = append(a.open, it)
	a.openBytes += it.size
	if len(a.open) >= a.maxRows {
		return a.flush(ctx, l)
	}
	return nil
}

// commit ends the open transaction: its last batch goes.
func (a *atomicState) commit(ctx context.Context, l *loop) error {
	var err error
	if len(a.open) > 0 {
		err = a.flush(ctx, l)
	}
	if a.parts > 1 {
		a.split.Inc()
	}
	a.parts = 0
	return err
}

// flush makes a batch of the open rows: sent now, or waiting for room.
func (a *atomicState) flush(ctx context.Context, l *loop) error {
	if a.waiting != nil {
		// Reading stops while a batch waits, so no second one is made.
		return errors.New("atomic batch made while another waits for room")
	}
	b, n := a.open, a.openBytes
	a.open, a.openBytes = nil, 0
	a.parts++
	if !a.hasRoom(l, len(b), n) {
		a.waiting, a.waitingBytes = b, n
		return nil
	}
	return a.sendReuse(ctx, l, b)
}

// sendReuse sends b and keeps its array for the next transaction's rows
// (one allocation less per transaction at one row each).
func (a *atomicState) sendReuse(ctx context.Context, l *loop, b []*item) error {
	err := a.send(ctx, l, b)
	if a.open == nil {
		clear(b)
		a.open = b[:0]
	}
	return err
}

// takeWaiting sends the batch waiting for room once there is room.
func (a *atomicState) takeWaiting(ctx context.Context, l *loop) error {
	if a.waiting == nil || l.stop.draining() || !a.hasRoom(l, len(a.waiting), a.waitingBytes) {
		return nil
	}
	b := a.waiting
	a.waiting, a.waitingBytes = nil, 0
	return a.sendReuse(ctx, l, b)
}

// hasRoom: a batch fits in flight whole, or alone.
func (a *atomicState) hasRoom(l *loop, rows, bytes int) bool {
	return l.inflight == 0 || l.inflight+rows <= l.r.cfg.MaxInFlight && l.inflightBytes+bytes <= l.r.cfg.MaxInFlightBytes
}

// send publishes b as one atomic batch (a single row as a plain message:
// it is stored whole anyway).
func (a *atomicState) send(ctx context.Context, l *loop, b []*item) error {
	// A row whose deadline came near while its batch waited is not
	// published (G13): the rest of its transaction goes without it.
	kept := b[:0]
	for _, it := range b {
		if !l.expiring(it) {
			kept = append(kept, it)
		}
	}
	b = kept
	if len(b) == 0 {
		return nil
	}
	if len(b) == 1 {
		return l.publish(ctx, b[0])
	}
	if err := l.fence(ctx); err != nil {
		return err
	}
	msgs := make([]*wire.Message, len(b))
	for i, it := range b {
		msgs[i] = it.msg
	}
	futs, errs, err := a.batcher.PublishBatch(ctx, msgs)
	if err != nil {
		l.r.metrics.Published.WithLabelValues("cdc", "error").Inc()
		return fmt.Errorf("%w: %w", errOutage, err)
	}
	head := true
	for i, it := range b {
		if errs[i] != nil {
			// Refused alone before anything was sent: the poller's, like
			// a row BuildMessage refuses; the batch went without it.
			re, _ := wire.IsRejected(errs[i])
			l.reject(it, re)
			continue
		}
		it.fut, it.batchHead = futs[i], head
		head = false
		l.inflight++
		l.inflightBytes += it.size
		l.queue <- it // never blocks: its capacity exceeds MaxInFlight, which bounds a batch
	}
	l.r.metrics.InFlight.Set(float64(l.inflight))
	l.r.metrics.InFlightBytes.Set(float64(l.inflightBytes))
	return nil
}

// counted counts the batch whose first row's result it is.
func (a *atomicState) counted(l *loop, it *item) {
	it.batchHead = false
	switch {
	case it.err == nil:
		a.stored.Inc()
	case errors.Is(it.err, sinks.ErrBatchRefused):
		a.refused.Inc()
		l.r.log.Warn().Str("work_id", it.workID).Err(it.err).
			Msg("the broker refused a transaction's batch whole, storing nothing of it; publishing its rows one by one (each is stored once, by its Nats-Msg-Id)")
	}
}

// republish publishes alone a row whose batch the broker refused whole.
func (a *atomicState) republish(ctx context.Context, l *loop, it *item) error {
	if err := l.fence(ctx); err != nil {
		return err
	}
	fut, err := a.batcher.Republish(ctx, it.msg)
	if err != nil {
		if re, ok := wire.IsRejected(err); ok {
			l.reject(it, re)
			return nil
		}
		l.r.metrics.Published.WithLabelValues("cdc", "error").Inc()
		return fmt.Errorf("%w: %w", errOutage, err)
	}
	it.fut, it.err = fut, nil
	l.inflight++
	l.inflightBytes += it.size
	l.queue <- it
	return nil
}
