package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// The read-back (G18). A session replays everything past the slot's
// confirmed position, and some of it was published (and stored) by the
// session before: up to a status interval of acked rows, plus everything
// in flight behind them. Past the broker's duplicate window nothing drops
// those repeats; a crash followed by a longer outage stored every recent
// row twice. So before the first publish of a session the relay reads the
// headers the stream stored from the position recorded with the slot's
// confirmation (position.go) to the stream's last sequence as it stood
// when the read began, and a replayed row whose work ID is there is settled
// as published with the stored sequence instead of being published again.
//
// The read is bounded by what was in flight at the last confirmation and
// what others stored on the relay's subjects since (other instances'
// pollers, other publishers), never by recent traffic or by clocks, and by
// ReadBackLimit messages. Where no position is recorded (the first start
// after an upgrade, a slot whose confirmations PostgreSQL took back, a
// stream created again) it falls back to the broker's time of the first
// replayed commit less readBackMargin, and says so: that fallback is the
// only read that trusts the clocks of PostgreSQL and the broker. Past the
// limit, and for rows whose subject column names another stream, the
// duplicate window is what is left.

// DefaultReadBackLimit bounds the messages a session start reads back, and
// so the memory of the IDs it keeps (about 100 bytes each).
const DefaultReadBackLimit = 200_000

// readBackMargin starts a read by time (the fallback) this long before the
// first replayed commit: the broker's clock stamps a stored message,
// PostgreSQL's the commit, and a broker clock behind PostgreSQL's would
// hide the first repeats.
const readBackMargin = 5 * time.Second

// readBack holds the replay's messages the stream has already, by work ID,
// until the replay passes the newest of them.
type readBack struct {
	stored map[string]storedMsg
	upTo   replication.LSN // the newest commit LSN among them
}

// storedMsg is where a replayed row's message is, and the commit position
// it carries (0: none, not the CDC path's).
type storedMsg struct {
	stream string
	seq    uint64
	lsn    replication.LSN
}

// startReadBack reads the stream back before the session's first publish:
// first is the first replayed transaction's commit time (for the fallback
// by time only), confirmed the slot's position the session started from.
// A read that fails, or that the broker does not answer up to its end, is
// tried again, each attempt bounded by readBackAttempt, for up to
// readBackTimeout; then the session ends as in an outage rather than
// publish what it could not check: past the duplicate window each replayed
// row would be stored again (a read hung across a cut NATS connection for
// its whole minute, and the replay after it stored 119 rows twice: chaos
// seed 1796245287009604072).
func (l *loop) startReadBack(ctx context.Context, first time.Time, confirmed replication.LSN) error {
	reader, ok := l.r.sink.(sinks.StoredReader)
	if !ok || l.r.cfg.ReadBackLimit < 0 {
		return nil
	}
	started := time.Now()
	var rb *readBack
	var res sinks.ReadResult
	var from sinks.From
	var state sinks.StreamState
	var err error
	for attempt := 1; ; attempt++ {
		rb = &readBack{stored: map[string]storedMsg{}}
		rctx, cancel := context.WithTimeout(ctx, min(readBackAttempt, readBackTimeout-time.Since(started)))
		from, state, err = l.readBackStart(rctx, first, confirmed)
		if err == nil {
			res, err = reader.ReadStored(rctx, from, l.r.cfg.ReadBackLimit, func(m sinks.Stored) bool {
				lsn, err := pglogrepl.ParseLSN(firstHeader(m.Header, wire.HeaderCommitLSN))
				if err == nil && lsn < confirmed {
					// Confirmed, not replayed. PostgreSQL skips only the
					// transactions whose commit record starts before the
					// confirmed position; one that starts at it (the end of its
					// predecessor's, when its rows were written before that one
					// committed) is replayed and must be found.
					return true
				}
				if err != nil {
					lsn = 0
				}
				rb.stored[m.ID] = storedMsg{stream: m.Stream, seq: m.Seq, lsn: lsn}
				rb.upTo = max(rb.upTo, lsn)
				return true
			})
			l.r.metrics.ReadBackMessages.Add(float64(res.Read))
		}
		cancel()
		if err == nil || ctx.Err() != nil || time.Since(started)+readBackRetryWait >= readBackTimeout {
			break
		}
		l.r.log.Warn().Err(err).Int("attempt", attempt).Msg("could not read the stream back before replaying; trying again")
		select {
		case <-ctx.Done():
		case <-time.After(readBackRetryWait):
		}
	}
	took := time.Since(started)
	l.r.metrics.ReadBackSeconds.Set(took.Seconds())
	if err != nil {
		return fmt.Errorf("%w: read the stream back before replaying (G18), for %s: %w; the session ends without publishing and starts again (the replay it could not check would be stored twice past the duplicate window). "+
			"If the relay's NATS user may not create consumers on the stream, grant it, or turn the read-back off with --readback-limit 0 (then only the duplicate window drops the repeats)",
			errOutage, took.Round(time.Millisecond), err)
	}
	ev := l.r.log.Info()
	if !res.Complete {
		ev = l.r.log.Warn()
	}
	if from.BySeq {
		ev = ev.Uint64("after_seq", from.AfterSeq)
	} else {
		ev = ev.Time("since", from.Since)
	}
	ev.Uint64("end_seq", res.End).Int("read", res.Read).Int("stored", len(rb.stored)).Bool("complete", res.Complete).
		Dur("took", took).Msg(readBackMessage(res.Complete))
	if len(rb.stored) > 0 {
		l.readBack = rb
	}
	// From here on the session records the position of what it confirms:
	// what it replays was stored after where this read started.
	l.pos = positions{on: true, stream: state.Stream, created: state.Created, start: res.After, known: res.After, marks: l.pos.marks}
	if l.pos.marks != nil {
		l.pos.marks.start(state.Stream, state.Created, res.After)
	}
	return nil
}

