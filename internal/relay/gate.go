package relay

import (
	"context"
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
// Reading WAL continues while the gate holds fewer than gatedCap events, or
// while a transaction is open (its Commit is needed to decide), so a
// transaction's rows wait in memory until its commit is on the standbys.
// The standbys' positions are read only while something waits.
type gateState struct {
	gate   *standby.Gate
	events []replication.Event
	open   bool // a Begin in events has no Commit yet
	want   atomic.Bool
	reads  chan error
	// held records the head transaction's wait in
	// outbox_relay_standby_held_seconds{path="cdc"}; endHeld ends it, nil
	// while nothing waits.
	held    *metrics.StandbyHeld
	endHeld func()
}

func newGateState(g *standby.Gate, held *metrics.StandbyHeld) *gateState {
	return &gateState{gate: g, reads: make(chan error), held: held}
}

// stopWaiting ends the head transaction's wait in the metric: it went
// through, or the session ended (the next session's gate starts afresh).
func (g *gateState) stopWaiting() {
	if g.endHeld != nil {
		g.endHeld()
		g.endHeld = nil
	}
}

func (g *gateState) push(ev replication.Event) {
	g.events = append(g.events, ev)
	switch ev.Type {
	case replication.EventBegin:
		g.open = true
	case replication.EventCommit:
		g.open = false
	}
}

// readMore reports whether the loop may read another event into the gate.
func (g *gateState) readMore(capacity int) bool { return g.open || len(g.events) < capacity }

// releasable returns how many events at the head may go through now: the
// first transaction's, once its commit is on the standbys.
func (g *gateState) releasable() int {
	for i, ev := range g.events {
		if ev.Type != replication.EventCommit {
			continue
		}
		if g.gate.Flushed(ev.EndLSN) {
			g.stopWaiting()
			return i + 1
		}
		if g.endHeld == nil {
			g.endHeld = g.held.Begin(metrics.HeldCDC, time.Now())
		}
		g.want.Store(true)
		return 0
	}
	return 0
}

// watch reads the standbys' positions every poll interval while the loop
// wants them, and reports each read.
func (g *gateState) watch(ctx context.Context) {
	pollWhile(ctx, standby.DefaultPoll, g.want.Load, func() error {
		_, _, err := g.gate.Read(ctx)
		return err
	}, g.reads)
}

// releaseGated feeds the releasable head of the gate through the loop, one
// event at a time, stopping when the loop cannot take more (a row waits for
// in-flight room, or too many rows of held aggregates are parked).
func (l *loop) releaseGated(ctx context.Context, confirms chan replication.LSN) error {
	g := l.gated
	for l.blocked == nil && !l.stopping && (l.order == nil || l.order.parked < l.r.cfg.MaxInFlight) {
		n := g.releasable()
		if n == 0 {
			break
		}
		g.want.Store(false)
		for i := 0; i < n; i++ {
			ev := g.events[0]
			g.events[0] = replication.Event{}
			g.events = g.events[1:]
			if err := l.handleEvent(ctx, ev, confirms); err != nil {
				return err
			}
			if l.blocked != nil {
				// The rest of this transaction waits with the row; the
				// head is no longer a whole transaction, so release it
				// event by event from here (its Commit is still ahead).
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
