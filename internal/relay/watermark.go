package relay

import (
	"context"
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// DefaultWatermarkEvery is how often a streaming relay with --on-publish
// none records its watermark (G17): one small UPDATE of <table>_slots,
// instead of one write per published row. A published row shows as
// published in status and the console, and is no longer handed over after
// a slot loss, once a watermark covers it: one or two of these intervals
// after its ack, also when the outbox goes quiet (the stream asks the
// server for its position rather than wait for a keepalive).
const DefaultWatermarkEvery = time.Second

// coverage is what the watermark still owes: the transaction ids (xact_id)
// of the rows this session acked that no recorded watermark is known to
// cover. It keeps them as a set (ids), which the stop's watermark needs
// (stopSnapshot), and as a range, which is what counts once the set grew
// past maxOwedIDs (lossy) and was dropped. A range loses nothing: a
// recorded snapshot's verdict on every id in it is exact, so the range
// only shrinks by ids known to be covered, and an id outside the rows
// acked can only keep the recorder going a little longer (an unrelated
// transaction still running inside the range), never let it rest early.
type coverage struct {
	mu     sync.Mutex
	lo, hi uint64
	owed   bool
	ids    map[uint64]struct{}
	lossy  bool
	// earlier: rows acked before this session may be uncovered (oweEarlier).
	earlier bool
}

// oweEarlier owes one recorded watermark for rows acked before this
// session. A session that ends between the slot's confirmation of its last
// rows and the watermark that would cover them (an immediate restart of
// PostgreSQL, a cut connection, a kill) leaves them uncovered, and no later
// session streams them again: only the next row acked would move the
// watermark past them, so an outbox gone idle would show them as in flight,
// and hand them over again after a slot loss, for as long as it stays idle
// (seen in chaos: 2,982 rows for 3 minutes). Any candidate recorded in this
// session covers them: their transactions ended before it was taken, and
// committed before the position the slot had confirmed at this session's
// start. It costs one statement per session.
func (c *coverage) oweEarlier() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.earlier = true
}

// maxOwedIDs bounds the set of owed ids (a recorder that cannot record
// for long, at one row per transaction): past it, only the range is kept
// until nothing is owed.
const maxOwedIDs = 1 << 16

// add owes the ids of rows just acked (each id once or more).
func (c *coverage) add(xids []uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, x := range xids {
		if !c.owed {
			c.lo, c.hi, c.owed = x, x, true
		}
		c.lo, c.hi = min(c.lo, x), max(c.hi, x)
		if c.lossy {
			continue
		}
		if c.ids == nil {
			c.ids = make(map[uint64]struct{})
		}
		c.ids[x] = struct{}{}
		if len(c.ids) > maxOwedIDs {
			c.ids, c.lossy = nil, true
		}
	}
}

// owes reports whether an acked row is not known to be covered.
func (c *coverage) owes() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.owed || c.earlier
}

