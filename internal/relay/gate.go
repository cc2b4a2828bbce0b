package relay

import (
	"context"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/standby"
	"github.com/outbox-relay/outbox-relay/replication"
)

// With --standby-slot (G14) a transaction's events wait here, in WAL order,
// until its commit (the end LSN its Commit event carries) is flushed on
// every named standby; then they go through the loop as if just read. The
// gate works on whole transactions because only the Commit event says
// where the commit record ends: a standby that flushed part of it would
// lose the transaction in a promotion.
//
// The gate holds at most gateCap events (one batch more at most) and
// rows' bytes (G15): the loop reads the stream only while the gate has
// room and the read limit (loop.mayRead) allows. A transaction larger than
// that fills the gate before its Commit is read. It goes through once the
// standbys flushed the server's flushed WAL position read after its Begin
// arrived: its commit record ends before that position (a transaction is
// decoded only once its commit is flushed), so all of it is on the
// standbys; its events then pass as they are read, until its Commit.
// The standbys' positions are read only while something waits.
//
// The gate's events hold rows counted in the session's byte budget (G15),
// like rows anywhere else in the session: when the budget is spent the
// stream stops reading (replication.Budget), and a transaction whose
// Commit is not read yet is then treated as too large for the gate, since
// its Commit can come only once the gate lets something go.
//
// Why not wait at Begin, before holding any row: pgoutput's Begin carries
// the transaction's final LSN, which is where its commit record starts
// (txn->final_lsn), not where it ends. A standby flushed to it may lack
// the commit record, and a promotion would lose the transaction. Only the
// Commit event (or the server's flushed position read after Begin, above)
// bounds the end.
type gateState struct {
	gate   *standby.Gate
	events []replication.Event
	bytes  int  // the rows' sizes in events
	open   bool // a Begin in events has no Commit yet
	// through: the open head transaction is known to be on the standbys
	// (a transaction larger than the gate); its events pass as read.
	through bool
	// Reading the server's flushed position for a transaction that filled
	// the gate: reads numbered from boundFrom began after it did, and
	// bound is what the first of them found.
	boundFrom  uint64
	bound      replication.LSN
	boundKnown bool
	readsBegun atomic.Uint64
	want       atomic.Bool
	reads      chan gateRead
	// peak is the most events the gate held at once (for tests: G15).
	peak *atomic.Int64
	// budget is the session's byte budget, which also counts the gate's
	// rows; its Waiting says no more events come until some go.
	budget *replication.Budget
	// waits records the head transaction's wait in
	// outbox_relay_standby_held_seconds{path="cdc"}; endWait ends it, nil
	// while nothing waits.
	waits   *metrics.StandbyGated
	endWait func()
}

// gateRead is one read of the standbys' positions: its number, the
// server's flushed WAL position it found, and its error.
type gateRead struct {
	n      uint64
	server replication.LSN
	err    error
}

func newGateState(g *standby.Gate, waits *metrics.StandbyGated, peak *atomic.Int64, budget *replication.Budget) *gateState {
	return &gateState{gate: g, reads: make(chan gateRead), waits: waits, peak: peak, budget: budget}
}

// gateCap is the most events and row bytes the gate holds.
func (l *loop) gateCap() (events, bytes int) {
	return 4 * l.r.cfg.MaxInFlight, l.r.cfg.MaxInFlightBytes
}

// gateReads is the channel of the standbys' position reads; nil without
// --standby-slot.
func (l *loop) gateReads() <-chan gateRead {
	if l.gated == nil {
		return nil
	}
	return l.gated.reads
}

// gateStarved is signalled when the stream starts waiting for budget room;
// nil without --standby-slot.
func (l *loop) gateStarved() <-chan struct{} {
	if l.gated == nil {
		return nil
	}
	return l.budget.Starved()
}

// gateRead takes a read of the standbys' positions.
func (l *loop) gateRead(ctx context.Context, r gateRead, confirms chan replication.LSN) error {
	if r.err != nil && ctx.Err() == nil {
		// End the session rather than wait: the walsender holds a
		// shutting-down server open until this client confirms what it
		// sent, and while the positions cannot be read nothing gated can
		// be released or confirmed. The next session resumes from the
		// slot (found by the chaos run's pg-failover mode: a fast shutdown
		// hung for 60 s).
		return fmt.Errorf("read the standbys' positions (--standby-slot): %w", r.err)
	}
	g := l.gated
	if r.err == nil && g.boundFrom != 0 && !g.boundKnown && r.n >= g.boundFrom {
		g.bound, g.boundKnown = r.server, true
	}
	return l.letThroughGated(ctx, confirms)
}

