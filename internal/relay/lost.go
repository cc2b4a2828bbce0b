package relay

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// Acknowledged, then lost (G19). JetStream acknowledges a message before
// it syncs it to disk; a broker that loses power (or whose store is cut)
// comes back with a stream that ends below sequences it acknowledged. The
// rows say published and the slot is confirmed past them: nothing would
// publish them again. So at every session start, before the first
// publish, and every LostCheckInterval, the relay reads its own stream's
// state and compares it with what it recorded.
//
// Under --on-publish mark each row carries the stream and sequence it was
// stored at: the rows of the relay's own stream past the stream's last
// sequence (and published since the stream was created: a stream created
// again starts over) are handed back to the poller, which publishes them
// again with their Nats-Msg-Id. Rows below the stream's first sequence
// were removed by the stream's own limits, not lost, and are left alone.
//
// Under none and delete nothing per row is kept; the relay compares the
// stream's last sequence with the highest it saw acknowledged in this
// process and reports a shortfall (log at error, the metric), without
// republishing: the rows to publish again are not known from the table.
// Under none the log names the republish command, which finds them by
// looking the published rows up in the stream; under delete they are gone.

// lostLookback bounds the check at a session start that has seen no
// acknowledgement above the stream's end (a process just started: a
// relay restarted with its broker after a power loss) to the rows created
// this long ago or less, read through the index on created_at, not every
// published row of the table (G16). A broker loses what it acknowledged
// and had not yet synced (sync_interval: 2 minutes by default), so the
// rows it loses are recent: this covers that window and a restart up to
// about 28 minutes later. Rows created before it, and published in that
// window (a backlog drained just before the fault), are found only by a
// process that saw their acknowledgements.
const lostLookback = 30 * time.Minute

// DefaultLostCheckInterval is how often a running session checks the
// stream for lost messages between session starts.
const DefaultLostCheckInterval = time.Minute

// lostSinceMargin is taken off the process's start in the republish
// command the error log names under none: the database's clock dates the
// rows, this process's clock the start.
const lostSinceMargin = 5 * time.Minute

// lostCreatedMargin moves the stream's creation time earlier before the
// rows' published_at is compared with it: the two servers' clocks, and the
// measurement of their offset, may be off by that much.
const lostCreatedMargin = 5 * time.Second

// lostCheckTimeout bounds one check: a broker too slow to answer is
// checked again at the next interval.
const lostCheckTimeout = 30 * time.Second

// lostStateTimeout bounds the read of the stream's state within a check.
// A request sent while the client reconnects to a restarted broker can be
// lost with the old socket, and its answer then never comes: waiting the
// whole check's bound for it would hold the repair of what the restart
// lost for 30 s; asking again soon finds the new connection.
const lostStateTimeout = 5 * time.Second

