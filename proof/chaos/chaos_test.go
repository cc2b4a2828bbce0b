package chaos

import (
	"bufio"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
)

// echoServer answers every line with the same line.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); _, _ = io.Copy(c, c) }()
		}
	}()
	return ln.Addr().String()
}

func newTestProxy(t *testing.T) *Proxy {
	t.Helper()
	p, err := NewProxy(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

type client struct {
	c net.Conn
	r *bufio.Reader
}

func dial(t *testing.T, p *Proxy) *client {
	t.Helper()
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", fmtInt(p.Port())))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &client{c: c, r: bufio.NewReader(c)}
}

func fmtInt(n int) string { return strconv.Itoa(n) }

// roundTrip sends a line and waits up to timeout for its echo.
func (c *client) roundTrip(line string, timeout time.Duration) (string, error) {
	_ = c.c.SetDeadline(time.Now().Add(timeout))
	if _, err := c.c.Write([]byte(line + "\n")); err != nil {
		return "", err
	}
	s, err := c.r.ReadString('\n')
	return strings.TrimSuffix(s, "\n"), err
}

func TestProxyPassAndLatency(t *testing.T) {
	p := newTestProxy(t)
	c := dial(t, p)
	if got, err := c.roundTrip("hello", 2*time.Second); err != nil || got != "hello" {
		t.Fatalf("pass: got %q, %v", got, err)
	}
	if n := p.Delayed(); n != 0 {
		t.Fatalf("pass mode delayed %d chunks", n)
	}
	p.Set(Latency, 150*time.Millisecond)
	start := time.Now()
	if got, err := c.roundTrip("slow", 5*time.Second); err != nil || got != "slow" {
		t.Fatalf("latency: got %q, %v", got, err)
	}
	// Both directions are delayed.
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("latency 150ms each way: round trip took %v, want >= 300ms", d)
	}
	// Many chunks in flight are delayed together, not one after another.
	start = time.Now()
	for i := range 20 {
		if _, err := c.c.Write([]byte("x" + fmtInt(i) + "\n")); err != nil {
			t.Fatal(err)
		}
	}
	_ = c.c.SetDeadline(time.Now().Add(5 * time.Second))
	for i := range 20 {
		s, err := c.r.ReadString('\n')
		if err != nil || s != "x"+fmtInt(i)+"\n" {
			t.Fatalf("line %d: got %q, %v (order must be kept)", i, s, err)
		}
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("20 lines under 150ms latency took %v: latency must not serialise chunks", d)
	}
	// What tells a latency fault that bit from one that delayed nothing.
	if n := p.Delayed(); n < 4 {
		t.Errorf("latency delayed %d chunks, want at least the round trip's 2 and a chunk each way of the lines", n)
	}
	p.Set(Pass, 0)
	if got, err := c.roundTrip("again", 2*time.Second); err != nil || got != "again" {
		t.Fatalf("pass after latency: got %q, %v", got, err)
	}
}

func TestProxyCut(t *testing.T) {
	p := newTestProxy(t)
	c := dial(t, p)
	if _, err := c.roundTrip("before", 2*time.Second); err != nil {
		t.Fatal(err)
	}
	p.Set(Cut, 0)
	if _, err := c.roundTrip("during", 2*time.Second); err == nil {
		t.Fatal("an existing connection still works after the cut")
	}
	// New connections are accepted and closed at once.
	c2 := dial(t, p)
	if _, err := c2.roundTrip("new", 2*time.Second); err == nil {
		t.Fatal("a new connection works during the cut")
	}
	p.Set(Pass, 0)
	c3 := dial(t, p)
	if got, err := c3.roundTrip("after", 2*time.Second); err != nil || got != "after" {
		t.Fatalf("after healing: got %q, %v", got, err)
	}
}

func TestProxyBlackhole(t *testing.T) {
	p := newTestProxy(t)
	c := dial(t, p)
	if _, err := c.roundTrip("before", 2*time.Second); err != nil {
		t.Fatal(err)
	}
	p.Set(Blackhole, 0)
	// The connection stays open and writes succeed, but nothing comes back:
	// a timeout, not an error, is what the peers see.
	_, err := c.roundTrip("lost", 300*time.Millisecond)
	if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("during the blackhole: got %v, want a timeout", err)
	}
	c2 := dial(t, p)
	_, err = c2.roundTrip("new", 300*time.Millisecond)
	if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("new connection during the blackhole: got %v, want a timeout", err)
	}
	p.Set(Pass, 0)
	// Connections that lost bytes are closed on heal; new ones work.
	_ = c.c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.r.ReadString('\n'); err == nil {
		t.Fatal("a blackholed connection delivered data after the heal")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("a blackholed connection was not closed on heal")
	}
	c3 := dial(t, p)
	if got, err := c3.roundTrip("after", 2*time.Second); err != nil || got != "after" {
		t.Fatalf("after healing: got %q, %v", got, err)
	}
	waitFor(t, func() bool { return p.Conns() == 1 }, "closed connections to leave the proxy")
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func lsn(s string) pglogrepl.LSN {
	l, err := pglogrepl.ParseLSN(s)
	if err != nil {
		panic(err)
	}
	return l
}