// recorded takes a watermark just recorded with snapshot snap: every owed
// id snap sees as ended is covered. It reports whether anything is still
// owed.
func (c *coverage) recorded(snap string) (owed bool, err error) {
	s, err := store.ParseSnapshot(snap)
	if err != nil {
		return c.owes(), err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.earlier = false
	if !c.owed {
		return false, nil
	}
	if first, running := s.FirstRunning(c.lo, c.hi); running {
		c.lo = first
	} else {
		c.owed = false
	}
	if !c.lossy {
		for x := range c.ids {
			if s.Finished(x) {
				delete(c.ids, x)
			}
		}
		// Exact: an unrelated transaction running inside the range
		// keeps nothing owed.
		c.owed = len(c.ids) > 0
	} else if !c.owed {
		c.lossy = false
	}
	return c.owed, nil
}

// unfinished is the owed ids that s does not see as ended; complete is
// false when the set was dropped (lossy), so that more may be owed.
func (c *coverage) unfinished(s store.Snapshot) (ids []uint64, complete bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for x := range c.ids {
		if !s.Finished(x) {
			ids = append(ids, x)
		}
	}
	return ids, !c.lossy
}

// recordWatermarks keeps the table's watermark moving while this session
// streams. A candidate (snapshot, position) is kept until the slot has
// confirmed past its position, not replaced by a newer one: under steady
// load the confirmed position always trails the newest position, and a
// candidate replaced every tick would never be recorded.
//
// It runs while a row acked in this session is not covered by a recorded
// watermark (coverage), and rests, running no statement, once all are: an
// idle relay queries nothing (docs/benchmarks.md, idle). Covered is read
// from the recorded snapshot itself, not guessed from the number of
// candidates since the last ack: a row is streamed and acked before its
// transaction is visible (design.md), and a synchronous standby can hold
// it invisible for as long as it lags; every candidate taken meanwhile
// misses it, and the recorder keeps taking them until one covers it. For
// each candidate it asks the stream to get the server's confirmation past
// its position (ConfirmThrough): when the outbox goes quiet nothing else
// would move the slot past it before a keepalive the server sends when it
// pleases.
func (l *loop) recordWatermarks(ctx context.Context) {
	r := l.r
	t := time.NewTicker(r.cfg.WatermarkEvery)
	defer t.Stop()
	var cand store.WatermarkCandidate
	var lastWarn time.Time
	// lastRec: when a watermark was last recorded, or the session began;
	// a recorder that owes one for longer than stuckAfter says so.
	lastRec, lastStuck := time.Now(), time.Time{}
	// poll: a candidate that a tick's statement took, or could not record
	// yet, is recorded as soon as the stream has confirmed past it,
	// instead of at the next tick: still at most one write per tick, and a
	// quiet outbox is covered about a tick after its last ack.
	var poll <-chan time.Time
	tries := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			poll, tries = nil, 0
		case <-poll:
			if store.LSN(r.stats.Confirmed.Load()) < cand.LSN {
				poll = time.After(watermarkPoll)
				continue
			}
			poll = nil
		}
		if !l.cover.owes() {
			// A candidate taken before the next ack cannot cover it.
			cand, poll = store.WatermarkCandidate{}, nil
			continue
		}
		taking := cand.Snapshot == ""
		rec, next, err := r.store.AdvanceWatermark(ctx, r.cfg.Slot, l.slotLSN, cand)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			if time.Since(lastWarn) > time.Minute {
				lastWarn = time.Now()
				r.log.Warn().Err(err).Msg("recording the watermark failed; published rows keep showing as in flight, and would be handed over again after a slot loss, until it succeeds")
			}
		case rec:
			l.noteRecorded(cand)
			cand, lastRec = next, time.Now()
		case cand.Snapshot == "":
			cand = next
		}
		if err == nil && !rec && time.Since(lastRec) > stuckAfter && time.Since(lastStuck) > stuckAfter {
			lastStuck = time.Now()
			r.log.Warn().Str("candidate_lsn", cand.LSN.String()).Str("confirmed_lsn", store.LSN(r.stats.Confirmed.Load()).String()).
				Dur("since_recorded", time.Since(lastRec)).
				Msg("the watermark has recorded nothing for a while although acked rows wait for it: the slot has not confirmed past the candidate (compare candidate_lsn with confirmed_lsn), or the slot record refuses it (a backfill pending); published rows show as in flight until it records")
		}
		if cand.Snapshot != "" {
			l.stream.ConfirmThrough(replication.LSN(cand.LSN))
		}
		switch {
		case err == nil && taking:
			poll, tries = time.After(watermarkPoll), 0
		case err == nil && !rec && tries < 5:
			// Not confirmed past yet, or sent but not taken in by the
			// server yet.
			poll = time.After(watermarkPoll)
			tries++
		}
	}
}

// stuckAfter is how long the recorder owes a watermark without recording
// one before it says so (and again at most this often).
const stuckAfter = time.Minute

