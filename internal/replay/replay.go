// Package replay estimates how far back in time a relay that restarted now
// would replay its slot, and says when that reaches past the stream's
// duplicate window. The relay resumes from the slot's confirmed position, so
// it republishes what it had published after that position; the broker drops
// a republish by its Nats-Msg-Id only inside the duplicate window, and may
// store an older one twice.
//
// Read gathers what PostgreSQL can tell; Estimate and Warnings only decide,
// so the decision is tested without a server.
package replay

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Evidence is what PostgreSQL can tell about a slot's replay.
type Evidence struct {
	Slot replication.SlotInfo
	// LagBytes is the WAL the slot holds unconfirmed.
	LagBytes int64
	Timing   replication.SlotTiming
	// OldestReadySeconds is the age of the oldest ready row, zero when there
	// is none: its transaction is not settled, so the slot is confirmed at
	// most up to it and a restart replays at least that far.
	OldestReadySeconds float64
}

// Read gathers the evidence about the slot named slot and st's table from
// the catalog, so an instance that does not stream the slot can report it.
// A missing slot needs nothing more: there is nothing to replay.
func Read(ctx context.Context, q replication.Querier, st *store.Store, slot string) (Evidence, error) {
	var e Evidence
	var err error
	if e.Slot, err = replication.LookupSlot(ctx, q, slot); err != nil || !e.Slot.Exists {
		return e, err
	}
	// A slot dropped since it was looked up leaves the lag zero and the
	// timing unknown, which Estimate reads as "cannot tell".
	if e.LagBytes, _, err = replication.SlotLag(ctx, q, slot); err != nil {
		return e, err
	}
	if e.Timing, _, err = replication.ReadSlotTiming(ctx, q, slot); err != nil {
		return e, err
	}
	if e.OldestReadySeconds, err = st.OldestReadySeconds(ctx); err != nil {
		return e, err
	}
	return e, nil
}

// The sources of an estimate, as status names them.
const (
	SourceFlushLag    = "pg_stat_replication.flush_lag"
	SourceCaughtUp    = "pg_stat_replication (caught up)"
	SourceInactive    = "pg_replication_slots.inactive_since"
	SourceOldestReady = "oldest ready row"
)

// Horizon estimates how far back, in time, a relay that restarted now would
// replay.
type Horizon struct {
	Seconds float64
	// Source names the evidence that gave Seconds; empty when there was
	// none, and then Seconds means nothing.
	Source string
}

// Known reports whether there was any evidence.
func (h Horizon) Known() bool { return h.Source != "" }

// Estimate takes the largest of what the evidence can tell: the walsender's
// flush_lag (the slot is streamed), the time since the slot went inactive
// (while it holds unconfirmed WAL) and the age of the oldest ready row. Each
// is a lower bound of the replay, so the largest is the best one.
func Estimate(e Evidence) Horizon {
	var h Horizon
	consider := func(secs float64, source string) {
		if !h.Known() || secs > h.Seconds {
			h = Horizon{Seconds: secs, Source: source}
		}
	}
	if !e.Slot.Exists {
		// Nothing to replay: ready rows wait for a new slot's handover and
		// are published once.
		return h
	}
	if e.Slot.Active && e.Slot.ActivePID != 0 {
		switch {
		case e.Timing.FlushLagKnown:
			consider(e.Timing.FlushLagSeconds, SourceFlushLag)
		case e.LagBytes == 0:
			consider(0, SourceCaughtUp)
		}
	}
	if !e.Slot.Active && e.LagBytes > 0 && e.Timing.InactiveKnown {
		consider(e.Timing.InactiveSeconds, SourceInactive)
	}
	if e.OldestReadySeconds > 0 {
		consider(e.OldestReadySeconds, SourceOldestReady)
	}
	return h
}

// Warnings says when a relay restart could republish a message after the
// broker forgot its Nats-Msg-Id: the horizon exceeds the duplicate window,
// or an inactive slot holds WAL and PostgreSQL cannot say since when.
func Warnings(e Evidence, h Horizon, window time.Duration) []string {
	var out []string
	if h.Known() && h.Seconds > window.Seconds() {
		out = append(out, fmt.Sprintf("WARNING: the replay horizon (~%.0fs by %s) exceeds the duplicate window (%s): a relay restart now "+
			"republishes messages first published longer ago than the window, and the broker may store them twice; consumers need the inbox",
			h.Seconds, h.Source, window))
	} else if e.Slot.Exists && !e.Slot.Active && e.LagBytes > 0 && h.Source != SourceInactive {
		out = append(out, fmt.Sprintf("NOTE: no relay streams the slot and it holds %d bytes unconfirmed; this PostgreSQL cannot say since when. "+
			"If outbox rows in that WAL were published more than the duplicate window (%s) before the relay resumes, the broker may store them twice",
			e.LagBytes, window))
	}
	return out
}
