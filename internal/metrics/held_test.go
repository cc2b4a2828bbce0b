package metrics

import (
	"maps"
	"testing"
	"time"
)

// Each path reports its longest wait in progress, whoever started or ended
// last: two pipelined poller batches and the CDC gate no longer write over
// one another.
func TestStandbyHeldReportsEachPathsLongestWait(t *testing.T) {
	m := New()
	h := m.StandbyGated
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	now := t0
	h.now = func() time.Time { return now }
	want := func(cdc, poller float64) {
		t.Helper()
		fams, err := m.Registry.Gather()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]float64{}
		for _, f := range fams {
			if f.GetName() != "outbox_relay_standby_held_seconds" {
				continue
			}
			if f.GetType().String() != "GAUGE" || f.GetHelp() != standbyGatedHelp {
				t.Errorf("type %s, help %q", f.GetType(), f.GetHelp())
			}
			for _, s := range f.GetMetric() {
				for _, l := range s.GetLabel() {
					got[l.GetName()+"="+l.GetValue()] = s.GetGauge().GetValue()
				}
			}
		}
		if want := map[string]float64{"path=cdc": cdc, "path=poller": poller}; !maps.Equal(got, want) {
			t.Errorf("exported %v, want %v", got, want)
		}
	}
	want(0, 0)
	endCDC := h.Begin(GatedCDC, t0)
	now = t0.Add(10 * time.Second)
	endBatch1 := h.Begin(GatedPoller, now)
	now = t0.Add(12 * time.Second)
	endBatch2 := h.Begin(GatedPoller, now)
	now = t0.Add(15 * time.Second)
	want(15, 5)
	// The older batch goes through; the younger one still waits.
	endBatch1()
	want(15, 3)
	endBatch1() // twice is once
	endCDC()
	want(0, 3)
	endBatch2()
	want(0, 0)
}
