package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// cleanStop is a session's clean stop (the relay's context ended: SIGTERM,
// or a handover), a small state machine of its own. Its phases, in order,
// each bounded by a share of --drain-timeout counted from the stop's start:
//
//	stopPassing   the slot's restart position passes the WAL written before
//	              the stop (restart.go), up to 1/stopPassShare; skipped
//	              without a keeper
//	stopTaking    --on-publish none with rows owed to the watermark: the
//	              stop's watermark candidate is taken (watermark.go)
//	stopReaching  streaming on until every transaction committing before
//	              the candidate's position is handed over, up to 3/4
//	stopDraining  no more WAL is read; what is in flight is acked and
//	              settled, up to the whole; then finish
//
// Every phase ends with one stopEvent on events: a helper's answer (the
// pass, the candidate) or a timer (the reach's and the drain's bounds), so
// the loop's select has one case for the whole stop and hands each event
// to step. The channel holds every event a stop can produce, so a helper
// or timer never blocks on a loop that already finished.
type cleanStop struct {
	phase  stopPhase
	began  time.Time
	events chan stopEvent
	// readWAL is the stream's stop channel: closed when draining begins.
	readWAL chan struct{}
	// --on-publish none: the stop's watermark candidate, and whether every
	// transaction committing before its position was handed over before
	// the stop stopped reading (reached).
	cand    store.WatermarkCandidate
	reached bool
}

type stopPhase uint8

const (
	stopRunning stopPhase = iota
	stopPassing
	stopTaking
	stopReaching
	stopDraining
)

type stopEventKind uint8

const (
	stopPassed stopEventKind = iota + 1
	stopCandTaken
	stopReachTimedOut
	stopDrainTimedOut
)

// stopEvent is the end of one phase; cand with stopCandTaken.
type stopEvent struct {
	kind stopEventKind
	cand stopCandidate
}

// stopEvents is the most events one stop produces (one of each kind).
const stopEvents = 4

// draining reports whether the stream has stopped reading WAL.
func (s *cleanStop) draining() bool { return s.phase == stopDraining }

// send posts an event; never blocks (events holds every one).
func (s *cleanStop) send(ev stopEvent) {
	select {
	case s.events <- ev:
	default:
	}
}

// after posts ev once d has passed.
func (s *cleanStop) after(d time.Duration, ev stopEvent) {
	time.AfterFunc(max(d, 0), func() { s.send(ev) })
}

// beginStop starts the clean stop: the restart position's pass when a
// keeper writes running-transactions records, else the next phase at once.
func (l *loop) beginStop(sessCtx context.Context) {
	s := &l.stop
	if s.phase != stopRunning {
		return
	}
	s.began = time.Now()
	if l.keeper == nil {
		l.afterPass(sessCtx)
		return
	}
	s.phase = stopPassing
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		pctx, cancel := context.WithTimeout(sessCtx, l.r.cfg.DrainTimeout/stopPassShare)
		defer cancel()
		l.keeper.pass(pctx, l.stream)
		s.send(stopEvent{kind: stopPassed})
	}()
}

// afterPass goes on from the pass: under --on-publish none, with rows owed
// to the watermark (or more to come), to taking the stop's candidate;
// otherwise straight to draining.
func (l *loop) afterPass(sessCtx context.Context) {
	s := &l.stop
	if l.cover == nil || !l.cover.owes() && l.inflight == 0 && l.cp.Open() == 0 {
		// Nothing acked is owed, and nothing more will be.
		l.beginDrain()
		return
	}
	s.phase = stopTaking
	left := l.r.cfg.DrainTimeout*(stopReachShare-1)/stopReachShare - time.Since(s.began)
	s.after(left, stopEvent{kind: stopReachTimedOut})
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		cctx, cancel := context.WithTimeout(sessCtx, left)
		defer cancel()
		c, err := l.takeStopCandidate(cctx)
		s.send(stopEvent{kind: stopCandTaken, cand: stopCandidate{cand: c, err: err}})
	}()
}

// step takes the end of a phase; finish is true when the session is to
// finish now (the drain's time is up). An event of a phase already left
// (a candidate after the reach's bound) is dropped.
func (l *loop) step(sessCtx context.Context, ev stopEvent) (finish bool) {
	s := &l.stop
	switch {
	case ev.kind == stopDrainTimedOut:
		l.r.log.Warn().Int("in_flight", l.inflight).Int("unsettled", l.settle.unsettled()).
			Msg("drain timeout: leaving the rest to the next start (the broker drops the repeats)")
		return true
	case ev.kind == stopPassed && s.phase == stopPassing:
		l.afterPass(sessCtx)
	case ev.kind == stopCandTaken && s.phase == stopTaking:
		if ev.cand.err != nil {
			l.r.log.Warn().Err(ev.cand.err).Msg("stopping: could not take the watermark's candidate; the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
			l.beginDrain()
			return false
		}
		s.cand, s.phase = ev.cand.cand, stopReaching
		if l.pastStop(l.curCommitLSN) && l.cur == nil {
			// A transaction committed after the candidate was taken came
			// through meanwhile: nothing more should.
			l.reachedStop()
			return false
		}
		// One still coming through past it ends at its commit: the next
		// Begin or the stream's position is past the candidate too.
		// Stopping within it would leave it open, and the stop's
		// watermark is recorded only with none open.
		l.stream.StopAt(replication.LSN(s.cand.LSN))
	case ev.kind == stopReachTimedOut && (s.phase == stopTaking || s.phase == stopReaching):
		l.r.log.Warn().Str("lsn", s.cand.LSN.String()).
			Msg("stopping: the stream did not reach the watermark's candidate in time (a backlog, a large transaction or a lagging standby); the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
		l.beginDrain()
	}
	return false
}

// beginDrain stops reading WAL and starts the drain, bounded by what is
// left of --drain-timeout.
func (l *loop) beginDrain() {
	s := &l.stop
	if s.phase == stopDraining {
		return
	}
	s.phase = stopDraining
	close(s.readWAL)
	s.after(l.r.cfg.DrainTimeout-time.Since(s.began), stopEvent{kind: stopDrainTimedOut})
	l.r.log.Info().Int("in_flight", l.inflight).Msg("shutting down: draining in-flight messages")
}

// reachedStop is called at the first event past the stop's watermark
// candidate: every transaction committing before it has gone through the
// loop. The event and the rest are left to the next session.
func (l *loop) reachedStop() {
	l.stop.reached = true
	l.beginDrain()
}

// pastStop reports whether a transaction committing at lsn, or the stream's
// position lsn, is at or past the stop's watermark candidate.
func (l *loop) pastStop(lsn replication.LSN) bool {
	return l.stop.cand.Snapshot != "" && store.LSN(lsn) >= l.stop.cand.LSN
}