// watermarkPoll paces the recorder's look at the stream's confirmed
// position while a fresh candidate waits for it.
const watermarkPoll = 20 * time.Millisecond

// noteRecorded takes a candidate that became the watermark.
func (l *loop) noteRecorded(c store.WatermarkCandidate) (owed bool) {
	l.r.metrics.WatermarkLSN.Set(float64(c.LSN))
	owed, err := l.cover.recorded(c.Snapshot)
	if err != nil {
		l.r.log.Warn().Err(err).Msg("could not read the recorded watermark's snapshot; recording on")
	}
	return owed
}

// A clean stop under --on-publish none records a watermark that covers
// every row the session acked, so that a slot lost after the stop hands
// none of them to the poller again (issue 30). Recording one needs a
// candidate taken after the rows became visible and the slot confirmed
// past its position; but the position is past every commit up to the
// moment it was read, and the slot may only be confirmed past a commit
// whose rows are settled (G3). So the stop takes the candidate first
// (takeStopCandidate), streams on until every transaction committing
// before its position is handed over (the Begin of one committing at or
// after it, or the server's answer at or past it: replication.StopAt),
// publishing none after it, and only then stops reading WAL. Once those
// are acked and settled, the position is safe to confirm: the restart
// skips only transactions committing before it. The stream sends it in
// its last status update; the candidate is recorded once the slot shows
// it (recordAtStop). All of it within --drain-timeout: out of time, the
// stop is as before, and the rows after the last recorded watermark wait
// for the next session's.
//
// The candidate's snapshot S alone would not cover every transaction the
// stop streams: the position L is read after S, and a transaction may
// commit before L and yet not be one S sees as ended: one that began
// after S was taken (measured under load: its commit record 48 bytes
// before L, its id S's xmax), or one that had written its commit record
// but not left the running set when S was taken (for as long as a
// synchronous standby holds it). The stop streams and settles it (its
// commit is before L), and S would leave its rows uncovered. Taking a
// fresh candidate until one covers everything does not converge under
// load: each one has its own such tail. So the stop records S with the
// owed ids of the rows it acked read as ended as well (stopSnapshot,
// store.Snapshot.WithFinished). That is sound by the same argument as a
// plain candidate, for each id it reads as ended: an id S sees as ended
// committed before L, so it was streamed and settled before L is
// confirmed; an id added is a transaction this session streamed (a row of
// it was acked), and the candidate is recorded only once every
// transaction the session began is settled (finish: stop.reached and no
// transaction open), so every row of it is stored or handed to the poller.
// Most committed before L (the stop hands over none committing at or
// after L once it knows L); those that came through while L was being
// read committed after it, and are settled whole all the same: the stop
// ends at the commit of the one it is in when L arrives, never within it
// (a transaction left open would leave the candidate unrecorded). Nothing
// else is read as ended: a transaction running at the
// stop that the relay did not stream stays running in the recorded
// snapshot (relay TestNoneCleanStopCoversARowAckedWhileInvisible). A
// later watermark, a plain snapshot, may see such an added transaction
// as running still (its commit waiting for a standby): its rows then
// show as in flight again until one sees it, never the other way round.
// Left uncovered at a stop only: the owed ids when the set of them was
// dropped (more than maxOwedIDs), and ids far above S's xmax
// (stopGrowIDs); the stop says so.

// stopReachShare: the stop streams up to its candidate until this share
// of --drain-timeout (counted from the stop's start, after the restart
// position's pass) has gone; the drain gets the rest.
const stopReachShare = 4 // 3/4 of it

// stopCandidate is takeStopCandidate's answer.
type stopCandidate struct {
	cand store.WatermarkCandidate
	err  error
}

