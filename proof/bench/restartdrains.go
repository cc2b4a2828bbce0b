package bench

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"strings"
	"time"
)

// RestartDrains is issue 41's drain case: backlogs drained one after the
// other by a relay started for each on one table, slot and stream, with a
// clean stop (SIGTERM) after each, as a deployment restarts; beside it the
// polling publisher drains the same backlogs on its own table. Before
// issue 41 every start read back what the stream had stored recently, and
// the relay's CPU per message grew with each restart (7.0, 10.4, 14.3 µs
// in three drains of 60,000 rows). Part of the default run (about a
// minute).
const RestartDrains = "restart-drains"

// restartDrainsPoll is the polling publisher's side of RestartDrains: a
// path of its own (database, table, stream), not a case of -cases.
const restartDrainsPoll = "restart-drains-poll"

// restartDrainRounds is three: the first drain (a fresh slot and stream)
// and two after clean restarts, what the issue compares.
const restartDrainRounds = 3

// RestartDrain is one backlog drained by both publishers.
type RestartDrain struct {
	Drain   int     `json:"drain"`
	Relay   Result  `json:"relay"`
	Polling Result  `json:"polling"`
	Ratio   float64 `json:"relay_over_polling"`
	// CPUOverFirst is the relay's CPU per message over drain 1's.
	CPUOverFirst float64 `json:"relay_cpu_per_msg_over_drain_1"`
	// From the relay's /metrics at the drain's end, and its log.
	ReadBackMessages float64  `json:"readback_messages"`
	ReadBackSeconds  float64  `json:"readback_seconds"`
	Found            float64  `json:"readback_found"`
	Log              []string `json:"readback_log,omitempty"`
	LoadAvg          string   `json:"loadavg"`
}

// RestartDrainsResult is the case's report.
type RestartDrainsResult struct {
	Rows   int            `json:"rows_per_drain"`
	Drains []RestartDrain `json:"drains"`
	// MedianRatio is the median of the drains' relay / polling rates.
	MedianRatio float64 `json:"median_relay_over_polling"`
}

// restartDrainsGoal and restartCPUGoal are issue 41's "done means": the
// relay drains a backlog at 1.5 times the polling publisher's rate with
// restarts between the drains, and its CPU per message after a restart is
// within 1.3 times the first drain's.
const (
	restartDrainsGoal = 1.5
	restartCPUGoal    = 1.3
)

func (b *bench) restartDrains(ctx context.Context) (RestartDrainsResult, error) {
	res := RestartDrainsResult{Rows: readBackBacklog}
	rp, err := b.setup(ctx, RestartDrains, 0)
	defer b.teardown(rp, RestartDrains, 0)
	if err != nil {
		return res, err
	}
	np, err := b.setup(ctx, restartDrainsPoll, 0)
	defer b.teardown(np, restartDrainsPoll, 0)
	if err != nil {
		return res, err
	}
	var metricsURL string
	rp.start = func() (*proc, error) {
		pr, url, err := b.startRelayMetrics(rp)
		metricsURL = url
		return pr, err
	}
	logPath := filepath.Join(b.dir, rp.db+".log")
	for i := 1; i <= restartDrainRounds; i++ {
		d := RestartDrain{Drain: i, LoadAvg: loadAvg()}
		// The polling publisher first every time, not in turns: the relay's
		// walsender decodes every database's WAL since the slot's
		// restart_lsn, so each relay drain then follows exactly one polling
		// drain's WAL, and the three differ only in the restarts. (In turns,
		// one relay drain followed two: 145 MB from restart_lsn, not 30.)
		for _, p := range []*path{np, rp} {
			// As runCase does before a measured backlog: both drains pay the
			// same full-page images.
			if err := b.s.checkpoint(ctx); err != nil {
				return res, err
			}
			n, err := b.s.streamMsgs(ctx, p.stream)
			if err != nil {
				return res, err
			}
			p.baseMsgs = n
			logAt := fileSize(logPath)
			var atEnd func(*proc) error
			if p == rp {
				atEnd = func(*proc) error {
					text, err := scrape(ctx, metricsURL)
					if err != nil {
						return err
					}
					d.ReadBackMessages, _ = metricSum(text, "outbox_relay_readback_messages_total")
					d.ReadBackSeconds, _ = metricSum(text, "outbox_relay_readback_seconds")
					d.Found, _ = metricSum(text, "outbox_relay_readback_found_total")
					d.Log = readBackLines(logPath, logAt)
					return nil
				}
			}
			r, err := b.backlogThen(ctx, p, res.Rows, atEnd)
			p.idBase += res.Rows
			if err != nil {
				return res, fmt.Errorf("drain %d, %s: %w", i, p.kind, err)
			}
			r.Round = i
			if p == rp {
				r.Case = RestartDrains
				d.Relay = r
				// The next start must find its own walsender, not this
				// one exiting.
				if err := b.s.waitSlotInactive(ctx, rp.db, slotName, 30*time.Second); err != nil {
					return res, err
				}
			} else {
				r.Case = restartDrainsPoll
				d.Polling = r
			}
		}
		d.Ratio = Ratio(d.Relay.MsgsPerSec, d.Polling.MsgsPerSec)
		if len(res.Drains) > 0 {
			d.CPUOverFirst = Ratio(d.Relay.PubCPUPerMsgUS, res.Drains[0].Relay.PubCPUPerMsgUS)
		} else {
			d.CPUOverFirst = 1
		}
		b.cfg.logf("restart drain %d: relay %.0f msg/s, %.2f µs/msg (%.2fx drain 1's), read back %.0f headers in %.3fs; polling %.0f msg/s, %.2f µs/msg; relay / polling %.2fx",
			i, d.Relay.MsgsPerSec, d.Relay.PubCPUPerMsgUS, d.CPUOverFirst, d.ReadBackMessages, d.ReadBackSeconds, d.Polling.MsgsPerSec, d.Polling.PubCPUPerMsgUS, d.Ratio)
		res.Drains = append(res.Drains, d)
	}
	ratios := make([]float64, len(res.Drains))
	for i, d := range res.Drains {
		ratios[i] = d.Ratio
	}
	res.MedianRatio = Median(ratios)
	return res, nil
}

