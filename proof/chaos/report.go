package chaos

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// Takeover is one measured hand-over of the slot from the active relay to
// the standby.
type Takeover struct {
	Cause   string  `json:"cause"` // "sigkill", "partition" or "pause" (relay-paused)
	Seconds float64 `json:"seconds"`
	OK      bool    `json:"ok"`
}

// Report is the outcome of one chaos run.
type Report struct {
	Seed             uint64    `json:"seed"`
	Command          string    `json:"command"`
	Started          time.Time `json:"started"`
	LoadSeconds      float64   `json:"load_seconds"`
	DrainSeconds     float64   `json:"drain_seconds"`
	WalSenderTimeout string    `json:"wal_sender_timeout"`
	Figures
	CommittedTxns  int64 `json:"committed_txns"`
	RolledBackRows int64 `json:"rolled_back_rows"`
	RolledBackTxns int64 `json:"rolled_back_txns"`
	UnknownCommits int64 `json:"commits_with_unknown_outcome"`
	NotPublished   int   `json:"not_published_after_drain"`
	// ConsumerLimitStalls counts consumer-limit injections under which the
	// relay did not read the stream back, or delivered nothing after it,
	// though the limit left room for its reads.
	ConsumerLimitStalls int            `json:"consumer_limit_stalls"`
	MaxSlotLagBytes     int64          `json:"max_slot_lag_bytes"`
	Takeovers           []Takeover     `json:"takeovers"`
	TakeoverFailures    int            `json:"takeover_failures"`
	FailoverEnabled     bool           `json:"failover_enabled,omitempty"`
	Failovers           []Failover     `json:"failovers,omitempty"`
	FailoverFailures    int            `json:"failover_failures,omitempty"`
	Faults              map[string]int `json:"faults"`
	FaultsSkipped       map[string]int `json:"faults_skipped,omitempty"`
	// FaultsSkipReason is the reason of each kind's last skip;
	// FaultsNotApplicable the kinds this run's configuration cannot run
	// (Config.notApplicable), which do not fail it for never biting.
	FaultsSkipReason    map[string]string `json:"faults_skip_reason,omitempty"`
	FaultsNotApplicable map[string]string `json:"faults_not_applicable,omitempty"`
	DuplicateWindow     string            `json:"duplicate_window,omitempty"`
	RelayStarts         int               `json:"relay_starts"`
	RelayExits          int               `json:"relay_unexpected_exits"`
	RelayPanics         int               `json:"relay_panics_or_races"`
	RelayPanicSample    []string          `json:"relay_panic_sample,omitempty"`
	WorkDir             string            `json:"work_dir,omitempty"`

	// FaultsEnabled are the kinds the run was asked for, FaultsBit how
	// many injections of each kind bit (FaultBite): a run passes only when
	// every enabled kind bit at least once, so a schedule that never got
	// to a kind, or faults that hit nothing, cannot pass for a proof.
	FaultsEnabled []string       `json:"faults_enabled"`
	FaultsBit     map[string]int `json:"faults_bit"`
	// Replay is the command that runs this schedule and load again.
	Replay string `json:"replay,omitempty"`

	// Clocks are the measured offsets the deadline figures were judged
	// with, Windows every injected fault's window (Figures.ByFault).
	Clocks  Clocks        `json:"clocks"`
	Windows []FaultWindow `json:"fault_windows,omitempty"`

	// A run against a JetStream cluster (-cluster n).
	ClusterNodes      int            `json:"cluster_nodes,omitempty"`
	StreamReplicas    int            `json:"stream_replicas,omitempty"`
	LeaderChanges     []LeaderChange `json:"node_kills,omitempty"`
	LeaderTransitions int            `json:"stream_leader_changes_seen,omitempty"`
}