func TestWitnessParser(t *testing.T) {
	var w WitnessParser
	feed := func(l string, xid uint32, data string) []WitnessRow { return w.Feed(lsn(l), xid, data) }
	if got := feed("0/100", 7, "BEGIN 7"); got != nil {
		t.Fatalf("BEGIN: %v", got)
	}
	feed("0/110", 7, "table public.outbox: INSERT: work_id[text]:'w-0-1' kind[text]:'order' payload[jsonb]:'{}'")
	// Interleaved transaction (only possible across calls, but harmless).
	feed("0/120", 8, "table public.outbox: INSERT: work_id[text]:'w-1-1' kind[text]:'mail'")
	feed("0/130", 7, "table public.outbox: UPDATE: work_id[text]:'w-0-0' state[text]:'published'")
	feed("0/140", 7, "table public.other: INSERT: work_id[text]:'not-outbox'")
	got := feed("0/150", 7, "COMMIT 7")
	want := []WitnessRow{{ID: "w-0-1", End: lsn("0/150")}}
	if !slices.Equal(got, want) {
		t.Fatalf("COMMIT 7: got %v, want %v", got, want)
	}
	got = feed("0/160", 8, "COMMIT 8")
	if !slices.Equal(got, []WitnessRow{{ID: "w-1-1", End: lsn("0/160")}}) {
		t.Fatalf("COMMIT 8: got %v", got)
	}
}

func TestLedgerG3(t *testing.T) {
	l := NewLedger()
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-2", lsn("0/100")}, {"w-0-3", lsn("0/200")}, {"w-0-4", lsn("0/300")}})
	l.AddMsg("w-0-1", 1)
	l.AddMsg("w-0-2", 2)
	// Confirmed at the first transaction's end: both rows are in the stream.
	if covered, bad := l.CheckG3("k1", lsn("0/100"), 2, nil); covered != 2 || len(bad) != 0 {
		t.Fatalf("k1: covered %d, violations %v", covered, bad)
	}
	// Confirmed past w-0-3, which is in the stream only after the last
	// sequence read at the check: too early.
	l.AddMsg("w-0-3", 3)
	if covered, bad := l.CheckG3("k2", lsn("0/250"), 2, nil); covered != 1 || len(bad) != 1 || !strings.Contains(bad[0], "w-0-3") {
		t.Fatalf("k2: covered %d, violations %v", covered, bad)
	}
	// Covered but still 'ready' is a violation; handed to the poller is not.
	l.AddWitness([]WitnessRow{{"w-0-5", lsn("0/400")}})
	covered, bad := l.CheckG3("k3", lsn("0/400"), 3, map[string]string{"w-0-4": "ready", "w-0-5": "scheduled"})
	if covered != 2 || len(bad) != 1 || !strings.Contains(bad[0], "w-0-4") || !strings.Contains(bad[0], "ready") {
		t.Fatalf("k3: covered %d, violations %v", covered, bad)
	}
	// A witness row re-decoded after a crash is not counted twice; one that
	// lands before the verified prefix is checked again.
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-0", lsn("0/050")}})
	if covered, bad := l.CheckG3("k4", lsn("0/400"), 3, nil); len(bad) != 1 || !strings.Contains(bad[0], "w-0-0") {
		t.Fatalf("k4: covered %d, violations %v", covered, bad)
	}
	f := l.Figures(nil)
	if f.G3Checks != 4 || f.G3Violations != 3 || f.G3PollerHandoffs != 1 {
		t.Fatalf("figures: %+v", f)
	}
}

// Under --on-publish none a row the watermark covers must be in the stream
// at or below the last sequence read after the covered rows were.
func TestLedgerCovered(t *testing.T) {
	l := NewLedger()
	l.AddMsg("w-0-1", 1)
	l.AddMsg("w-0-2", 5)
	if bad := l.CheckCovered("k1", []string{"w-0-1"}, 4); len(bad) != 0 {
		t.Fatalf("k1: violations %v", bad)
	}
	bad := l.CheckCovered("k2", []string{"w-0-1", "w-0-2", "w-0-3"}, 4)
	if len(bad) != 2 || !strings.Contains(bad[0], "w-0-2") || !strings.Contains(bad[1], "w-0-3") {
		t.Fatalf("k2: violations %v", bad)
	}
	if f := l.Figures(nil); f.G3Violations != 2 {
		t.Fatalf("figures: %+v", f)
	}
}