// checkLost runs one check; errors are logged, never fatal (the check is
// a repair, not a condition of publishing). full reads the table under
// mark whatever the stream says (session starts; only the rows created
// within lostLookback when this process saw no shortfall); otherwise it is read
// only when the stream ends below the highest sequence this process's CDC
// path saw acknowledged, so the periodic check costs one StreamInfo, not a
// scan of the published rows, while nothing is lost. It returns the work
// IDs it handed back.
func (r *Relay) checkLost(ctx context.Context, full bool) (handed []string) {
	st, ok := r.sink.(sinks.StreamStater)
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, lostCheckTimeout)
	defer cancel()
	// What this process saw acknowledged is read before the stream's
	// state: an ack that arrives while the state is asked for is then
	// below the stream's end as read, never a loss (read the other way
	// round, 31 false reports in 30 s under load).
	seenBefore := r.acked.snapshot()
	// Likewise the rows recorded published after the state is read, by this
	// process's poller (the rows a session start hands it) or another
	// instance: a session start reads the database's clock first and leaves
	// them out (store.RequeueLost). Only there: a periodic check reads the
	// table only after a loss it saw, and stays free of queries otherwise.
	var recordedBefore time.Time
	if full && r.store.Policy() == store.PolicyMark {
		var err error
		if recordedBefore, err = r.store.Clock(ctx); err != nil {
			r.log.Warn().Err(err).Msg("could not read the database's clock to check for messages the broker lost; checking again later")
			return
		}
	}
	stateCtx, stateCancel := context.WithTimeout(ctx, lostStateTimeout)
	state, err := st.OwnStreamState(stateCtx)
	stateCancel()
	if err != nil {
		r.log.Warn().Err(err).Msg("could not read the stream's state to check for messages the broker lost; checking again later")
		return
	}
	seenAt := seenBefore[state.Stream]
	seen := seenAt.Seq
	if r.store.Policy() != store.PolicyMark {
		if seen > state.LastSeq {
			lost := seen - state.LastSeq
			r.metrics.BrokerLost.Add(float64(lost))
			ev := r.log.Error().Str("stream", state.Stream).Uint64("from_seq", state.LastSeq+1).Uint64("to_seq", seen).Uint64("messages", lost)
			if r.store.Policy() == store.PolicyNone {
				// The messages lost are the newest the broker acknowledged
				// and had not synced; this process acknowledged them all, so
				// none of their rows was created before it started (less a
				// margin for the clocks). A row created earlier and published
				// after the loss point (a backlog) is missed by this bound:
				// docs/runbook.md says how to widen it.
				since := r.started.Add(r.dbOffset() - lostSinceMargin).UTC().Format(time.RFC3339)
				ev.Str("command", "outbox-relay republish --on-publish none --since "+since).
					Msg("the broker lost messages it had acknowledged: the stream ends below sequences it acknowledged to this relay; " +
						"under --on-publish none the relay does not publish them again itself: run the command logged here (with this relay's --database-url, --nats-url, --table, --stream, --subject-prefix), " +
						"which looks the rows created since then up in the stream and publishes again those it does not hold (docs/runbook.md, \"The broker lost messages\")")
			} else {
				ev.Msg("the broker lost messages it had acknowledged: the stream ends below sequences it acknowledged to this relay; " +
					"under --on-publish delete the rows were deleted once acknowledged and cannot be published again from the table: republish them from their source (docs/runbook.md, \"The broker lost messages\")")
			}
			r.acked.lower(state.Stream, seen, state.LastSeq)
		}
		return
	}
	shortfall := seen > state.LastSeq
	// The stream may have lost its tail and taken new messages since, at
	// the sequences it lost (another instance publishing before this
	// check): its end is then back past what it lost, and only the message
	// at a recorded sequence tells. The one this process was last
	// acknowledged is read back (seed 1796657719126888718: 31 rows lost so).
	refilled := false
	if !shortfall && seenAt.ID != "" && seen >= state.FirstSeq && r.readMessageNow(full) {
		if id, ok := r.messageAt(ctx, seen); ok && id != seenAt.ID {
			refilled = true
		}
	}
	if !full && !shortfall && !refilled {
		return
	}
	// Both times are compared with the rows' times, which are
	// PostgreSQL's: the lookback is moved onto its clock, and the stream's
	// creation (the broker's) too, early by the figures' uncertainty and a
	// margin (a row of the stream's earlier life taken for lost is
	// published again, looked up first; a lost row taken for an earlier
	// life's would be lost: with PostgreSQL 60 s behind the broker, 8,527
	// rows were).
	var since time.Time
	if !shortfall {
		since = time.Now().Add(r.dbOffset() - lostLookback)
	}
	created := state.Created.Add(-lostCreatedMargin)
	if shift, slack, ok := r.dbToBroker(state); ok {
		created = state.Created.Add(-shift - slack - lostCreatedMargin)
	}
	lost, err := r.store.RequeueLost(ctx, state.Stream, state.LastSeq, created, since, recordedBefore)
	if err != nil {
		r.log.Warn().Err(err).Msg("could not hand rows the broker lost back to the poller; checking again later")
		return
	}
	handed = lost.IDs
	if shortfall || refilled {
		r.acked.lower(state.Stream, seen, state.LastSeq)
	}
	// Past the end first, then at or below it: where the stream took new
	// messages at sequences it lost, the rows recorded there are lost too.
	// Any sign of a loss has every recorded sequence up to the end read.
	if refilled || shortfall || lost.Rows > 0 || (full && r.refilledTop(ctx, state, created, since)) {
		reused, err := r.requeueReused(ctx, state, state.LastSeq, created, since)
		if err != nil {
			r.log.Warn().Err(err).Msg("could not check the rows recorded at sequences the broker may have reused; checking again later")
		} else if reused.Rows > 0 {
			handed = append(handed, reused.IDs...)
			r.metrics.BrokerLost.Add(float64(reused.Rows))
			r.log.Error().Str("stream", state.Stream).Uint64("stream_last_seq", state.LastSeq).Uint64("from_seq", reused.From).Uint64("to_seq", reused.To).
				Int("rows", reused.Rows).Msg("the broker lost messages it had acknowledged and has since stored other messages at their sequences: " +
				"handed the rows back to the poller, which publishes them again")
			if r.cfg.HandedOver != nil && lost.Rows == 0 {
				r.cfg.HandedOver()
			}
		}
	}
	if lost.Rows == 0 {
		return
	}
	r.metrics.BrokerLost.Add(float64(lost.Rows))
	r.log.Error().Str("stream", state.Stream).Uint64("stream_last_seq", state.LastSeq).Uint64("from_seq", lost.From).Uint64("to_seq", lost.To).
		Int("rows", lost.Rows).Msg("the broker lost messages it had acknowledged (its stream ends below sequences recorded as published): " +
		"handed the rows back to the poller, which publishes them again")
	if r.cfg.HandedOver != nil {
		r.cfg.HandedOver()
	}
	return handed
}

