package replay

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/replication"
)

func TestEstimate(t *testing.T) {
	active := replication.SlotInfo{Exists: true, Active: true, ActivePID: 42}
	inactive := replication.SlotInfo{Exists: true}
	for _, c := range []struct {
		name string
		e    Evidence
		want Horizon
	}{
		{"no slot: nothing replays, whatever waits",
			Evidence{OldestReadySeconds: 3600}, Horizon{}},
		{"streamed: flush_lag",
			Evidence{Slot: active, LagBytes: 10, Timing: replication.SlotTiming{FlushLagSeconds: 2.5, FlushLagKnown: true}},
			Horizon{2.5, SourceFlushLag}},
		{"streamed, no figure, nothing held: caught up",
			Evidence{Slot: active}, Horizon{0, SourceCaughtUp}},
		{"streamed, no figure, WAL held: cannot tell",
			Evidence{Slot: active, LagBytes: 10}, Horizon{}},
		{"an older ready row beats flush_lag",
			Evidence{Slot: active, Timing: replication.SlotTiming{FlushLagSeconds: 2, FlushLagKnown: true}, OldestReadySeconds: 90},
			Horizon{90, SourceOldestReady}},
		{"flush_lag beats a younger ready row",
			Evidence{Slot: active, Timing: replication.SlotTiming{FlushLagSeconds: 200, FlushLagKnown: true}, OldestReadySeconds: 90},
			Horizon{200, SourceFlushLag}},
		{"active without a pid: flush_lag is not its own",
			Evidence{Slot: replication.SlotInfo{Exists: true, Active: true}, Timing: replication.SlotTiming{FlushLagSeconds: 5, FlushLagKnown: true}},
			Horizon{}},
		{"inactive, WAL held: since inactive",
			Evidence{Slot: inactive, LagBytes: 10, Timing: replication.SlotTiming{InactiveSeconds: 600, InactiveKnown: true}},
			Horizon{600, SourceInactive}},
		{"inactive, nothing held: its idle time replays nothing",
			Evidence{Slot: inactive, Timing: replication.SlotTiming{InactiveSeconds: 600, InactiveKnown: true}}, Horizon{}},
		{"inactive before PostgreSQL 17: only the ready row",
			Evidence{Slot: inactive, LagBytes: 10, OldestReadySeconds: 30}, Horizon{30, SourceOldestReady}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := Estimate(c.e); got != c.want {
				t.Errorf("Estimate = %+v, want %+v", got, c.want)
			}
		})
	}
}

func TestWarnings(t *testing.T) {
	window := 2 * time.Minute
	inactive := Evidence{Slot: replication.SlotInfo{Exists: true}, LagBytes: 4096}
	for _, c := range []struct {
		name string
		e    Evidence
		h    Horizon
		want string // prefix of the one warning; empty: none
	}{
		{"inside the window", Evidence{Slot: replication.SlotInfo{Exists: true, Active: true}}, Horizon{119, SourceFlushLag}, ""},
		{"at the window", Evidence{Slot: replication.SlotInfo{Exists: true, Active: true}}, Horizon{120, SourceFlushLag}, ""},
		{"past the window", Evidence{Slot: replication.SlotInfo{Exists: true, Active: true}}, Horizon{3600, SourceOldestReady},
			"WARNING: the replay horizon (~3600s by oldest ready row) exceeds the duplicate window (2m0s)"},
		{"inactive, WAL held, cannot tell since when", inactive, Horizon{}, "NOTE: no relay streams the slot and it holds 4096 bytes unconfirmed"},
		{"inactive, a young ready row does not tell since when", inactive, Horizon{5, SourceOldestReady}, "NOTE: no relay streams the slot"},
		{"inactive, inactive_since inside the window", inactive, Horizon{60, SourceInactive}, ""},
		{"inactive, inactive_since past the window", inactive, Horizon{600, SourceInactive}, "WARNING: the replay horizon (~600s by " + SourceInactive},
		{"no slot", Evidence{}, Horizon{}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := Warnings(c.e, c.h, window)
			switch {
			case c.want == "" && len(got) != 0:
				t.Errorf("Warnings = %q, want none", got)
			case c.want != "" && (len(got) != 1 || !strings.HasPrefix(got[0], c.want)):
				t.Errorf("Warnings = %q, want one starting %q", got, c.want)
			}
		})
	}
}