func TestLedgerFigures(t *testing.T) {
	l := NewLedger()
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-2", lsn("0/100")}, {"w-1-1", lsn("0/200")}})
	l.AddMsg("w-0-1", 1)
	l.AddMsgFrom("w-0-1", 2, "12:00:01.000 claim 3")             // stored twice
	l.AddMsg("rb-0-9", 3)                                        // rolled back, yet published
	l.AddMsg("w-1-1", 4)                                         // fine
	l.AddMsg("stranger-1", 5)                                    // nobody committed it
	f := l.Figures([]string{"w-0-1", "w-0-2", "w-1-1", "w-2-1"}) // w-2-1 acked but not in the witness
	want := Figures{CommittedRows: 3, StreamMsgs: 5, StreamDistinct: 4, Lost: 1, Phantoms: 1, StoredDuplicates: 1, UnknownMsgs: 1, WitnessGaps: 1}
	if f.CommittedRows != want.CommittedRows || f.StreamMsgs != want.StreamMsgs || f.StreamDistinct != want.StreamDistinct ||
		f.Lost != want.Lost || f.Phantoms != want.Phantoms || f.StoredDuplicates != want.StoredDuplicates ||
		f.UnknownMsgs != want.UnknownMsgs || f.WitnessGaps != want.WitnessGaps {
		t.Fatalf("figures %+v, want %+v", f, want)
	}
	if !slices.Equal(f.LostSample, []string{"w-0-2 (txn end 0/100)"}) || !slices.Equal(f.PhantomSample, []string{"rb-0-9"}) {
		t.Fatalf("samples: lost %v phantoms %v", f.LostSample, f.PhantomSample)
	}
	if !slices.Equal(f.DuplicateSample, []string{"w-0-1 stored 2 times: seq 1; seq 2 12:00:01.000 claim 3"}) {
		t.Fatalf("duplicate sample %q: want each copy's sequence and origin", f.DuplicateSample)
	}
}

// A promotion: the new primary's table replaces the history. Rows it lacks
// were taken back (not lost; in the stream they fail the run), held rows the
// old witness missed join at the new witness's consistent point, and the G3
// prefix stays where the kept rows put it.
func TestLedgerPromote(t *testing.T) {
	l := NewLedger()
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-2", lsn("0/200")}, {"w-0-3", lsn("0/300")}, {"w-0-4", lsn("0/400")}})
	l.AddMsg("w-0-1", 1)
	l.AddMsg("w-0-2", 2)
	if _, bad := l.CheckG3("k1", lsn("0/200"), 2, nil); len(bad) != 0 {
		t.Fatal(bad)
	}
	l.AddMsg("w-0-4", 3) // published, then taken back: the violation
	held := map[string]bool{"w-0-1": true, "w-0-2": true, "w-0-3": true, "w-0-5": true, "w-1-9": true}
	// w-0-6 was acked on the old primary, never witnessed, not held: taken
	// back. w-1-9 acked and held; w-2-1 acked after the snapshot and
	// witnessed later: neither.
	tb, joined := l.Promote(held, lsn("0/250"), []string{"w-0-1", "w-0-6", "w-1-9", "w-2-1"})
	if tb != 3 || joined != 2 { // w-0-4, w-0-6, w-2-1 (until witnessed)
		t.Fatalf("taken back %d, joined %d", tb, joined)
	}
	l.AddWitness([]WitnessRow{{"w-2-1", lsn("0/260")}})
	// w-0-5 and w-1-9 ended at or before 0/250 (their upper bound): checked
	// now; w-0-3 (0/300) and w-2-1 not yet.
	covered, bad := l.CheckG3("k2", lsn("0/255"), 3, nil)
	if covered != 2 || len(bad) != 2 {
		t.Fatalf("k2: covered %d, violations %v", covered, bad)
	}
	l.AddMsg("w-0-3", 4)
	l.AddMsg("w-0-5", 5)
	l.AddMsg("w-1-9", 6)
	l.AddMsg("w-2-1", 7)
	f := l.Figures([]string{"w-0-1", "w-0-6", "w-1-9", "w-2-1"})
	if f.CommittedRows != 6 || f.Lost != 0 || f.TakenBack != 2 || f.TakenBackInStream != 1 || f.UnknownMsgs != 0 ||
		f.WitnessGaps != 0 || f.Promotions != 1 || !slices.Equal(f.TakenBackSample, []string{"w-0-4 (committed on a former primary, not on the promoted one)"}) {
		t.Fatalf("figures %+v", f)
	}
}