// FaultBite says what an injection of kind must have done to count as
// having bitten, rather than having hit nothing.
func FaultBite(kind string) string {
	switch kind {
	case FaultRelayKill:
		return "SIGKILL of a relay whose walsender streamed the slot"
	case FaultNATSKill:
		return "SIGKILL of nats-server (a node with -cluster) while the streaming relay was connected"
	case FaultNATSNodeKill:
		return "SIGKILL of a running cluster node"
	case FaultPGRestartFast, FaultPGRestartImmed:
		return "a restart that ended the session of a relay streaming the slot"
	case FaultPGTermWalsender:
		return "pg_terminate_backend ended a relay's walsender"
	case FaultPGTermConns:
		return "pg_terminate_backend ended a relay's client sessions"
	case FaultNATSCut, FaultPGCut:
		return "the cut closed an open connection of the relay"
	case FaultNATSLatency, FaultPGLatency:
		return "the proxy delayed the relay's traffic"
	case FaultTakeoverKill, FaultTakeoverPartition:
		return "the standby instance took over the slot"
	case FaultNATSLoseTail:
		return "the stream's last sequence after the restart was below what it was before the cut"
	case FaultRelayKillLong:
		return "the relay was down longer than the duplicate window and its restart's read-back found replayed rows already stored"
	case FaultPGFailover:
		return "the promotion took back commits (the new primary lacked rows the old one had committed) and a relay streamed the slot again"
	case FaultBrokerSlow:
		return "the broker's answers to the streaming relay were delayed, it was SIGKILLed and started again, and its restart's read-back of the stream completed while the answers were late"
	case FaultRelayPaused:
		return "the standby took over the slot while the active relay was stopped (SIGSTOP), and it was continued after more than wal_sender_timeout"
	case FaultPollerKilled:
		return "a relay was SIGKILLed with rows of its poller's claims stored in the stream and not completed, and a later claim settled at least one of them, its lease ending more than the duplicate window after it was stored"
	case FaultConsumerLimit:
		return "the relay's read-back after a restart completed while the stream had a max_consumers limit with other consumers present"
	case FaultPGClockShifted:
		return "PostgreSQL's clock was measured off by the -pg-clock-offset asked for, rows reached their deadline on it while the relay was down, and the restarted relay's read-back ran"
	}
	return "unknown fault kind"
}

// Failures lists every figure that must be zero and is not, and every
// enabled fault kind that was not injected or never bit.
func (r *Report) Failures() []string {
	var out []string
	total := 0
	for _, n := range r.Faults {
		total += n
	}
	if total == 0 {
		out = append(out, "faults injected = 0 (a run without faults proves nothing)")
	}
	for _, k := range r.FaultsEnabled {
		if _, na := r.FaultsNotApplicable[k]; na {
			continue
		}
		switch {
		case r.Faults[k] == 0:
			out = append(out, fmt.Sprintf("fault %s injected 0 times (every enabled kind must run at least once: lengthen -duration)", k))
		case r.FaultsBit[k] == 0:
			out = append(out, fmt.Sprintf("fault %s injected %d times and never bit (it must bite at least once: %s)", k, r.Faults[k], FaultBite(k)))
		}
	}
	check := func(name string, v int) {
		if v != 0 {
			out = append(out, fmt.Sprintf("%s = %d (must be 0)", name, v))
		}
	}
	check("lost", r.Lost)
	check("phantoms", r.Phantoms)
	check("stored duplicates", r.StoredDuplicates)
	check("published past the deadline", r.PastDeadline)
	check("stalls under a consumer limit", r.ConsumerLimitStalls)
	check("not published after drain", r.NotPublished)
	check("G3 violations", r.G3Violations)
	check("unknown messages", r.UnknownMsgs)
	check("witness gaps", r.WitnessGaps)
	check("takeover failures", r.TakeoverFailures)
	check("published but taken back by a promotion", r.TakenBackInStream)
	check("failovers without streaming again", r.FailoverFailures)
	if r.FailoverEnabled && len(r.Failovers) == 0 {
		out = append(out, "failovers = 0 (pg-failover was enabled but its turn never came: lengthen -duration)")
	}
	check("relay panics or races", r.RelayPanics)
	if r.G3Checks == 0 {
		out = append(out, "G3 checks = 0 (the run never checked G3)")
	}
	return out
}

