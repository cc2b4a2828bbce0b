package bench

import (
	"fmt"
	"strings"
)

// Render prints the medians as a table, with each path's throughput as a
// ratio to the ceilings and to the polling publisher, and the producers'
// insert rate as a ratio to their rate with no relay.
func Render(rep Report) string {
	by := map[string]Result{}
	for _, r := range rep.Medians {
		by[r.Case] = r
	}
	pgCeil, jsCeil := by[CeilingPG].MsgsPerSec, by[CeilingJS].MsgsPerSec
	baseline := map[string]string{
		CDCBacklog: PollBacklog, PollerBacklog: PollBacklog,
		CDCLive: PollLive, PollerLive: PollLive,
	}
	paced := rep.Config.Rate > 0
	rounds := map[string][]string{}
	for _, r := range rep.Results {
		v := num(medianKey(r, paced))
		if paced && r.Latency != nil && len(rounds[r.Case]) == 0 {
			v = "p99 " + v
		}
		rounds[r.Case] = append(rounds[r.Case], v)
	}
	header := []string{"case", "rows", "msg/s", "rounds (median of)", "/pg ceil", "/js ceil", "/polling",
		"insert rows/s", "/no relay", "p50 ms", "p95 ms", "p99 ms", "max ms",
		"pub CPU s/100k", "pub µs/msg", "pub RSS MB", "walsender CPU s", "nats CPU s", "machine CPU s"}
	var rows [][]string
	for _, r := range rep.Medians {
		row := []string{r.Case, fmt.Sprint(r.Rows), num(r.MsgsPerSec), strings.Join(rounds[r.Case], " "), "-", "-", "-", "-", "-"}
		if r.Case != CeilingPG && r.Case != CeilingJS {
			row[4], row[5] = ratio(r.MsgsPerSec, pgCeil), ratio(r.MsgsPerSec, jsCeil)
			if base, ok := baseline[r.Case]; ok {
				row[6] = ratio(r.MsgsPerSec, by[base].MsgsPerSec)
			}
		}
		if r.Case != CeilingJS {
			row[7] = num(r.InsertRate)
			if r.Case != CeilingPG {
				row[8] = ratio(r.InsertRate, pgCeil)
			}
		}
		if l := r.Latency; l != nil {
			row = append(row, num(l.P50), num(l.P95), num(l.P99), num(l.Max))
		} else {
			row = append(row, "-", "-", "-", "-")
		}
		row = append(row, num(r.CPUPer100k()), num(r.PubCPUPerMsgUS), num(r.PubPeakRSSMB),
			num(r.WalsenderCPU), num(r.NATSCPU), num(r.MachineBusy))
		rows = append(rows, row)
	}
	var b strings.Builder
	c := rep.Config
	fmt.Fprintf(&b, "\nworkload: %d rows (live: %d), %d rows/tx, %d B payload, %d producers, live rate %s, policy %s, %d round(s), polling publisher %s with %v poll interval\n",
		c.Rows, c.liveRows(), c.RowsPerTx, c.Payload, c.Producers, rateText(c.Rate), c.Policy, c.Rounds, c.NaiveMode, c.PollInterval)
	if c.RelayPGOptions != "" {
		fmt.Fprintf(&b, "relay sessions run with PostgreSQL options %q\n", c.RelayPGOptions)
	}
	fmt.Fprintf(&b, "machine: %s, %s CPUs, %s; load at start %s\n\n", rep.Machine["cpu"], rep.Machine["cpus"], rep.Machine["memory"], rep.Machine["loadavg_at_start"])
	b.WriteString(FormatTable(header, rows))
	b.WriteString(renderWALCPU(rep))
	b.WriteString(renderInsertWindow(rep))
	b.WriteString(renderDecode(rep))
	if ir := rep.Idle; ir != nil {
		fmt.Fprintf(&b, "\nidle (%.0f s, no traffic, poller paused): %d transactions in the relay's database, %d of %d relay backends active; relay CPU %.2f s, walsender CPU %.2f s\n",
			ir.Seconds, ir.Xacts, ir.BackendsActive, ir.Backends, ir.RelayCPU, ir.WalsenderCPU)
	}
	if rep.BigTable != nil {
		b.WriteString(renderBigTable(rep.BigTable))
	}
	if p := rep.Profile; p != nil {
		fmt.Fprintf(&b, "%s (relay in-process, profiled): %.0f msg/s", p.Case, p.MsgsPerSec)
		if p.PubCPUPerMsgUS > 0 {
			fmt.Fprintf(&b, ", process CPU %.2f µs/msg (relay plus the benchmark's polling)", p.PubCPUPerMsgUS)
		}
		if l := p.Latency; l != nil {
			fmt.Fprintf(&b, ", commit-to-ack p50 %s p99 %s ms", num(l.P50), num(l.P99))
		}
		b.WriteString("\n")
	}
	return b.String()
}

func rateText(r float64) string {
	if r <= 0 {
		return "max"
	}
	return fmt.Sprintf("%.0f rows/s", r)
}