// stopWaiting ends the head transaction's wait in the metric: it went
// through, or the session ended (the next session's gate starts afresh).
func (g *gateState) stopWaiting() {
	if g.endWait != nil {
		g.endWait()
		g.endWait = nil
	}
}

func (g *gateState) push(ev replication.Event) {
	g.events = append(g.events, ev)
	switch ev.Type {
	case replication.EventBegin:
		g.open = true
	case replication.EventCommit:
		g.open = false
	case replication.EventRow:
		g.bytes += ev.Row.Size()
	}
}

// pop takes the head event.
func (g *gateState) pop() replication.Event {
	ev := g.events[0]
	g.events[0] = replication.Event{}
	g.events = g.events[1:]
	switch ev.Type {
	case replication.EventRow:
		g.bytes -= ev.Row.Size()
	case replication.EventCommit:
		if g.through {
			g.through, g.boundFrom, g.boundKnown = false, 0, false
		}
	}
	return ev
}

// noteDepth records the gate's depth for the peak.
func (g *gateState) noteDepth() {
	if n := int64(len(g.events)); g.peak != nil && n > g.peak.Load() {
		g.peak.Store(n)
	}
}

// full reports whether the gate holds all it may.
func (g *gateState) full(events, bytes int) bool {
	return len(g.events) >= events || g.bytes >= bytes
}

// passable returns how many events at the head may go through now: the
// first transaction's, once its commit is on the standbys; or, for a
// transaction too large for the gate, all of it read so far once it is
// known to be on the standbys.
func (g *gateState) passable(capEvents, capBytes int) int {
	if len(g.events) > 0 && g.events[0].Type == replication.EventPosition {
		return 1 // between transactions: nothing of it is to flush
	}
	for i, ev := range g.events {
		if ev.Type != replication.EventCommit {
			continue
		}
		if g.through || g.gate.Flushed(ev.EndLSN) {
			g.stopWaiting()
			return i + 1
		}
		g.waiting()
		return 0
	}
	if len(g.events) == 0 {
		return 0
	}
	if g.through {
		return len(g.events)
	}
	if !g.open || !(g.full(capEvents, capBytes) || g.budget.Waiting()) {
		return 0 // its Commit is read next
	}
	// The head transaction filled the gate: learn a bound of its end.
	if g.boundFrom == 0 {
		g.boundFrom = g.readsBegun.Load() + 1
	}
	if g.boundKnown && g.gate.Flushed(g.bound) {
		g.stopWaiting()
		g.through = true
		return len(g.events)
	}
	g.waiting()
	return 0
}

// waiting marks the head transaction as waiting for the standbys.
func (g *gateState) waiting() {
	if g.endWait == nil {
		g.endWait = g.waits.Begin(metrics.GatedCDC, time.Now())
	}
	g.want.Store(true)
}

// watch reads the standbys' positions every poll interval while the loop
// wants them, and reports each read.
func (g *gateState) watch(ctx context.Context) {
	pollWhile(ctx, standby.DefaultPoll, g.want.Load, func() gateRead {
		n := g.readsBegun.Add(1)
		_, _, err := g.gate.Read(ctx)
		return gateRead{n: n, server: g.gate.ServerFlushed(), err: err}
	}, g.reads)
}

// letThroughGated feeds the passable head of the gate through the loop, one
// event at a time, as far as the read limit allows.
func (l *loop) letThroughGated(ctx context.Context, confirms chan replication.LSN) error {
	g := l.gated
	for l.mayRead() {
		n := g.passable(l.gateCap())
		if n == 0 {
			break
		}
		g.want.Store(false)
		for i := 0; i < n; i++ {
			if err := l.handleEvent(ctx, g.pop(), confirms); err != nil {
				return err
			}
			if !l.mayRead() {
				// The rest waits; the head is no longer a whole
				// transaction, so release it event by event from here
				// (its Commit, or through, lets it go).
				return nil
			}
		}
	}
	if len(g.events) == 0 {
		g.want.Store(false)
		g.stopWaiting()
	}
	return nil
}