// Table renders the report for people: one figure per line, must-be-zero
// figures marked.
func (r *Report) Table() string {
	var b strings.Builder
	row := func(name, value, note string) {
		fmt.Fprintf(&b, "| %-34s | %-34s | %s\n", name, value, note)
	}
	must := func(v int) string {
		if v == 0 {
			return "must be 0: ok"
		}
		return "must be 0: FAIL"
	}
	fmt.Fprintf(&b, "chaos run: seed %d (replay: -seed %d), load %.0fs, drain %.1fs, wal_sender_timeout %s, duplicate window %s\n",
		r.Seed, r.Seed, r.LoadSeconds, r.DrainSeconds, r.WalSenderTimeout, orDash(r.DuplicateWindow))
	if r.Replay != "" {
		fmt.Fprintf(&b, "replay: %s\n", r.Replay)
	}
	row("figure", "value", "")
	row("committed rows (txns)", fmt.Sprintf("%d (%d)", r.CommittedRows, r.CommittedTxns), fmt.Sprintf("%d commits with unknown outcome, resolved by the witness", r.UnknownCommits))
	row("rolled-back rows (txns)", fmt.Sprintf("%d (%d)", r.RolledBackRows, r.RolledBackTxns), "")
	row("messages in the stream (distinct)", fmt.Sprintf("%d (%d)", r.StreamMsgs, r.StreamDistinct), "")
	row("lost", fmt.Sprint(r.Lost), must(r.Lost))
	row("phantoms", fmt.Sprint(r.Phantoms), must(r.Phantoms))
	row("stored duplicates", fmt.Sprint(r.StoredDuplicates), must(r.StoredDuplicates))
	row("published past the deadline", fmt.Sprint(r.PastDeadline), must(r.PastDeadline)+"; "+r.deadlineNote())
	row("  of them written before a SIGSTOP", fmt.Sprint(r.PastDeadlineAfterPause), "not counted above: sent before the relay was stopped, stored after it was continued")
	row("unknown messages", fmt.Sprint(r.UnknownMsgs), must(r.UnknownMsgs))
	row("witness gaps", fmt.Sprint(r.WitnessGaps), must(r.WitnessGaps))
	row("rows not published after drain", fmt.Sprint(r.NotPublished), must(r.NotPublished))
	row("stalls under a consumer limit", fmt.Sprint(r.ConsumerLimitStalls), must(r.ConsumerLimitStalls)+" (consumer-limit: no read-back, or nothing delivered after it)")
	row("max slot lag seen (bytes)", fmt.Sprint(r.MaxSlotLagBytes), "")
	row("G3 checks", fmt.Sprint(r.G3Checks), fmt.Sprintf("%d covered rows handed to the poller", r.G3PollerHandoffs))
	row("G3 violations", fmt.Sprint(r.G3Violations), must(r.G3Violations))
	row("takeover after SIGKILL (s)", takeoverSummary(r.Takeovers, "sigkill"), "")
	row("takeover after partition (s)", takeoverSummary(r.Takeovers, "partition"), "")
	row("takeover after SIGSTOP (s)", takeoverSummary(r.Takeovers, "pause"), "relay-paused")
	row("takeover failures", fmt.Sprint(r.TakeoverFailures), must(r.TakeoverFailures))
	if r.FailoverEnabled {
		r.failoverRows(row, must)
	}
	row("relay starts (unexpected exits)", fmt.Sprintf("%d (%d)", r.RelayStarts, r.RelayExits), "")
	row("relay panics or data races", fmt.Sprint(r.RelayPanics), must(r.RelayPanics))
	if r.ClusterNodes > 0 {
		r.clusterRows(row)
	}
	kinds := slices.Clone(r.FaultsEnabled)
	total := 0
	for k, n := range r.Faults {
		if !slices.Contains(kinds, k) {
			kinds = append(kinds, k)
		}
		total += n
	}
	sort.Strings(kinds)
	row("faults injected (bit)", fmt.Sprint(total), "every enabled kind must be injected and bite at least once")
	for _, k := range kinds {
		var notes []string
		na, isNA := r.FaultsNotApplicable[k]
		switch {
		case isNA:
			notes = append(notes, "not applicable: "+na)
		case r.Faults[k] == 0 || r.FaultsBit[k] == 0:
			notes = append(notes, "FAIL: must bite at least once: "+FaultBite(k))
		}
		if s := r.FaultsSkipped[k]; s > 0 && !isNA {
			why := r.FaultsSkipReason[k]
			if why == "" {
				why = "no relay backend to hit"
				if k == FaultPGFailover {
					why = "already failed over: no standby left"
				}
			}
			notes = append(notes, fmt.Sprintf("%d more skipped (%s)", s, why))
		}
		if kf := r.ByFault[k]; kf != nil && r.Faults[k] > 0 {
			notes = append(notes, kf.String())
		}
		row("  "+k, fmt.Sprintf("%d (%d)", r.Faults[k], r.FaultsBit[k]), strings.Join(notes, "; "))
	}
	if kf := r.ByFault[BeforeFaults]; kf != nil {
		row("  "+BeforeFaults, "-", kf.String())
	}
	for _, s := range [][]string{r.LostSample, r.PhantomSample, r.DuplicateSample, r.PastDeadlineSample, r.TakenBackSample, r.G3ViolationSample, r.WitnessGapSample, r.UnknownMsgSample, r.RelayPanicSample} {
		for _, v := range s {
			fmt.Fprintf(&b, "  evidence: %s\n", v)
		}
	}
	if f := r.Failures(); len(f) > 0 {
		fmt.Fprintf(&b, "RESULT: FAIL (%s); seed %d\n", strings.Join(f, "; "), r.Seed)
	} else {
		fmt.Fprintf(&b, "RESULT: ok; seed %d\n", r.Seed)
	}
	if r.Replay != "" {
		fmt.Fprintf(&b, "replay: %s\n", r.Replay)
	}
	return b.String()
}

func (k *KindFigures) String() string {
	return fmt.Sprintf("in its windows: lost %d, phantoms %d, stored twice %d, past deadline %d", k.Lost, k.Phantoms, k.Duplicates, k.PastDeadline)
}