// readBackStart is where the read-back starts: the position recorded for
// the slot's confirmed position, or by time where none is (and why, at
// warn).
func (l *loop) readBackStart(ctx context.Context, first time.Time, confirmed replication.LSN) (sinks.From, sinks.StreamState, error) {
	stater, ok := l.r.sink.(sinks.StreamStater)
	if !ok {
		return sinks.From{Since: first.Add(-readBackMargin)}, sinks.StreamState{}, nil
	}
	state, err := stater.OwnStreamState(ctx)
	if err != nil {
		return sinks.From{}, state, err
	}
	if l.newSlot {
		// A slot created by this session streams only transactions that
		// commit after it: the CDC path never published any of them.
		return sinks.From{AfterSeq: state.LastSeq, BySeq: true}, state, nil
	}
	rec, err := l.r.store.ReadPosition(ctx, l.r.cfg.Slot)
	if err != nil {
		return sinks.From{}, state, err
	}
	seq, ok, why := rec.StartAt(store.LSN(confirmed), state.Stream, state.Created)
	if ok && state.LastSeq < seq {
		ok, why = false, fmt.Sprintf("stream %s ends at %d, before the position recorded (%d): the broker lost messages it had stored", state.Stream, state.LastSeq, seq)
	}
	if ok {
		return sinks.From{AfterSeq: seq, BySeq: true}, state, nil
	}
	// The first replayed commit's time is PostgreSQL's; the read compares
	// it with the broker's timestamps. Measured, the two clocks' offset
	// moves it onto the broker's clock (PostgreSQL 60 s ahead read nothing,
	// and every replayed row was stored twice); not measured, they are
	// assumed to agree within the margin.
	since := first.Add(-readBackMargin)
	ev := l.r.log.Warn().Str("why", why)
	clocks := "assumed to agree within 5 s (not measured)"
	if shift, slack, ok := l.r.dbToBroker(state); ok {
		since = first.Add(shift - slack - readBackMargin)
		ev = ev.Dur("broker_minus_database", shift)
		clocks = "measured: the first replayed commit moved onto the broker's clock"
	}
	ev.Str("clocks", clocks).Time("since", since).
		Msg("reading the stream back by time, not from a recorded position: the positions recorded from this session on make the next start's read exact")
	return sinks.From{Since: since}, state, nil
}