// renderWALCPU is the per-message cost in the database of each case (issue
// 23, section 3): WAL written, the relay's share of it over the producers'
// inserts alone, and CPU by process, PostgreSQL's included.
func renderWALCPU(rep Report) string {
	by := map[string]Result{}
	for _, r := range rep.Medians {
		by[r.Case] = r
	}
	pgCeil := by[CeilingPG].MsgsPerSec
	header := []string{"case", "rows", "WAL B/msg", "FPI share", "checkpoints", "relay WAL B/msg", "relay WAL / inserts",
		"drain WAL B/msg", "/no relay", "pub µs/msg", "walsender µs/msg", "pg other µs/msg", "pub+pg µs/msg", "path pg µs/msg", "pub+ws+path pg µs/msg", "acked/settled s"}
	var rows [][]string
	for _, r := range rep.Medians {
		if r.WALBytesPerMsg == 0 && r.PGCPU == 0 {
			continue
		}
		e := r.Extra
		perMsg := func(sec float64) float64 { return sec / float64(r.Rows) * 1e6 }
		row := []string{r.Case, fmt.Sprint(r.Rows), num(r.WALBytesPerMsg), "-", fmt.Sprint(e["checkpoints_during"]),
			"-", "-", num(e["drain_wal_bytes_per_msg"]), "-",
			num(r.PubCPUPerMsgUS), num(perMsg(r.WalsenderCPU)), num(perMsg(r.PGCPU - r.WalsenderCPU)),
			num(perMsg(r.PubCPUSeconds + r.PGCPU)), "-", "-", "-"}
		if v, ok := e["path_pg_us_per_msg"]; ok {
			row[13], row[14] = signed(v), num(r.PubCPUPerMsgUS+perMsg(r.WalsenderCPU)+v)
		}
		if fpi, ok := e["wal_fpi_share"]; ok {
			row[3] = fmt.Sprintf("%.1f%%", 100*fpi)
		}
		// From the case's start: the last message in the stream, the last
		// row settled (marked, deleted, or covered by the watermark).
		if a, ok := e["acked_seconds"]; ok {
			row[15] = num(a) + " / " + num(r.Seconds)
		} else if st, ok := e["settled_seconds"]; ok {
			row[15] = num(r.Seconds) + " / " + num(st)
		}
		if _, ok := e["relay_wal_bytes_per_msg"]; ok {
			row[5], row[6] = signed(e["relay_wal_bytes_per_msg"]), fmt.Sprintf("%+.1f%%", 100*e["relay_wal_over_inserts"])
		}
		if r.Case != CeilingPG {
			row[8] = ratio(r.InsertRate, pgCeil)
		}
		rows = append(rows, row)
	}
	if len(rows) == 0 {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "\nper message in the database (policy %s; polling publisher: %s): WAL from the first insert to the last row settled "+
		"(each case after a forced CHECKPOINT; FPI share by pg_waldump); relay WAL = the case's WAL less ceiling-pg's of the same round "+
		"(CDC and poller cases, same table and rows); drain WAL = from the publisher's start (backlog); CPU: pg = every PostgreSQL "+
		"process but the benchmark's own count of unsettled rows, \"pg other\" without the walsender (live cases and ceiling-pg: the producers' backends included); pub+pg = publisher plus all of PostgreSQL; path pg = \"pg other\" less, in live cases, ceiling-pg's per row (the producers' inserts), and pub+ws+path pg the path's CPU per message with it\n\n",
		rep.Config.Policy, naivePolicy(rep.Config.Policy))
	b.WriteString(FormatTable(header, rows))
	return b.String()
}

// signed formats a difference, which may be negative or zero (noise).
func signed(x float64) string { return fmt.Sprintf("%+.1f", x) }

// renderInsertWindow says where the two cores went while the producers
// inserted (insertWindow): cores busy on average, and each process's
// cores, so that the producers' rate beside a publisher can be set against
// what the publisher's processes took from them. "pg" is every PostgreSQL
// process (the producers' backends, the walsender, the publisher's
// backends); "bench" is this process (the producers' client side and the
// consumer of the stream); "other" is what is left (the kernel's threads,
// anything else running).
func renderInsertWindow(rep Report) string {
	header := []string{"case", "insert rows/s", "insert s", "cores busy", "pg", "of it walsender", "pub", "nats", "bench", "other", "machine µs/row"}
	var rows [][]string
	for _, r := range rep.Medians {
		e := r.Extra
		secs, ok := e["insert_seconds"]
		if !ok || secs <= 0 {
			continue
		}
		cores := func(k string) float64 { return e["insert_"+k+"_cpu_s"] / secs }
		other := cores("machine") - cores("pg") - cores("pub") - cores("nats") - cores("bench")
		rows = append(rows, []string{r.Case, num(r.InsertRate), num(secs), num(cores("machine")), num(cores("pg")), num(cores("walsender")),
			num(cores("pub")), num(cores("nats")), num(cores("bench")), signed(other),
			num(e["insert_machine_cpu_s"] / (secs * r.InsertRate) * 1e6)})
	}
	if len(rows) == 0 {
		return ""
	}
	return "\nwhile the producers inserted (median round): cores busy on average, by process; machine µs/row = all CPU over the rows inserted\n\n" +
		FormatTable(header, rows)
}