// bitten is a report in which every kind of faults was injected n times and
// bit each time.
func bitten(faults []string, n int) (enabled []string, injected, bit map[string]int) {
	injected, bit = map[string]int{}, map[string]int{}
	for _, k := range faults {
		injected[k], bit[k] = n, n
	}
	return slices.Clone(faults), injected, bit
}

func TestReportFailures(t *testing.T) {
	r := &Report{Seed: 42, Replay: "cd proof && go run ./cmd/outbox-chaos -seed 42"}
	r.FaultsEnabled, r.Faults, r.FaultsBit = bitten([]string{FaultRelayKill}, 3)
	r.G3Checks = 3
	if f := r.Failures(); len(f) != 0 {
		t.Fatalf("clean report fails: %v", f)
	}
	if !strings.Contains(r.Table(), "RESULT: ok; seed 42") {
		t.Fatalf("table:\n%s", r.Table())
	}
	r.Lost, r.NotPublished = 2, 1
	r.Takeovers = []Takeover{{Cause: "sigkill", Seconds: 1.2, OK: true}, {Cause: "partition", Seconds: 61, OK: false}}
	r.TakeoverFailures = 1
	f := r.Failures()
	if len(f) != 3 {
		t.Fatalf("failures %v, want lost, not published, takeover", f)
	}
	tab := r.Table()
	for _, s := range []string{"RESULT: FAIL", "seed 42", "n=1 min 1.20", "replay: cd proof && go run ./cmd/outbox-chaos -seed 42"} {
		if !strings.Contains(tab, s) {
			t.Errorf("table lacks %q:\n%s", s, tab)
		}
	}
}

// A run that injected no fault fails, and so does one in which an enabled
// kind was never injected or never bit, whatever its other figures.
func TestReportFaultsMustBite(t *testing.T) {
	r := &Report{Seed: 9, Faults: map[string]int{}, FaultsBit: map[string]int{}}
	r.G3Checks = 2
	f := r.Failures()
	if len(f) != 1 || !strings.Contains(f[0], "faults injected = 0") {
		t.Fatalf("a run without faults: failures %v", f)
	}
	r.FaultsEnabled = slices.Clone(AllFaults)
	if f := r.Failures(); len(f) != 1+len(AllFaults) {
		t.Fatalf("no enabled kind injected: failures %v", f)
	}

	r.FaultsEnabled, r.Faults, r.FaultsBit = bitten(AllFaults, 2)
	if f := r.Failures(); len(f) != 0 {
		t.Fatalf("every kind bit: failures %v", f)
	}
	delete(r.Faults, FaultPGCut)
	delete(r.FaultsBit, FaultPGCut)
	r.FaultsBit[FaultTakeoverKill] = 0
	r.FaultsBit[FaultRelayKill] = 0
	f = r.Failures()
	want := []string{
		"fault relay-kill injected 2 times and never bit (it must bite at least once: SIGKILL of a relay whose walsender streamed the slot)",
		"fault pg-cut injected 0 times",
		"fault takeover-kill injected 2 times and never bit (it must bite at least once: the standby instance took over the slot)",
	}
	if len(f) != len(want) {
		t.Fatalf("failures %v, want %d", f, len(want))
	}
	for i, w := range want {
		if !strings.Contains(f[i], w) {
			t.Errorf("failure %d: %q, want it to contain %q", i, f[i], w)
		}
	}
	tab := r.Table()
	for _, s := range []string{"RESULT: FAIL", "| 2 (0)", "FAIL: must bite at least once: the standby instance took over the slot", "| 0 (0)"} {
		if !strings.Contains(tab, s) {
			t.Errorf("table lacks %q:\n%s", s, tab)
		}
	}
	for _, k := range AllFaults {
		if FaultBite(k) == "unknown fault kind" {
			t.Errorf("fault %s has no definition of biting", k)
		}
	}
	for _, k := range []string{FaultNATSNodeKill, FaultPGFailover} {
		if FaultBite(k) == "unknown fault kind" {
			t.Errorf("fault %s has no definition of biting", k)
		}
	}
}

