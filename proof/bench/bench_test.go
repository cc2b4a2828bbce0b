package bench

import (
	"math"
	"os"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	var d []time.Duration
	for i := 1; i <= 100; i++ {
		d = append(d, time.Duration(101-i)*time.Millisecond) // unsorted on purpose
	}
	got := Summarize(d)
	want := Latency{N: 100, P50: 50, P95: 95, P99: 99, Max: 100}
	if got != want {
		t.Fatalf("Summarize = %+v, want %+v", got, want)
	}
	if p := Percentile([]time.Duration{7}, 0.99); p != 7 {
		t.Errorf("one sample: p99 = %v, want 7ns", p)
	}
	if p := Percentile(nil, 0.5); p != 0 {
		t.Errorf("no samples: %v, want 0", p)
	}
	if s := Summarize(nil); s != (Latency{}) {
		t.Errorf("Summarize(nil) = %+v", s)
	}
}

func TestMedian(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want float64
		idx  int
	}{
		{[]float64{3, 1, 2}, 2, 2},
		{[]float64{4, 1, 3, 2}, 2.5, 3},
		{[]float64{5}, 5, 0},
	} {
		if got := Median(tc.in); got != tc.want {
			t.Errorf("Median(%v) = %v, want %v", tc.in, got, tc.want)
		}
		if got := MedianIndex(tc.in); got != tc.idx {
			t.Errorf("MedianIndex(%v) = %v, want %v", tc.in, got, tc.idx)
		}
	}
	if !math.IsNaN(Ratio(1, 0)) {
		t.Error("Ratio(1, 0) is not NaN")
	}
}

func TestFormatTable(t *testing.T) {
	got := FormatTable([]string{"case", "msg/s"}, [][]string{{"cdc-backlog", num(31234.6)}, {"x", num(0)}})
	want := "| case        | msg/s |\n" +
		"| ----------- | ----- |\n" +
		"| cdc-backlog | 31235 |\n" +
		"| x           | -     |\n"
	if got != want {
		t.Fatalf("FormatTable:\n%s\nwant:\n%s", got, want)
	}
	if r := ratio(3, 2); r != "1.50x" {
		t.Errorf("ratio(3, 2) = %q", r)
	}
	if !strings.HasPrefix(num(0.0123), "0.012") {
		t.Errorf("num(0.0123) = %q", num(0.0123))
	}
}

func TestParseStatCPU(t *testing.T) {
	// comm with spaces and a parenthesis; utime 250, stime 50 ticks.
	line := "1234 (a b) c) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 1 0 100 1000 10"
	got, err := parseStatCPU(line)
	if err != nil || got != 3.0 {
		t.Fatalf("parseStatCPU = %v, %v; want 3.0", got, err)
	}
}

func TestWorkID(t *testing.T) {
	if i, ok := parseWorkID(workID(4711)); !ok || i != 4711 {
		t.Fatalf("parseWorkID(workID(4711)) = %d, %v", i, ok)
	}
	if _, ok := parseWorkID("x1"); ok {
		t.Error("parseWorkID accepted x1")
	}
	if p := makePayload(200); len(p) != 200 {
		t.Errorf("makePayload(200) is %d bytes", len(p))
	}
	if got := throughput([]int64{0, int64(50 * time.Millisecond), int64(260 * time.Millisecond)}); len(got) != 3 || got[0] != 1 || got[2] != 1 {
		t.Errorf("throughput = %v", got)
	}
}

func TestParseStatChildren(t *testing.T) {
	// ppid 7; utime 250, stime 50; cutime 1000, cstime 234 ticks.
	line := "1234 (postgres: x (y)) S 7 1234 1234 0 -1 4194560 100 0 0 0 250 50 1000 234 20 0 1 0 100 1000 10"
	st, err := parseStat(line)
	if err != nil || st.ppid != 7 || st.cpu != 3.0 || st.children != 12.34 {
		t.Fatalf("parseStat = %+v, %v; want ppid 7, cpu 3, children 12.34", st, err)
	}
	if _, err := parseStat("1 (x) S 1 2 3"); err == nil {
		t.Error("parseStat accepted a short line")
	}
}

