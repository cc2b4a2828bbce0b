package relay

import (
	"context"
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
// scan of the published rows, while nothing is lost.
func (r *Relay) checkLost(ctx context.Context, full bool) {
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
	stateCtx, stateCancel := context.WithTimeout(ctx, lostStateTimeout)
	state, err := st.OwnStreamState(stateCtx)
	stateCancel()
	if err != nil {
		r.log.Warn().Err(err).Msg("could not read the stream's state to check for messages the broker lost; checking again later")
		return
	}
	seen := seenBefore[state.Stream]
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
	if !full && !shortfall {
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
	lost, err := r.store.RequeueLost(ctx, state.Stream, state.LastSeq, created, since)
	if err != nil {
		r.log.Warn().Err(err).Msg("could not hand rows the broker lost back to the poller; checking again later")
		return
	}
	if shortfall {
		r.acked.lower(state.Stream, seen, state.LastSeq)
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
}

// BrokerReconnected asks the running session for a check at once: the
// broker that came back may have lost what it acknowledged; and it ends a
// wait between sessions.
func (r *Relay) BrokerReconnected() {
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

// ackedSeqs is the highest acknowledged sequence by stream.
type ackedSeqs struct {
	mu  sync.Mutex
	seq map[string]uint64
}

func (a *ackedSeqs) raise(stream string, seq uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seq == nil {
		a.seq = map[string]uint64{}
	}
	if seq > a.seq[stream] {
		a.seq[stream] = seq
	}
}

func (a *ackedSeqs) get(stream string) uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seq[stream]
}

// snapshot copies the highest acknowledged sequences.
func (a *ackedSeqs) snapshot() map[string]uint64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	return maps.Clone(a.seq)
}

// lower sets stream's highest to seq once a shortfall from seen was
// reported, so it is reported once; an ack past seen since then stays.
func (a *ackedSeqs) lower(stream string, seen, seq uint64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.seq != nil && a.seq[stream] <= seen {
		a.seq[stream] = seq
	}
}