func TestReportFailover(t *testing.T) {
	r := &Report{Seed: 7, Faults: map[string]int{FaultRelayKill: 1}, FailoverEnabled: true}
	r.G3Checks = 1
	if f := r.Failures(); len(f) != 1 || !strings.Contains(f[0], "failovers = 0") {
		t.Fatalf("pg-failover enabled, none happened: failures %v", f)
	}
	r.Failovers = []Failover{{PGVersion: 17, SlotPath: "survived", SlotSynced: true, TakenBack: 700, PromoteSeconds: 0.3, StreamingSeconds: 3.9, OK: true}}
	r.TakenBack = 690
	if f := r.Failures(); len(f) != 0 {
		t.Fatalf("clean failover run fails: %v", f)
	}
	r.TakenBackInStream = 1
	r.TakenBackSample = []string{"w-1-2 (committed on a former primary, not on the promoted one)"}
	f := r.Failures()
	if len(f) != 1 || !strings.Contains(f[0], "published but taken back by a promotion = 1") {
		t.Fatalf("failures %v", f)
	}
	tab := r.Table()
	for _, s := range []string{"pg 17, slot survived", "0.30 / 3.90", "700 / 0", "evidence: w-1-2", "RESULT: FAIL"} {
		if !strings.Contains(tab, s) {
			t.Errorf("table lacks %q:\n%s", s, tab)
		}
	}
}

func TestSchedule(t *testing.T) {
	a := Schedule(7, AllFaults, 100)
	if !slices.Equal(a, Schedule(7, AllFaults, 100)) {
		t.Fatal("the same seed gives another schedule")
	}
	// The first round has every kind once, so that a short run reaches
	// them all soonest; the next has relay-kill relayKillWeight times.
	first, second := len(AllFaults), len(AllFaults)+relayKillWeight-1
	for i, round := range [][]string{a[:first], a[first : first+second]} {
		seen := map[string]int{}
		for _, k := range round {
			seen[k]++
		}
		for _, k := range AllFaults {
			want := 1
			if k == FaultRelayKill && i > 0 {
				want = relayKillWeight
			}
			if seen[k] != want {
				t.Errorf("round %d has %s %d times, want %d", i+1, k, seen[k], want)
			}
		}
	}
	if err := ValidateFaults([]string{"relay-kill", "nats-cutt"}); err == nil || !strings.Contains(err.Error(), "nats-cutt") {
		t.Fatalf("ValidateFaults: %v", err)
	}
}

// pg-failover stays out of the default set (make chaos-short does not run it), and
// -failover or -faults brings it in.
func TestFailoverIsOptIn(t *testing.T) {
	var c Config
	c.defaults()
	if slices.Contains(c.Faults, FaultPGFailover) {
		t.Fatalf("default faults %v include %s", c.Faults, FaultPGFailover)
	}
	c = Config{Failover: true}
	c.defaults()
	if !slices.Contains(c.Faults, FaultPGFailover) || len(c.Faults) != len(AllFaults)+1 || slices.Contains(AllFaults, FaultPGFailover) {
		t.Fatalf("-failover: faults %v, AllFaults %v", c.Faults, AllFaults)
	}
	c = Config{Failover: true, Faults: []string{FaultPGFailover, FaultRelayKill}}
	c.defaults()
	if len(c.Faults) != 2 {
		t.Fatalf("-failover with -faults naming it: %v", c.Faults)
	}
	if err := ValidateFaults([]string{FaultPGFailover}); err != nil {
		t.Fatal(err)
	}
}

// nats-lose-tail: the ledger forgets the messages above the stream's new
// end, so a row lost with them counts lost until it is stored again, a
// repeat below the cut keeps its row stored, and the sequences handed out
// again are read as new messages.
func TestLedgerLoseTail(t *testing.T) {
	l := NewLedger()
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-2", lsn("0/100")}, {"w-0-3", lsn("0/200")}})
	l.AddMsg("w-0-1", 1)
	l.AddMsg("w-0-2", 2)
	l.AddMsg("w-0-1", 3) // a repeat, cut away with w-0-3
	l.AddMsg("w-0-3", 4)
	gone := l.LoseTail(2)
	if !slices.Equal(gone, []string{"w-0-3"}) || l.LastSeq() != 2 || !l.Stored("w-0-1") || l.Stored("w-0-3") {
		t.Fatalf("after the cut: gone %v, last seq %d, w-0-1 stored %v, w-0-3 stored %v", gone, l.LastSeq(), l.Stored("w-0-1"), l.Stored("w-0-3"))
	}
	if f := l.Figures(nil); f.Lost != 1 || f.StoredDuplicates != 0 || f.StreamMsgs != 2 {
		t.Fatalf("before the republish: %+v", f)
	}
	l.AddMsg("w-0-3", 3) // the relay's republish, at a sequence handed out again
	if f := l.Figures(nil); f.Lost != 0 || f.StoredDuplicates != 0 || f.StreamMsgs != 3 || f.StreamDistinct != 3 {
		t.Fatalf("after the republish: %+v", f)
	}
	l.AddMsg("w-0-3", 4) // stored twice after all
	if f := l.Figures(nil); f.StoredDuplicates != 1 {
		t.Fatalf("a second copy: %+v", f)
	}
	// A cut of a repeat's first copy leaves the later one as the first.
	l.AddMsg("w-0-2", 5)
	l.LoseTail(1)
	l.AddMsg("w-0-2", 2)
	l.AddMsg("w-0-2", 3)
	if f := l.Figures(nil); f.StoredDuplicates != 1 || f.Lost != 1 {
		t.Fatalf("after a second cut: %+v", f)
	}
}