func TestWALShare(t *testing.T) {
	// Producers alone: 100 MB for 100k rows (1,000 B/row). A case of the
	// same 100k rows writing 104 MB: 40 B/msg of the relay's, 4% above.
	per, over := WALShare(104e6, 100_000, 100e6, 100_000)
	if math.Abs(per-40) > 1e-9 || math.Abs(over-0.04) > 1e-12 {
		t.Fatalf("WALShare = %v B/msg, %v; want 40, 0.04", per, over)
	}
	// Different row counts are compared per row: a mark policy doubling it.
	if per, over := WALShare(100e6, 50_000, 100e6, 100_000); per != 1000 || over != 1 {
		t.Errorf("WALShare(50k rows, 2,000 B/row) = %v, %v; want 1000, 1", per, over)
	}
	// Less than the producers (noise) stays negative, not clipped.
	if per, _ := WALShare(99e6, 100_000, 100e6, 100_000); per != -10 {
		t.Errorf("WALShare below the producers = %v; want -10", per)
	}
	if per, over := WALShare(1, 1, 0, 1); !math.IsNaN(per) || !math.IsNaN(over) {
		t.Errorf("no producer WAL: %v, %v; want NaN", per, over)
	}

	rs := []Result{
		{Case: CeilingPG, Round: 1, Rows: 1000, WALBytesPerMsg: 500, Extra: map[string]float64{"wal_bytes": 500_000}},
		{Case: CeilingPG, Round: 2, Rows: 1000, WALBytesPerMsg: 600, Extra: map[string]float64{"wal_bytes": 600_000}},
		{Case: CDCBacklog, Round: 1, Rows: 1000, Extra: map[string]float64{"wal_bytes": 510_000}},
		{Case: CDCLive, Round: 2, Rows: 1000, Extra: map[string]float64{"wal_bytes": 1_200_000}},
		{Case: PollBacklog, Round: 1, Rows: 1000, Extra: map[string]float64{"wal_bytes": 900_000}},
	}
	addWALShares(rs)
	if e := rs[2].Extra; e["relay_wal_bytes_per_msg"] != 10 || e["relay_wal_over_inserts"] != 0.02 || e["producer_wal_bytes_per_msg"] != 500 {
		t.Errorf("cdc-backlog, round 1: %v; want 10 B/msg, 2%% over round 1's 500", e)
	}
	if e := rs[3].Extra; e["relay_wal_bytes_per_msg"] != 600 || e["relay_wal_over_inserts"] != 1 {
		t.Errorf("cdc-live, round 2: %v; want 600 B/msg over round 2's 600", e)
	}
	// PostgreSQL's CPU for the path: a backlog case's is all the path's; a
	// live case's holds the producers' inserts, ceiling-pg's per row.
	ceil := Result{Case: CeilingPG, Rows: 1000, PGCPU: 0.04}
	if got := PathPGMicros(Result{Case: CDCBacklog, Rows: 1000, PGCPU: 0.03, WalsenderCPU: 0.01}, ceil); math.Abs(got-20) > 1e-9 {
		t.Errorf("PathPGMicros(backlog) = %v; want 20", got)
	}
	if got := PathPGMicros(Result{Case: CDCLive, Rows: 2000, PGCPU: 0.2, WalsenderCPU: 0.02}, ceil); math.Abs(got-50) > 1e-9 {
		t.Errorf("PathPGMicros(live) = %v; want 90 - 40 = 50", got)
	}
	if _, ok := rs[4].Extra["relay_wal_bytes_per_msg"]; ok {
		t.Error("poll-backlog (its own table) got a share against ceiling-pg")
	}
}

func TestPolicyNone(t *testing.T) {
	c := Config{Rows: 1, RowsPerTx: 1, Producers: 1, Payload: 16, Rounds: 1, Policy: "none", NaiveMode: "async", ProfileCase: CDCBacklog}
	if err := c.validate(); err != nil {
		t.Fatalf("-policy none: %v", err)
	}
	c.Policy = "nope"
	if err := c.validate(); err == nil {
		t.Error("-policy nope accepted")
	}
	if naivePolicy("none") != "mark" || naivePolicy("delete") != "delete" {
		t.Error("the polling publisher does not mark under none, or does not keep delete")
	}
	if q := unsettledSQL("none"); !strings.Contains(q, "pg_visible_in_snapshot(o.xact_id") || !strings.Contains(q, "watermark_lsn DESC") {
		t.Errorf("unsettled rows under none do not use the watermark: %s", q)
	}
}