// reusedSpan bounds the sequences below a sign of reuse that are checked
// message by message: the tail a broker loses is what it had not synced
// (2 minutes of traffic by default); a loss deeper than this below the
// sign is not found.
const reusedSpan = 100_000

// lostReadEvery spaces the periodic checks' reads of a message: a check
// every few milliseconds (tests, a tiny --lost-check-interval) would
// otherwise read the stream as often. A session start's check and the
// first after a reconnect always read.
const lostReadEvery = 5 * time.Second

// readMessageNow reports whether this check reads the message at the last
// acknowledged sequence back, and if so takes its turn.
func (r *Relay) readMessageNow(full bool) bool {
	now := time.Now().UnixNano()
	if full || r.reconnected.Swap(false) || now-r.lastMessageRead.Load() >= int64(lostReadEvery) {
		r.lastMessageRead.Store(now)
		return true
	}
	return false
}

// messageAt is the work ID of the message at seq in the own stream; ok is
// false when it cannot be read or holds nothing there.
func (r *Relay) messageAt(ctx context.Context, seq uint64) (string, bool) {
	rd, ok := r.sink.(sinks.StoredReader)
	if !ok || seq == 0 {
		return "", false
	}
	var id string
	found := false
	_, err := rd.ReadStored(ctx, sinks.From{AfterSeq: seq - 1, BySeq: true}, 1, func(m sinks.Stored) bool {
		id, found = m.ID, m.Seq == seq
		return false
	})
	if err != nil {
		r.log.Warn().Err(err).Uint64("seq", seq).Msg("could not read the message at a recorded sequence to check for messages the broker lost; checking again later")
		return "", false
	}
	return id, found
}

// refilledTop is a session start's look for a stream that lost its tail
// and took new messages at its sequences since (it has no acknowledgement
// of its own to compare): two rows recorded at one sequence, or another
// message at the highest sequence a row is recorded at.
func (r *Relay) refilledTop(ctx context.Context, state sinks.StreamState, created, since time.Time) bool {
	top, twice, err := r.store.TopRecorded(ctx, state.Stream, reusedFloor(state, state.LastSeq), state.LastSeq, created, since)
	if err != nil {
		r.log.Warn().Err(err).Msg("could not read the rows recorded last to check for messages the broker lost; checking again later")
		return false
	}
	if twice > 0 && twice >= state.FirstSeq {
		return true
	}
	if len(top) == 0 || top[0].Seq < state.FirstSeq {
		return false
	}
	id, ok := r.messageAt(ctx, top[0].Seq)
	if !ok {
		return false
	}
	for _, row := range top {
		if row.WorkID != id {
			return true
		}
	}
	return false
}