// A kind this configuration cannot run (nats-lose-tail under none or on a
// cluster) is skipped with its reason and does not fail the run; under
// mark on one server it must bite like every other kind.
func TestNotApplicableFaults(t *testing.T) {
	for _, c := range []struct {
		cfg Config
		na  bool
	}{
		{Config{}, false},
		{Config{OnPublish: "mark"}, false},
		{Config{OnPublish: "none"}, true},
		{Config{OnPublish: "delete"}, true},
		{Config{Cluster: 3}, true},
	} {
		why := c.cfg.notApplicable(FaultNATSLoseTail)
		if (why != "") != c.na {
			t.Errorf("%+v: nats-lose-tail not applicable %q, want %v", c.cfg, why, c.na)
		}
		if c.cfg.notApplicable(FaultPGClockShifted) == "" {
			t.Errorf("%+v: pg-clock-shifted applicable without -pg-clock-offset", c.cfg)
		}
		shifted := c.cfg
		shifted.PGClockOffset = -60 * time.Second
		if why := shifted.notApplicable(FaultPGClockShifted); why != "" {
			t.Errorf("%+v: pg-clock-shifted not applicable: %s", shifted, why)
		}
		for _, k := range append(slices.Clone(AllFaults), FaultNATSNodeKill, FaultPGFailover) {
			if k != FaultNATSLoseTail && shifted.notApplicable(k) != "" {
				t.Errorf("%+v: %s not applicable", shifted, k)
			}
		}
	}
	r := &Report{Seed: 9}
	r.G3Checks = 1
	r.FaultsEnabled, r.Faults, r.FaultsBit = bitten(AllFaults, 1)
	delete(r.Faults, FaultNATSLoseTail)
	delete(r.FaultsBit, FaultNATSLoseTail)
	if f := r.Failures(); len(f) != 1 || !strings.Contains(f[0], "fault nats-lose-tail injected 0 times") {
		t.Fatalf("nats-lose-tail never injected under mark: failures %v", f)
	}
	why := (&Config{OnPublish: "none"}).notApplicable(FaultNATSLoseTail)
	r.FaultsNotApplicable = map[string]string{FaultNATSLoseTail: why}
	r.FaultsSkipped = map[string]int{FaultNATSLoseTail: 2}
	if f := r.Failures(); len(f) != 0 {
		t.Fatalf("nats-lose-tail not applicable: failures %v", f)
	}
	if tab := r.Table(); !strings.Contains(tab, "not applicable: --on-publish none") || strings.Contains(tab, "FAIL") {
		t.Fatalf("table:\n%s", tab)
	}
}

// arrivals is a server that echoes every line and records when each line
// arrived, so that a test can tell which direction a proxy delayed.
type arrivals struct {
	addr string
	mu   sync.Mutex
	at   []time.Time
}

func arrivalServer(t *testing.T) *arrivals {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	a := &arrivals{addr: ln.Addr().String()}
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					a.mu.Lock()
					a.at = append(a.at, time.Now())
					a.mu.Unlock()
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return a
}

func (a *arrivals) last() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.at[len(a.at)-1]
}