func TestRenderWALCPU(t *testing.T) {
	rep := Report{Config: Config{Policy: "none"}, Medians: []Result{
		{Case: CeilingPG, Rows: 1000, MsgsPerSec: 10000, InsertRate: 10000, WALBytesPerMsg: 500, PGCPU: 0.04,
			Extra: map[string]float64{"wal_bytes": 500_000, "wal_fpi_share": 0}},
		{Case: CDCBacklog, Rows: 1000, Seconds: 2, InsertRate: 5000, WALBytesPerMsg: 510, PGCPU: 0.035, WalsenderCPU: 0.01, PubCPUSeconds: 0.02, PubCPUPerMsgUS: 20,
			Extra: map[string]float64{"wal_bytes": 510_000, "wal_fpi_share": 0, "path_pg_us_per_msg": 25, "relay_wal_bytes_per_msg": 10, "relay_wal_over_inserts": 0.02, "acked_seconds": 1.5}},
	}}
	out := renderWALCPU(rep)
	if !strings.Contains(out, "policy none; polling publisher: mark") {
		t.Errorf("renderWALCPU does not say the polling publisher marks under none:\n%s", out)
	}
	_, row, _ := strings.Cut(out, "| cdc-backlog")
	row, _, _ = strings.Cut(row, "\n")
	// WAL 510 B/msg, +10 B/msg and +2% over the inserts, no FPI, producers
	// at 0.50x, CPU per message: relay 20, walsender 10, the rest of
	// PostgreSQL 25, relay plus PostgreSQL 55; acked at 1.5 s, settled at 2.
	for _, want := range []string{"| 510 ", "| +10.0 ", "| +2.0%", "| 0.0%", "| 0.50x", "| 20.0 ", "| 10.0 ", "| 25.0 ", "| 55.0 ", "| +25.0 ", "| 1.50 / 2.00"} {
		if !strings.Contains(row, want) {
			t.Errorf("cdc-backlog row lacks %q: %s", want, row)
		}
	}
}

// The read-back case reads its figures from the relay's /metrics: a metric
// summed over the label sets that hold the asked labels, not confused with
// a metric whose name extends it.
func TestMetricSum(t *testing.T) {
	text := `# HELP outbox_relay_readback_seconds How long.
# TYPE outbox_relay_readback_seconds gauge
outbox_relay_readback_seconds 0.125
outbox_relay_readback_found_total 6645
outbox_relay_readback_found_total_extra 1
outbox_relay_messages_published_total{path="cdc",result="ok"} 24000
outbox_relay_messages_published_total{path="poller",result="ok"} 7
outbox_relay_messages_published_total{path="cdc",result="duplicate"} 12
outbox_relay_messages_published_total{path="cdc",result="duplicate_x"} 1000
`
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
		ok     bool
	}{
		{"outbox_relay_readback_seconds", nil, 0.125, true},
		{"outbox_relay_readback_found_total", nil, 6645, true},
		{"outbox_relay_messages_published_total", []string{`result="ok"`}, 24007, true},
		{"outbox_relay_messages_published_total", []string{`path="cdc"`, `result="ok"`}, 24000, true},
		{"outbox_relay_messages_published_total", []string{`result="duplicate"`}, 12, true},
		{"outbox_relay_messages_published_total", []string{`result="error"`}, 0, false},
		{"outbox_relay_readback_messages_total", nil, 0, false},
	} {
		got, ok := metricSum(text, tc.name, tc.labels...)
		if got != tc.want || ok != tc.ok {
			t.Errorf("metricSum(%s, %v) = %v, %v; want %v, %v", tc.name, tc.labels, got, ok, tc.want, tc.ok)
		}
	}
}