// idlePosition is the stream position of a session that streamed no
// transaction (so never read the stream back): it published nothing, so
// the position it started from holds at its end too; a slot it created
// has had nothing published, so the stream's end does. Recorded at a
// clean stop, it spares the next start the read by time (a new slot's
// first session that streams nothing, then a restart, read by time).
func (l *loop) idlePosition(ctx context.Context) (store.StreamPos, bool) {
	stater, ok := l.r.sink.(sinks.StreamStater)
	if !ok || l.r.cfg.ReadBackLimit < 0 {
		return store.StreamPos{}, false
	}
	state, err := stater.OwnStreamState(ctx)
	if err != nil {
		return store.StreamPos{}, false
	}
	at := store.StreamPos{Stream: state.Stream, Created: state.Created, Seq: state.LastSeq}
	if l.newSlot {
		return at, true
	}
	rec, err := l.r.store.ReadPosition(ctx, l.r.cfg.Slot)
	if err != nil {
		return store.StreamPos{}, false
	}
	seq, ok, _ := rec.StartAt(store.LSN(l.started), state.Stream, state.Created)
	if !ok || seq > state.LastSeq {
		return store.StreamPos{}, false
	}
	at.Seq = seq
	return at, true
}

func readBackMessage(complete bool) string {
	if !complete {
		return "read the stream back up to --readback-limit only: replayed rows past it are published again, and only the duplicate window drops the repeats"
	}
	return "read the stream back before replaying: replayed rows found stored are settled, not published again"
}

// recordFinalPosition records, after a clean stop's final confirmation,
// the stream position of final: the next session's read-back starts past
// everything this one published and confirmed (none of its own to read).
func (l *loop) recordFinalPosition(ctx context.Context, final replication.LSN) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	var at store.StreamPos
	if l.pos.on {
		at = store.StreamPos{Stream: l.pos.stream, Created: l.pos.created, Seq: l.pos.after(l.cp)}
	} else {
		var ok bool
		if at, ok = l.idlePosition(rctx); !ok {
			return
		}
	}
	if err := l.r.store.RecordPosition(rctx, l.r.cfg.Slot, l.slotLSN, store.LSN(final), at); err != nil {
		l.r.log.Warn().Err(err).Msg("stopped; could not record the stream position of the final confirmation: the next start reads back from the one recorded before (longer, not wrong)")
	}
}

// readBackAttempt bounds one attempt of the read; readBackRetryWait is the
// pause between attempts.
const (
	readBackAttempt   = 15 * time.Second
	readBackRetryWait = 500 * time.Millisecond
)

// readBackTimeout bounds the read: a broker too slow to answer in it is
// left to the duplicate window.
const readBackTimeout = time.Minute

// found returns the stored message of a replayed row as its ack (and
// forgets it), and drops the read-back once the replay has passed its
// newest message. A message of another transaction under the row's work
// ID (a work_id reused) is answered as a duplicate, as the broker would
// inside its window: the row then says which message it points at.
func (l *loop) found(it *item) (sinks.Ack, bool) {
	rb := l.readBack
	if rb == nil {
		return sinks.Ack{}, false
	}
	m, ok := rb.stored[it.workID]
	if ok {
		delete(rb.stored, it.workID)
		l.pos.earlier(m.stream, m.seq, it.txn)
	}
	if len(rb.stored) == 0 || (rb.upTo != 0 && l.curCommitLSN > rb.upTo) {
		l.readBack = nil
	}
	return sinks.Ack{Stream: m.stream, Sequence: m.seq, Duplicate: ok && m.lsn != l.curCommitLSN}, ok
}

func firstHeader(h map[string][]string, k string) string {
	if vs := h[k]; len(vs) > 0 {
		return vs[0]
	}
	return ""
}