// SlowReplies delays what the server sends and nothing else, SlowRequests
// the other way round: broker-slow's broker stores a publish at once and
// answers it late.
func TestProxyOneWayLatency(t *testing.T) {
	const d = 300 * time.Millisecond
	for _, c := range []struct {
		mode        Mode
		lateArrival bool
	}{{SlowReplies, false}, {SlowRequests, true}} {
		srv := arrivalServer(t)
		p, err := NewProxy(srv.addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		cl := dial(t, p)
		p.Set(c.mode, d)
		start := time.Now()
		if got, err := cl.roundTrip("x", 5*time.Second); err != nil || got != "x" {
			t.Fatalf("%s: got %q, %v", c.mode, got, err)
		}
		rtt, arrival := time.Since(start), srv.last().Sub(start)
		if rtt < d || rtt > d+250*time.Millisecond {
			t.Errorf("%s: round trip %v, want one delay of %v (one direction only)", c.mode, rtt, d)
		}
		if late := arrival >= d; late != c.lateArrival {
			t.Errorf("%s: the request reached the server after %v (late %v, want %v)", c.mode, arrival, late, c.lateArrival)
		}
	}
}

// A delay is a latency, not a cap on throughput: 64 MiB sent at once all
// arrive about one delay after they were sent (a queue of 256 chunks waiting
// out the delay made the proxy stop reading, so that at most 256 chunks of
// 32 KiB crossed per delay: about 8 s here).
func TestProxyLatencyIsNotAThroughputCap(t *testing.T) {
	const d, size = time.Second, 64 << 20
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	received := make(chan time.Time, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		for range 2 {
			if n, _ := io.CopyN(io.Discard, c, size); n != size {
				return
			}
			received <- time.Now()
		}
	}()
	p, err := NewProxy(ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	c := dial(t, p)
	data := make([]byte, size)
	// The same bytes without the delay first: on a loaded machine (CI, the
	// race detector) moving 64 MiB through the proxy takes seconds by
	// itself, and the bound is that time plus the delay, not a constant.
	start := time.Now()
	if _, err := c.c.Write(data); err != nil {
		t.Fatal(err)
	}
	var base time.Duration
	select {
	case at := <-received:
		base = at.Sub(start)
	case <-time.After(30 * time.Second):
		t.Fatal("64 MiB did not arrive within 30 s without a delay")
	}
	p.Set(SlowRequests, d)
	start = time.Now()
	if _, err := c.c.Write(data); err != nil {
		t.Fatal(err)
	}
	select {
	case at := <-received:
		if took := at.Sub(start); took > 2*base+d+time.Second {
			t.Errorf("64 MiB under %v latency took %v to arrive, %v without: the delay capped throughput", d, took, base)
		} else {
			t.Logf("64 MiB under %v latency took %v to arrive, %v without", d, took, base)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("64 MiB did not arrive within 30 s")
	}
}

// Hold keeps both directions and the end of the connection; HoldRequests
// then hands over what the server sent, keeps the client's writes and the
// end; Pass lets the rest through and the end after it.
func TestProxyHold(t *testing.T) {
	srvLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srvLn.Close() })
	got := make(chan string, 4)
	send := make(chan string)
	go func() {
		s, err := srvLn.Accept()
		if err != nil {
			return
		}
		go func() {
			r := bufio.NewReader(s)
			for {
				line, err := r.ReadString('\n')
				if err != nil {
					got <- "EOF"
					return
				}
				got <- line
			}
		}()
		// The server says something, then goes away (it reads on, to see
		// what reaches it).
		_, _ = s.Write([]byte(<-send))
		_ = s.(*net.TCPConn).CloseWrite()
	}()
	p, err := NewProxy(srvLn.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	c := dial(t, p)
	waitFor(t, func() bool { return p.Conns() == 1 }, "the connection through the proxy")
	p.Set(Hold, 0)
	send <- "late\n"
	if _, err := c.c.Write([]byte("held\n")); err != nil {
		t.Fatal(err)
	}
	_ = c.c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if s, err := c.r.ReadString('\n'); err == nil || s != "" {
		t.Fatalf("during Hold the client read %q, %v", s, err)
	}
	select {
	case s := <-got:
		t.Fatalf("during Hold the server got %q", s)
	case <-time.After(100 * time.Millisecond):
	}
	p.Set(HoldRequests, 0)
	_ = c.c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if s, err := c.r.ReadString('\n'); err != nil || s != "late\n" {
		t.Fatalf("after HoldRequests the client read %q, %v; want what the server sent before it went away", s, err)
	}
	// The end is kept too: the client's next read waits, it does not see
	// the server gone yet.
	_ = c.c.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.r.ReadString('\n'); err == nil {
		t.Fatal("read more than was sent")
	} else if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
		t.Fatalf("the end reached the client before the release: %v", err)
	}
	p.Set(Pass, 0)
	_ = c.c.SetReadDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.r.ReadString('\n'); err == nil {
		t.Fatal("read more than was sent")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the end never reached the client after the release")
	}
}

// Armed passes everything until the client sends the trigger, and answers
// late from that chunk on.
func TestProxyArmed(t *testing.T) {
	const d = 300 * time.Millisecond
	p := newTestProxy(t)
	c := dial(t, p)
	p.Arm("FETCH", d)
	start := time.Now()
	if _, err := c.roundTrip("hello", 2*time.Second); err != nil || time.Since(start) > d/2 {
		t.Fatalf("before the trigger: %v after %v", err, time.Since(start))
	}
	if !p.Fired().IsZero() {
		t.Fatal("fired without its trigger")
	}
	start = time.Now()
	if _, err := c.roundTrip("FETCH more", 2*time.Second); err != nil || time.Since(start) < d {
		t.Fatalf("the trigger's own answer: %v after %v, want late", err, time.Since(start))
	}
	if p.Fired().IsZero() || p.Mode() != SlowReplies {
		t.Fatalf("after the trigger: fired %v, mode %s", p.Fired(), p.Mode())
	}
	start = time.Now()
	if _, err := c.roundTrip("later", 2*time.Second); err != nil || time.Since(start) < d {
		t.Fatalf("after the trigger: %v after %v, want late", err, time.Since(start))
	}
}

// Deadlines are judged on the broker's clock, the database's moved by the
// measured difference; an expired row is not lost; every figure is counted
// in the window of the fault in effect.
func TestLedgerDeadlinesAndWindows(t *testing.T) {
	l := NewLedger()
	t0 := time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)
	// The database's clock is a minute ahead of the broker's and this
	// host's.
	l.SetClocks(Clocks{DBMinusHost: time.Minute, Uncertainty: time.Millisecond})
	l.SetWindows([]FaultWindow{
		{N: 1, Kind: FaultRelayKill, Start: t0.Add(10 * time.Second), StartLSN: lsn("0/200")},
		{N: 2, Kind: FaultPGClockShifted, Start: t0.Add(20 * time.Second), StartLSN: lsn("0/300")},
	})
	l.AddWitness([]WitnessRow{{"w-0-1", lsn("0/100")}, {"w-0-2", lsn("0/250")}, {"w-0-3", lsn("0/350")}, {"w-0-4", lsn("0/360")}, {"w-0-5", lsn("0/370")}})
	db := func(d time.Duration) time.Time { return t0.Add(time.Minute + d) } // a database-clock time
	l.Add(Msg{ID: "w-0-1", Seq: 1, Stored: t0.Add(5 * time.Second)})
	// Stored 25 s in, deadline 24 s in on the broker's clock: late.
	l.Add(Msg{ID: "w-0-3", Seq: 2, Stored: t0.Add(25 * time.Second), ExpiresAt: db(24 * time.Second)})
	// Stored 25 s in, deadline 26 s: in time, though the database's clock
	// reads a minute later.
	l.Add(Msg{ID: "w-0-4", Seq: 3, Stored: t0.Add(25 * time.Second), ExpiresAt: db(26 * time.Second)})
	l.Add(Msg{ID: "w-0-1", Seq: 4, Stored: t0.Add(15 * time.Second)}) // stored twice in relay-kill's window
	l.Add(Msg{ID: "rb-0-9", Seq: 5, Stored: t0.Add(21 * time.Second)})
	l.SetExpired([]string{"w-0-5"})
	f := l.Figures(nil)
	if f.PastDeadline != 1 || f.DeadlineMsgs != 2 || f.Expired != 1 || f.Lost != 1 || f.StoredDuplicates != 1 || f.Phantoms != 1 {
		t.Fatalf("figures %+v", f)
	}
	if f.MaxPastDeadline != time.Second || f.MinDeadlineLeft != -time.Second {
		t.Errorf("past the deadline by %v, least left %v; want 1s and -1s", f.MaxPastDeadline, f.MinDeadlineLeft)
	}
	if len(f.PastDeadlineSample) != 1 || !strings.Contains(f.PastDeadlineSample[0], "w-0-3") {
		t.Errorf("past-deadline sample %q", f.PastDeadlineSample)
	}
	want := map[string]KindFigures{
		FaultRelayKill:      {Windows: 1, Lost: 1, Duplicates: 1}, // w-0-2 ended at 0/250
		FaultPGClockShifted: {Windows: 1, Phantoms: 1, PastDeadline: 1},
	}
	for k, w := range want {
		if got := f.ByFault[k]; got == nil || *got != w {
			t.Errorf("%s: %+v, want %+v", k, got, w)
		}
	}
	if b := f.ByFault[BeforeFaults]; b != nil {
		t.Errorf("before the first fault: %+v, want nothing", b)
	}
	r := &Report{Figures: f, Seed: 1}
	r.G3Checks = 1
	r.FaultsEnabled, r.Faults, r.FaultsBit = bitten([]string{FaultRelayKill, FaultPGClockShifted}, 1)
	fails := strings.Join(r.Failures(), "; ")
	if !strings.Contains(fails, "published past the deadline = 1") {
		t.Errorf("failures %q", fails)
	}
	if tab := r.Table(); !strings.Contains(tab, "in its windows: lost 0, phantoms 1, stored twice 0, past deadline 1") {
		t.Errorf("table:\n%s", tab)
	}
}