func TestRenderReadBack(t *testing.T) {
	out := renderReadBack(&ReadBackResult{Rate: 2000, DupWindowSeconds: 2, BeforeKillSeconds: 8, Rounds: []ReadBackRound{
		{ReadBack: true, OutageSeconds: 3, Rows: 22000, StoredAtKill: 15000, ReadBackSeconds: 0.2, ReadBackMessages: 14000, Found: 4000, DrainSeconds: 1.5, DrainMsgsPerSec: 4667, AfterReadBackMsgsPerSec: 5385, LoadAvg: "1.00 0.50 0.20"},
		{ReadBack: false, Backlog: true, OutageSeconds: 3, Rows: 22000, StoredAtKill: 15000, StoredTwice: 4000, DrainSeconds: 1.4, DrainMsgsPerSec: 5000, AfterReadBackMsgsPerSec: 5000},
	}})
	for _, want := range []string{
		"| 2000 rows/s | on | 3 | 22000 | 15000 | 0.200 | 14000 | 4000 | 0 | 0 | 1.50 | 4667 | 5385 | 1.00 0.50 0.20 |",
		"| backlog, killed half way | off (--readback-limit 0) | 3 | 22000 | 15000 | 0.000 | 0 | 0 | 0 | 4000 | 1.40 | 5000 | 5000 |  |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("renderReadBack lacks %q:\n%s", want, out)
		}
	}
}

// A clean stop's restart is reported from its own /metrics and log lines;
// a session with no line about a read-back says so rather than print
// nothing.
func TestRenderReadBackCleanStop(t *testing.T) {
	out := renderReadBack(&ReadBackResult{Rate: 2000, CleanStop: &CleanStopRound{
		Backlog: 60000, DrainMsgsPerSec: 20000, StopSeconds: 0.25, Rows: 100,
		ReadBackSeconds: 0.004, PublishedOK: 100, Log: []string{`{"level":"info","after_seq":123,"read":0}`},
	}})
	for _, want := range []string{
		"| restarted after its clean stop | - | - | 0.004 | 0 | 0 | 100 | 0 | |",
		`  {"level":"info","after_seq":123,"read":0}`,
		"the draining session's read-back, relay log:\n  (no line about a read-back)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("renderReadBack lacks %q:\n%s", want, out)
		}
	}
}

func TestRenderRestartDrains(t *testing.T) {
	d := func(n int, relay, poll, us, over float64) RestartDrain {
		return RestartDrain{Drain: n, Relay: Result{MsgsPerSec: relay, PubCPUPerMsgUS: us}, Polling: Result{MsgsPerSec: poll, PubCPUPerMsgUS: 10},
			Ratio: relay / poll, CPUOverFirst: over}
	}
	r := &RestartDrainsResult{Rows: 60000, Drains: []RestartDrain{d(1, 30000, 20000, 7, 1), d(2, 28000, 20000, 7.7, 1.1), d(3, 26000, 20000, 9.8, 1.4)}, MedianRatio: 1.4}
	out := renderRestartDrains(r)
	for _, want := range []string{
		"| 2 | 28000 | 20000 | 1.40x | 0.00 / 0.00 | 0.000 | 0.00 | 7.70 | 1.10x | 10.00 |",
		"median of the drains: 1.40x (goal at least 1.5x: NOT met)",
		"worst over drain 1's: 1.40x (goal within 1.3x: NOT met)",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("renderRestartDrains lacks %q:\n%s", want, out)
		}
	}
}

// Only the lines past the offset (the session's own) about a read-back.
func TestReadBackLines(t *testing.T) {
	path := t.TempDir() + "/relay.log"
	before := "{\"message\":\"read the stream back before replaying: old session\"}\n"
	after := "{\"message\":\"streaming slot\"}\n{\"after_seq\":7,\"message\":\"read the stream back before replaying: x\"}\n"
	if err := os.WriteFile(path, []byte(before+after), 0o644); err != nil {
		t.Fatal(err)
	}
	got := readBackLines(path, int64(len(before)))
	if len(got) != 1 || !strings.Contains(got[0], `"after_seq":7`) {
		t.Fatalf("readBackLines = %q", got)
	}
	if n := fileSize(path + ".none"); n != 0 {
		t.Errorf("fileSize of a missing file = %d", n)
	}
}
