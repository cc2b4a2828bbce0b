package relay

import (
	"context"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/replication"
)

// admission is what becomes of a ready row the stream brought: admit's
// answer, which handleRow carries out.
type admission uint8

const (
	// toPoller: the row is the poller's (it.settle says as what; the
	// reason is the hand-off metric's label).
	toPoller admission = iota + 1
	// refused: it cannot be a message; reject handed it to the poller.
	refused
	// parked: it waits for its aggregate's row in flight (--ordering).
	parked
	// batched: it joins its transaction's batch (--atomic-transactions).
	batched
	// waits: it waits for room in flight.
	waits
	// send: publish it now (publish still settles a row the read-back
	// found stored without publishing it, and hands one whose deadline
	// came meanwhile to the poller).
	send
)

// admit decides what becomes of a ready row: the one place where each
// optional feature that can keep a row from being published now (a row
// handed back as lost, a deadline, a delay, order per aggregate, atomic
// batches, the in-flight bound) has its rule, in this order. It builds the
// row's message for every row it does not hand to the poller.
func (l *loop) admit(ctx context.Context, it *item, row *replication.Row) (a admission, why string) {
	if _, ok := l.pollerOwns[row.WorkID]; ok {
		it.settle.Outcome = store.Delayed
		return toPoller, "lost"
	}
	// A deadline is decided on the database clock (measured, not
	// assumed; the poller decides in SQL): near or past it, the row is not
	// this path's to publish (G13). Counted as a hand-off only: the
	// poller's sweep counts the row in expired_total when it ends expired,
	// and a row is counted there once.
	if !row.ExpiresAt.IsZero() && !row.ExpiresAt.After(l.r.deadlineNow().Add(l.r.cfg.DeadlineMargin)) {
		it.settle.Outcome = store.Delayed
		return toPoller, "deadline"
	}
	// Decided from the commit time in the WAL, never the relay's clock, so
	// a replay decides the same way.
	if row.AvailableAt.After(l.curCommitTime) {
		it.settle.Outcome = store.Delayed
		return toPoller, "delayed"
	}
	t := l.orderTurn(ctx, it)
	if t == heldBack {
		return toPoller, "held"
	}
	if err := l.buildMessage(it, row); err != nil {
		re, _ := wire.IsRejected(err)
		l.reject(it, re)
		return refused, ""
	}
	switch {
	case t == waitTurn:
		return parked, ""
	case l.atomic != nil:
		return batched, ""
	case !l.hasRoom(it.size):
		return waits, ""
	}
	return send, ""
}

// buildMessage builds the row's message in the relay's format, with the
// headers its transaction's rows share.
func (l *loop) buildMessage(it *item, row *replication.Row) error {
	var aggSeq int64
	var aggType, aggID string
	if row.Aggregate != nil {
		aggType, aggID, aggSeq = row.Aggregate.Type, row.Aggregate.ID, row.Aggregate.Seq
	}
	if l.curHeaders == nil {
		l.curHeaders = cdcSharedHeaders(l.curCommitLSN, l.curCommitTime)
	}
	msg, err := l.r.cfg.Format.Build(wire.Row{
		WorkID: row.WorkID, Kind: row.Kind, Subject: row.Subject, Payload: row.Payload, Headers: row.Headers,
		AggregateType: aggType, AggregateID: aggID, AggregateSeq: aggSeq, ExpiresAt: row.ExpiresAt,
		CreatedAt: row.CreatedAt, Binary: row.Binary,
	}, l.curHeaders)
	if err != nil {
		return err
	}
	it.msg, it.size = msg, msg.Size()
	return nil
}
