package bench

import (
	"fmt"
	"math"
	"strings"
)

// Result is one case of one round.
type Result struct {
	Case  string `json:"case"`
	Round int    `json:"round"`
	Rows  int    `json:"rows"`
	// Seconds is the measured interval: for a drain, from the publisher's
	// start to the last row published (acked and its state committed); for
	// live cases, from the first insert to the last message received.
	Seconds    float64 `json:"seconds"`
	MsgsPerSec float64 `json:"msgs_per_sec"`
	// InsertRate is what the producers reached (rows/s) in this case.
	InsertRate float64  `json:"insert_rows_per_sec,omitempty"`
	Latency    *Latency `json:"commit_to_ack,omitempty"`

	// Publisher process (the relay, or the polling publisher) from /proc.
	PubCPUSeconds  float64 `json:"publisher_cpu_seconds,omitempty"`
	PubCPUPerMsgUS float64 `json:"publisher_cpu_us_per_msg,omitempty"`
	PubPeakRSSMB   float64 `json:"publisher_peak_rss_mb,omitempty"`
	WalsenderCPU   float64 `json:"walsender_cpu_seconds,omitempty"`
	NATSCPU        float64 `json:"nats_server_cpu_seconds,omitempty"`
	// MachineBusy is the busy CPU time of the whole machine (both cores,
	// every process, other people's included) over the interval.
	MachineBusy float64 `json:"machine_busy_cpu_seconds,omitempty"`
	// PGCPU is the CPU time of every PostgreSQL server process over the
	// interval (ServerCPU: backends, the walsender, background workers,
	// and those that exited within it).
	PGCPU float64 `json:"postgres_cpu_seconds,omitempty"`
	// WALBytesPerMsg is the WAL the server wrote from the first insert to
	// the last row settled, per row (wal.go).
	WALBytesPerMsg float64 `json:"wal_bytes_per_msg,omitempty"`

	Extra map[string]float64 `json:"extra,omitempty"`

	// Series for the plot: messages received per 100 ms bucket, and every
	// latency; not written to JSON.
	Throughput []int     `json:"-"`
	Latencies  []float64 `json:"-"`
}

// CPUPer100k is the publisher's CPU seconds per 100,000 messages.
func (r Result) CPUPer100k() float64 {
	if r.Rows == 0 {
		return 0
	}
	return r.PubCPUSeconds / float64(r.Rows) * 100_000
}

// FormatTable renders rows as a Markdown table with columns padded to the
// same width, so it reads the same in a terminal and in docs.
func FormatTable(header []string, rows [][]string) string {
	w := make([]int, len(header))
	for i, h := range header {
		w[i] = len(h)
	}
	for _, r := range rows {
		for i, c := range r {
			if i < len(w) && len(c) > w[i] {
				w[i] = len(c)
			}
		}
	}
	var b strings.Builder
	line := func(cells []string) {
		b.WriteString("|")
		for i := range w {
			c := ""
			if i < len(cells) {
				c = cells[i]
			}
			fmt.Fprintf(&b, " %-*s |", w[i], c)
		}
		b.WriteString("\n")
	}
	line(header)
	b.WriteString("|")
	for i := range w {
		b.WriteString(" " + strings.Repeat("-", w[i]) + " |")
	}
	b.WriteString("\n")
	for _, r := range rows {
		line(r)
	}
	return b.String()
}

// num formats x with a precision that suits its size; "-" for zero or NaN
// (a figure that does not apply to the case).
func num(x float64) string {
	switch {
	case math.IsNaN(x) || math.IsInf(x, 0) || x == 0:
		return "-"
	case math.Abs(x) >= 1000:
		return fmt.Sprintf("%.0f", x)
	case math.Abs(x) >= 100:
		return fmt.Sprintf("%.0f", x)
	case math.Abs(x) >= 10:
		return fmt.Sprintf("%.1f", x)
	case math.Abs(x) >= 1:
		return fmt.Sprintf("%.2f", x)
	default:
		return fmt.Sprintf("%.3f", x)
	}
}

// ratio formats a/b as "1.23x", "-" when it does not apply.
func ratio(a, b float64) string {
	r := Ratio(a, b)
	if math.IsNaN(r) || a == 0 {
		return "-"
	}
	return fmt.Sprintf("%.2fx", r)
}
