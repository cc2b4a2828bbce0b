// Package standby holds delivery back until the standbys that may be
// promoted have flushed it (run --standby-slot, G14). A message published
// for a transaction that a promotion then takes back would be the dual
// write the outbox exists to prevent: consumers would act on work the
// database no longer has.
//
// A standby's position is read from its physical slot on the primary. A
// named slot that exists but whose standby is disconnected or behind holds
// delivery back: that is the promise (PostgreSQL 17's
// synchronized_standby_slots makes the same trade). A name with no slot
// gates nothing, with a warning: after a failover the new primary has its
// own set of slots, and the relay must not stall forever on a name from the
// old topology.
package standby

import (
	"context"
	"sync"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/retry"
	"github.com/outbox-relay/outbox-relay/replication"
)

// DefaultPoll is how often the standbys' positions are read while
// something waits for them (and never while nothing does).
const DefaultPoll = 20 * time.Millisecond

// Gate reads the named standbys' flushed positions.
type Gate struct {
	q     replication.Querier
	slots []string
	log   zerolog.Logger
	m     *metrics.Metrics
	poll  time.Duration

	mu      sync.Mutex
	missing map[string]bool
	cached  replication.LSN // the lowest flushed position of the last read
	gating  bool            // the last read found at least one named slot
	read    bool            // a read has happened: before it, nothing is known to be flushed
	server  replication.LSN // the server's flushed WAL position at the last read
}

// New returns a gate on slots; nil when slots is empty (nothing to wait for).
func New(q replication.Querier, slots []string, log zerolog.Logger, m *metrics.Metrics) *Gate {
	if len(slots) == 0 {
		return nil
	}
	return &Gate{q: q, slots: slots, log: log.With().Str("component", "standby").Logger(), m: m, poll: DefaultPoll, missing: map[string]bool{}}
}

// Slots are the slot names the gate watches.
func (g *Gate) Slots() []string { return g.slots }

// Flushed reports whether WAL up to lsn is on every named standby, by the
// last read (no query).
func (g *Gate) Flushed(lsn replication.LSN) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.read && (!g.gating || g.cached >= lsn)
}

// Read reads the standbys' positions (one query), records them in the
// metrics and the cache, and warns about names with no slot. It returns
// the lowest flushed position among the slots that exist, and gating false
// when none does.
func (g *Gate) Read(ctx context.Context) (lowest replication.LSN, gating bool, err error) {
	ps, err := replication.StandbyPositions(ctx, g.q, g.slots)
	if err != nil {
		return 0, false, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, p := range ps {
		if !p.Exists {
			if !g.missing[p.Slot] {
				g.log.Warn().Str("standby_slot", p.Slot).Msg("--standby-slot names no physical slot on this server: it holds nothing back (after a failover the new primary has other slots; fix --standby-slot)")
			}
			g.missing[p.Slot] = true
			g.m.StandbySlotMissing.WithLabelValues(p.Slot).Set(1)
			g.m.StandbyLagBytes.WithLabelValues(p.Slot).Set(0)
			continue
		}
		if g.missing[p.Slot] {
			g.log.Info().Str("standby_slot", p.Slot).Msg("standby slot found: delivery waits for its standby again")
		}
		g.missing[p.Slot] = false
		g.m.StandbySlotMissing.WithLabelValues(p.Slot).Set(0)
		g.m.StandbyLagBytes.WithLabelValues(p.Slot).Set(float64(p.Lag))
		g.server = replication.LSN(int64(p.Flushed) + p.Lag)
		if !gating || p.Flushed < lowest {
			lowest = p.Flushed
		}
		gating = true
	}
	g.cached, g.gating, g.read = lowest, gating, true
	return lowest, gating, nil
}

// ServerFlushed is the server's flushed WAL position found by the last
// read (no query); zero before one, or when no named slot exists.
func (g *Gate) ServerFlushed() replication.LSN {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.server
}

// Wait returns once every named standby that exists has flushed lsn, reading
// their positions every poll interval meanwhile; the time spent is reported
// as delivery held back on the poller's path.
func (g *Gate) Wait(ctx context.Context, lsn replication.LSN) error {
	if g.Flushed(lsn) {
		return nil
	}
	// Only the poller waits here: the CDC path gates whole transactions
	// without blocking (internal/relay/gate.go) and reports its own wait.
	defer g.m.StandbyGated.Begin(metrics.GatedPoller, time.Now())()
	for {
		lowest, gating, err := g.Read(ctx)
		if err == nil && (!gating || lowest >= lsn) {
			return nil
		}
		if err != nil && ctx.Err() == nil {
			g.log.Warn().Err(err).Msg("could not read the standbys' positions; delivery waits")
		}
		if err := retry.Sleep(ctx, g.poll); err != nil {
			return err
		}
	}
}