// deadlineNote says what the deadline figure was judged on.
func (r *Report) deadlineNote() string {
	s := fmt.Sprintf("%d stored messages had a deadline; %d rows expired unstored, %d expired after a copy was stored; clocks: %s",
		r.DeadlineMsgs, r.Expired, r.ExpiredButStored, r.Clocks)
	if r.DeadlineMsgs > 0 {
		s += fmt.Sprintf("; least time left at the store %v", r.MinDeadlineLeft.Round(time.Millisecond))
	}
	if r.PastDeadline > 0 {
		s += fmt.Sprintf(", latest past it %v", r.MaxPastDeadline.Round(time.Millisecond))
	}
	return s
}

// failoverRows are the rows of a run with pg-failover: what each promotion
// took back and how long the relay took to stream again.
func (r *Report) failoverRows(row func(name, value, note string), must func(int) string) {
	row("promotions (PostgreSQL)", fmt.Sprint(len(r.Failovers)), "standby cut off, primary killed -m immediate, standby promoted")
	for i, f := range r.Failovers {
		synced := ""
		if f.PGVersion >= 17 {
			synced = fmt.Sprintf(", failover slot synced before: %v", f.SlotSynced)
		}
		row(fmt.Sprintf("  promotion %d", i+1), fmt.Sprintf("pg %d, slot %s", f.PGVersion, f.SlotPath),
			fmt.Sprintf("cut off %.1fs, standby %d bytes behind at the kill%s", f.CutOffSeconds, f.LagBytes, synced))
		row("    promoted / streaming again (s)", fmt.Sprintf("%.2f / %.2f", f.PromoteSeconds, f.StreamingSeconds),
			fmt.Sprintf("kill -> accepts writes / promotion -> a relay streams the slot (ok %v)", f.OK))
		row("    rows taken back / joined", fmt.Sprintf("%d / %d", f.TakenBack, f.Joined),
			"committed on the old primary, not on the new / held, not seen by a witness (read from the table)")
	}
	row("taken back by promotions (rows)", fmt.Sprint(r.TakenBack), "not in the new history: neither lost nor to be published")
	row("published but taken back", fmt.Sprint(r.TakenBackInStream), must(r.TakenBackInStream))
	row("failovers without streaming again", fmt.Sprint(r.FailoverFailures), must(r.FailoverFailures))
}

func takeoverSummary(ts []Takeover, cause string) string {
	var v []float64
	for _, t := range ts {
		if t.Cause == cause && t.OK {
			v = append(v, t.Seconds)
		}
	}
	return secondsSummary(v)
}

// clusterRows are the rows of a cluster run: what the node kills did to
// the stream's leadership.
func (r *Report) clusterRows(row func(name, value, note string)) {
	row("nats cluster", fmt.Sprintf("%d nodes, stream R%d", r.ClusterNodes, r.StreamReplicas),
		"relay via one proxy per node (no_advertise); cut/latency/partition hit all of them")
	leaderKills, changed, noLeader, notCurrent := 0, 0, 0, 0
	var elect, catchUp []float64
	pairs := map[string]int{}
	for _, lc := range r.LeaderChanges {
		if lc.WasLeader {
			leaderKills++
			if lc.ElectSeconds >= 0 {
				elect = append(elect, lc.ElectSeconds)
			} else {
				noLeader++
			}
		}
		if lc.CatchUpSeconds >= 0 {
			catchUp = append(catchUp, lc.CatchUpSeconds)
		} else {
			notCurrent++
		}
		if lc.Before != lc.After {
			changed++
		}
		pairs[fmt.Sprintf("%s->%s", orDash(lc.Before), orDash(lc.After))]++
	}
	keys := make([]string, 0, len(pairs))
	for k := range pairs {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var ps []string
	for _, k := range keys {
		ps = append(ps, fmt.Sprintf("%s x%d", k, pairs[k]))
	}
	row("node kills (of the stream leader)", fmt.Sprintf("%d (%d)", len(r.LeaderChanges), leaderKills), "nats-kill and nats-node-kill")
	row("stream leader changed by a kill", fmt.Sprintf("%d of %d", changed, len(r.LeaderChanges)), "leader before -> after (node back, replicas current): "+strings.Join(ps, ", "))
	row("new leader after leader kill (s)", secondsSummary(elect), fmt.Sprintf("%d without a new leader within 1 min", noLeader))
	row("replicas current after restart (s)", secondsSummary(catchUp), fmt.Sprintf("%d not current within 1 min", notCurrent))
	row("stream leader changes seen", fmt.Sprint(r.LeaderTransitions), "sampled 4 times a second, any cause")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func secondsSummary(v []float64) string {
	v = append([]float64(nil), v...)
	if len(v) == 0 {
		return "-"
	}
	sort.Float64s(v)
	return fmt.Sprintf("n=%d min %.2f med %.2f max %.2f", len(v), v[0], v[len(v)/2], v[len(v)-1])
}