// takeStopCandidate takes the stop's candidate and writes a commit record
// after it, so that the server's position passes the candidate's even in
// an idle database.
func (l *loop) takeStopCandidate(ctx context.Context) (store.WatermarkCandidate, error) {
	_, c, err := l.r.store.AdvanceWatermark(ctx, l.r.cfg.Slot, l.slotLSN, store.WatermarkCandidate{})
	if err != nil {
		return c, err
	}
	return c, replication.WriteCommitRecord(ctx, l.r.pool)
}

// recordAtStop records the stop's candidate once the slot shows the last
// status update's confirmation past it, within wait.
func (l *loop) recordAtStop(ctx context.Context, wait time.Duration) {
	r := l.r
	c := l.stop.cand
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for {
		si, err := replication.LookupSlot(ctx, r.pool, r.cfg.Slot)
		if err == nil && si.Exists && store.LSN(si.ConfirmedFlush) >= c.LSN {
			break
		}
		select {
		case <-ctx.Done():
			r.log.Warn().Str("lsn", c.LSN.String()).Str("confirmed_lsn", si.ConfirmedFlush.String()).Err(err).
				Msg("stopped; the slot did not show the confirmation past the watermark's candidate in time: the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
			return
		case <-time.After(promptPoll):
		}
	}
	c.Snapshot = l.stopSnapshot(c.Snapshot)
	rec, _, err := r.store.AdvanceWatermark(ctx, r.cfg.Slot, l.slotLSN, c)
	if err != nil {
		r.log.Warn().Err(err).Msg("stopped; recording the watermark failed: the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
		return
	}
	snap := c.Snapshot
	if !rec {
		// A newer one may be recorded already (the recorder's own, in
		// the meantime): it covers at least as much.
		w, found, err := r.store.LatestWatermark(ctx)
		if err != nil || !found || w.LSN < c.LSN {
			r.log.Warn().Err(err).Str("lsn", c.LSN.String()).
				Msg("stopped; the watermark was not recorded (the slot record refused it): the rows acked since the last recorded watermark count as in flight, and would be handed over again after a slot loss")
			return
		}
		snap = w.Snapshot
	} else {
		r.metrics.WatermarkLSN.Set(float64(c.LSN))
	}
	owed, err := l.cover.recorded(snap)
	switch {
	case err != nil:
		r.log.Warn().Err(err).Msg("stopped; could not read the recorded watermark's snapshot")
	case owed:
		r.log.Warn().Str("lsn", c.LSN.String()).
			Msg("stopped; recorded the watermark, but it does not cover some rows acked (too many transactions acked since the last recorded watermark to list, or a newer watermark recorded meanwhile that does not see them yet): they count as in flight until the next session's watermark, and would be handed over again after a slot loss")
	default:
		r.log.Info().Str("lsn", c.LSN.String()).Msg("stopped; recorded the watermark: it covers every row acked")
	}
}

// stopGrowIDs bounds how far above the stop's snapshot's xmax an acked id
// is read as ended: the ids between are listed as running, and those that
// began after the snapshot and committed before the position read just
// after it are a handful.
const stopGrowIDs = 1 << 14

// stopSnapshot is the stop's snapshot snap with the owed ids of the rows
// acked that it does not see as ended read as ended too; see the comment
// before stopReachShare for why that is sound. Only for a stop that
// reached its candidate with every transaction settled.
func (l *loop) stopSnapshot(snap string) string {
	s, err := store.ParseSnapshot(snap)
	if err != nil {
		return snap
	}
	ids, complete := l.cover.unfinished(s)
	if !complete {
		l.r.log.Warn().Msg("stopping: too many transactions acked since the last recorded watermark to list; the stop's watermark covers only those its snapshot sees as ended")
	}
	if len(ids) == 0 {
		return snap
	}
	w, skipped := s.WithFinished(ids, stopGrowIDs)
	if skipped > 0 {
		l.r.log.Warn().Int("transactions", skipped).Msg("stopping: transactions acked far past the stop's snapshot are left out of its watermark")
	}
	return w.String()
}
