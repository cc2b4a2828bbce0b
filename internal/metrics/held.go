package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// The paths whose delivery can wait for the standbys (run --standby-slot,
// G14): the CDC path holds the transaction at the head of its gate, the
// poller a claimed batch.
const (
	GatedCDC    = "cdc"
	GatedPoller = "poller"
)

var gatedPaths = [...]string{GatedCDC, GatedPoller}

const standbyGatedHelp = "How long delivery has been held back, now, waiting for the standbys to flush it: per path (cdc: the transaction at the head of the CDC gate; poller: a claimed batch), the longest wait in progress; 0 when nothing of that path waits."

// StandbyGated is outbox_relay_standby_held_seconds{path}: for each path, how
// long its longest wait now in progress has held delivery back for the
// standbys; 0 when nothing of that path waits. Every wait records its own
// start and end, and the value is computed at each scrape. It used to be one
// gauge that every waiter set: the CDC gate, and each of the poller's
// pipelined batches, wrote over one another, so a scrape read whichever
// wrote last (a young poller wait hid a CDC transaction held for minutes,
// and the first batch to finish zeroed one still waiting).
type StandbyGated struct {
	desc *prometheus.Desc
	now  func() time.Time

	mu    sync.Mutex
	next  uint64
	waits map[uint64]heldWait
}

type heldWait struct {
	path  string
	since time.Time
}

func newStandbyGated() *StandbyGated {
	return &StandbyGated{
		desc:  prometheus.NewDesc("outbox_relay_standby_held_seconds", standbyGatedHelp, []string{"path"}, nil),
		now:   time.Now,
		waits: map[uint64]heldWait{},
	}
}

// Begin records that a wait of path started at since; end records that it
// is over (calling it again does nothing).
func (h *StandbyGated) Begin(path string, since time.Time) (end func()) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.next++
	id := h.next
	h.waits[id] = heldWait{path: path, since: since}
	return func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		delete(h.waits, id)
	}
}

// Seconds is what a scrape now reports for path.
func (h *StandbyGated) Seconds(path string) float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.seconds(path, h.now())
}

func (h *StandbyGated) seconds(path string, now time.Time) float64 {
	longest := 0.0
	for _, w := range h.waits {
		if w.path == path {
			longest = max(longest, now.Sub(w.since).Seconds())
		}
	}
	return longest
}

// Describe implements prometheus.Collector.
func (h *StandbyGated) Describe(ch chan<- *prometheus.Desc) { ch <- h.desc }

// Collect implements prometheus.Collector: every path, 0 included, so that
// a dashboard and an alert see the series before the first wait.
func (h *StandbyGated) Collect(ch chan<- prometheus.Metric) {
	h.mu.Lock()
	now := h.now()
	values := make([]float64, len(gatedPaths))
	for i, p := range gatedPaths {
		values[i] = h.seconds(p, now)
	}
	h.mu.Unlock()
	for i, p := range gatedPaths {
		ch <- prometheus.MustNewConstMetric(h.desc, prometheus.GaugeValue, values[i], p)
	}
}