// renderRestartDrains is the case's table and whether the goals are met.
func renderRestartDrains(r *RestartDrainsResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nbacklog drains with restarts between them (issue 41): %d backlogs of %d rows, each drained by a relay started for it on one table, slot and stream and stopped with SIGTERM after it, and by the polling publisher on its own table just before it\n\n",
		len(r.Drains), r.Rows)
	// The relay's messages are all stored (acked) before its rows are all
	// marked; the polling publisher marks in the transaction of each batch,
	// so its two times are one. Both are shown: the rate is to the later.
	// The last count shows how late the relay's end may be seen: its table
	// has no index on state, so the count scans every drain's rows.
	sb.WriteString("| drain | relay msg/s | polling msg/s | relay / polling | relay acked / settled s | last count of relay's unsettled rows s | polling s | relay µs/msg | / drain 1 | polling µs/msg | read-back headers | read-back s | found stored | slot WAL MB at start (from restart_lsn) | load avg |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, d := range r.Drains {
		fmt.Fprintf(&sb, "| %d | %.0f | %.0f | %.2fx | %.2f / %.2f | %.3f | %.2f | %.2f | %.2fx | %.2f | %.0f | %.3f | %.0f | %.1f | %s |\n",
			d.Drain, d.Relay.MsgsPerSec, d.Polling.MsgsPerSec, d.Ratio, d.Relay.Extra["acked_seconds"], d.Relay.Seconds, d.Relay.Extra["pg_check_last_seconds"], d.Polling.Seconds,
			d.Relay.PubCPUPerMsgUS, d.CPUOverFirst, d.Polling.PubCPUPerMsgUS, d.ReadBackMessages, d.ReadBackSeconds, d.Found,
			d.Relay.Extra["slot_wal_mb_from_restart"], d.LoadAvg)
	}
	if len(r.Drains) == 0 {
		return sb.String()
	}
	met := func(ok bool) string {
		if ok {
			return "met"
		}
		return "NOT met"
	}
	worst := 0.0
	for _, d := range r.Drains[1:] {
		worst = max(worst, d.CPUOverFirst)
	}
	fmt.Fprintf(&sb, "\nrelay / polling, median of the drains: %.2fx (goal at least %.1fx: %s); relay CPU per message after restarts, worst over drain 1's: %.2fx (goal within %.1fx: %s)\n",
		r.MedianRatio, restartDrainsGoal, met(r.MedianRatio >= restartDrainsGoal),
		worst, restartCPUGoal, met(!math.IsNaN(worst) && worst <= restartCPUGoal))
	for _, d := range r.Drains {
		writeLog(&sb, fmt.Sprintf("drain %d: the relay's read-back", d.Drain), d.Log)
	}
	return sb.String()
}