// reusedFloor is the sequence reusedSpan below hi, or before the stream's
// first.
func reusedFloor(state sinks.StreamState, hi uint64) uint64 {
	lo := uint64(0)
	if hi > reusedSpan {
		lo = hi - reusedSpan
	}
	if state.FirstSeq > 0 && lo < state.FirstSeq-1 {
		lo = state.FirstSeq - 1
	}
	return lo
}

// requeueReused reads the own stream's messages at the sequences from
// reusedSpan below hi up to hi and hands back the rows recorded at one of
// them that holds another message now. A sequence that holds none (a
// message deleted on its own) is not a loss.
func (r *Relay) requeueReused(ctx context.Context, state sinks.StreamState, hi uint64, created, since time.Time) (store.LostRange, error) {
	rd, ok := r.sink.(sinks.StoredReader)
	if !ok {
		return store.LostRange{}, nil
	}
	lo := reusedFloor(state, hi)
	rows, err := r.store.RecordedBetween(ctx, state.Stream, lo, hi, created, since, 4*reusedSpan)
	if err != nil || len(rows) == 0 {
		return store.LostRange{}, err
	}
	// A read that ends short judges what it read: a row is lost only where
	// another message was read at its sequence.
	at := make(map[uint64]string, len(rows))
	if _, err := rd.ReadStored(ctx, sinks.From{AfterSeq: lo, BySeq: true}, reusedSpan+1, func(m sinks.Stored) bool {
		if m.Seq > hi {
			return false
		}
		at[m.Seq] = m.ID
		return true
	}); err != nil {
		return store.LostRange{}, fmt.Errorf("read stream %s at seq %d to %d: %w", state.Stream, lo+1, hi, err)
	}
	var lost []store.Recorded
	for _, row := range rows {
		if id, ok := at[row.Seq]; ok && id != row.WorkID {
			lost = append(lost, row)
		}
	}
	if len(lost) == 0 {
		return store.LostRange{}, nil
	}
	return r.store.RequeueLostRows(ctx, state.Stream, lost, lo)
}

// ownedBy is the set of the IDs given, nil when there are none.
func ownedBy(lists ...[]string) map[string]struct{} {
	var set map[string]struct{}
	for _, ids := range lists {
		for _, id := range ids {
			if set == nil {
				set = map[string]struct{}{}
			}
			set[id] = struct{}{}
		}
	}
	return set
}

// BrokerReconnected asks the running session for a check at once: the
// broker that came back may have lost what it acknowledged; and it ends a
// wait between sessions.
func (r *Relay) BrokerReconnected() {
	r.reconnected.Store(true)
	select {
	case r.lostNow <- struct{}{}:
	default:
	}
	// A session waiting to start again starts now (waitToRestart).
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// keepCheckingLost runs checkLost every LostCheckInterval, and when the
// broker connection is back, until ctx ends.
func (r *Relay) keepCheckingLost(ctx context.Context) {
	var tick <-chan time.Time
	if r.cfg.LostCheckInterval > 0 {
		t := time.NewTicker(r.cfg.LostCheckInterval)
		defer t.Stop()
		tick = t.C
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick:
			r.checkLost(ctx, false)
		case <-r.lostNow:
			r.checkLost(ctx, false)
		}
	}
}

// ackedSeqs is the highest acknowledged sequence by stream, with the
// work ID acknowledged there.
type ackedSeqs struct {
	mu  sync.Mutex
	seq map[string]ackedAt
}

// ackedAt is a sequence and the message ID acknowledged at it ("" when
// not known: set by lower).
type ackedAt struct {
	Seq uint64
	ID  string
}

func (a *ackedSeqs) raise(stream string, seq uint64, id string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seq == nil {
		a.seq = map[string]ackedAt{}
	}
	if seq > a.seq[stream].Seq {
		a.seq[stream] = ackedAt{Seq: seq, ID: id}
	}
}

func (a *ackedSeqs) get(stream string) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seq[stream].Seq
}

// snapshot copies the highest acknowledged sequences.
func (a *ackedSeqs) snapshot() map[string]ackedAt {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.seq)
}

// lower sets stream's highest to seq once a shortfall from seen was
// reported, so it is reported once; an ack past seen since then stays.
func (a *ackedSeqs) lower(stream string, seen, seq uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seq != nil && a.seq[stream].Seq <= seen {
		a.seq[stream] = ackedAt{Seq: seq}
	}
}
