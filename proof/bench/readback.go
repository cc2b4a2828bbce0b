package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// ReadBack is the read-back case (issue 31): the cost of G18's read-back
// of the stream at a session start after a kill -9 under load, and what a
// restart does without it; and (issue 41) what a restart reads back after
// a clean stop, where nothing can replay. Part of the default run.
const ReadBack = "readback"

const (
	// readBackDupWindow is the bench stream's duplicate window in this
	// case, shorter than every outage: past it the broker drops no repeat,
	// so a replayed row published again is stored twice, which is what the
	// read-back is there to prevent.
	readBackDupWindow = 2 * time.Second
	// readBackBefore is how long the relay runs under the load before the
	// kill: longer than the by-time read-back's 5 s clock margin plus a
	// status interval, so that a read by time (before issue 41's positions,
	// or with none recorded) is bounded by the session's own recent
	// publishes, not by its start.
	readBackBefore = 8 * time.Second
)

// readBackOutages are the outage lengths, both past readBackDupWindow: the
// read-back should cost about the same after either.
var readBackOutages = []time.Duration{3 * time.Second, 12 * time.Second}

// readBackBacklog is the backlog of the kill during a drain.
const readBackBacklog = 60_000

// ReadBackRound is one kill -9 and restart.
type ReadBackRound struct {
	ReadBack bool `json:"readback"` // --readback-limit default (true) or 0
	// Backlog: the rows were committed before the relay started and it was
	// killed half way through draining them, no load after; otherwise it
	// ran readBackBefore under the load, which went on through the outage.
	Backlog       bool    `json:"backlog"`
	OutageSeconds float64 `json:"outage_seconds"`
	Rows          int     `json:"rows"`            // committed in the round (before the kill and during the outage)
	StoredAtKill  int     `json:"stored_at_start"` // of them in the stream when the relay restarted
	// From the restarted relay's /metrics.
	ReadBackSeconds  float64 `json:"readback_seconds"`
	ReadBackMessages float64 `json:"readback_messages"`
	Found            float64 `json:"readback_found"`      // replayed rows settled from the stream, not published
	PublishedOK      float64 `json:"published_ok"`        // rows settled as ok: new messages stored and the rows found stored
	PublishedDup     float64 `json:"published_duplicate"` // repeats the duplicate window dropped
	// StoredTwice is the stream's messages beyond the rows: repeats stored.
	StoredTwice int `json:"stored_twice"`
	// From the restart to every row settled; DrainMsgsPerSec is the rows
	// the restarted session had to get stored (committed minus already
	// stored) over that time.
	DrainSeconds    float64 `json:"drain_seconds"`
	DrainMsgsPerSec float64 `json:"drain_msgs_per_sec"`
	// The same rows over the time after the read-back, which runs before
	// the session's first publish: the drain's own rate.
	AfterReadBackMsgsPerSec float64 `json:"drain_msgs_per_sec_after_readback"`
	LoadAvg                 string  `json:"loadavg"`
	// Log is the restarted relay's lines about its read-back: where it
	// started (after_seq, or since when by time) and ended.
	Log []string `json:"readback_log,omitempty"`
}

// ReadBackResult is the read-back case's report.
type ReadBackResult struct {
	Rate              float64         `json:"load_rows_per_sec"`
	DupWindowSeconds  float64         `json:"duplicate_window_seconds"`
	BeforeKillSeconds float64         `json:"before_kill_seconds"`
	Rounds            []ReadBackRound `json:"rounds"`
	CleanStop         *CleanStopRound `json:"clean_stop,omitempty"`
}

// readBack runs, on one table and stream, a kill -9 under a steady load
// and a restart after each outage, with the read-back on and off in ABBA
// order (on, off for the first outage; off, on for the second), so the
// machine's load falls on both alike.
func (b *bench) readBack(ctx context.Context) (ReadBackResult, error) {
	rate := b.cfg.Rate
	if rate <= 0 {
		rate = restartRate
	}
	res := ReadBackResult{Rate: rate, DupWindowSeconds: readBackDupWindow.Seconds(), BeforeKillSeconds: readBackBefore.Seconds()}
	p, err := b.setup(ctx, ReadBack, 0)
	defer b.teardown(p, "", 0)
	if err != nil {
		return res, err
	}
	st, err := b.s.js.Stream(ctx, p.stream)
	if err != nil {
		return res, err
	}
	cfg := st.CachedInfo().Config
	cfg.Duplicates = readBackDupWindow
	if _, err := b.s.js.UpdateStream(ctx, cfg); err != nil {
		return res, fmt.Errorf("shorten the duplicate window of %s: %w", p.stream, err)
	}
	for i, outage := range readBackOutages {
		modes := []bool{true, false}
		if i%2 == 1 {
			modes = []bool{false, true}
		}
		for _, on := range modes {
			rr, err := b.readBackRound(ctx, p, rate, outage, on, 0)
			if err != nil {
				return res, fmt.Errorf("outage %v, read-back %v: %w", outage, on, err)
			}
			b.cfg.logf("readback %v, outage %v: %d rows, %d stored at the restart; read back %.0f headers in %.3fs, %.0f found stored; %.0f published, %.0f duplicate acks, %d stored twice; drained in %.2fs (%.0f msg/s, %.0f after the read-back)",
				on, outage, rr.Rows, rr.StoredAtKill, rr.ReadBackMessages, rr.ReadBackSeconds, rr.Found, rr.PublishedOK, rr.PublishedDup, rr.StoredTwice, rr.DrainSeconds, rr.DrainMsgsPerSec, rr.AfterReadBackMsgsPerSec)
			res.Rounds = append(res.Rounds, rr)
		}
	}
	// A kill during a backlog drain: what the read-back costs when much was
	// stored and not yet confirmed. Before issue 41 the read started at the
	// first replayed commit's time, as old as the backlog, and covered
	// everything stored since; now it starts at the position recorded with
	// the last confirmation.
	//
	// On, then off: a session with the read-back off records no position,
	// so the next session reads from the one recorded before, all of the
	// off round's messages too. In this order the kill with the read-back
	// on follows a session that recorded its final position, and only the
	// clean-stop round's first session (not its restart, the figure that
	// round is for) reads the off round's messages.
	for _, on := range []bool{true, false} {
		rr, err := b.readBackRound(ctx, p, rate, readBackOutages[0], on, readBackBacklog)
		if err != nil {
			return res, fmt.Errorf("backlog, read-back %v: %w", on, err)
		}
		b.cfg.logf("readback %v, kill half way through a backlog of %d rows, outage %v: %d stored at the restart; read back %.0f headers in %.3fs, %.0f found stored; %.0f published, %d stored twice; drained in %.2fs (%.0f msg/s, %.0f after the read-back)",
			on, rr.Rows, readBackOutages[0], rr.StoredAtKill, rr.ReadBackMessages, rr.ReadBackSeconds, rr.Found, rr.PublishedOK, rr.StoredTwice, rr.DrainSeconds, rr.DrainMsgsPerSec, rr.AfterReadBackMsgsPerSec)
		res.Rounds = append(res.Rounds, rr)
	}
	cs, err := b.readBackCleanStop(ctx, p)
	if err != nil {
		return res, fmt.Errorf("clean stop: %w", err)
	}
	b.cfg.logf("readback after a clean stop: a backlog of %d rows drained in %.2fs (%.0f msg/s; its own start read back %.0f headers), stopped in %.2fs; the restart read back %.0f headers in %.3fs, %.0f found stored, %d stored twice",
		cs.Backlog, cs.DrainSeconds, cs.DrainMsgsPerSec, cs.DrainReadBackMessages, cs.StopSeconds, cs.ReadBackMessages, cs.ReadBackSeconds, cs.Found, cs.StoredTwice)
	res.CleanStop = &cs
	return res, nil
}

func (b *bench) readBackRound(ctx context.Context, p *path, rate float64, outage time.Duration, on bool, backlog int) (ReadBackRound, error) {
	rr := ReadBackRound{ReadBack: on, OutageSeconds: outage.Seconds(), Backlog: backlog > 0, LoadAvg: loadAvg()}
	n0, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return rr, err
	}
	start := func() (*proc, string, error) {
		if !on {
			return b.startRelayMetrics(p, "--readback-limit", "0")
		}
		return b.startRelayMetrics(p)
	}
	loadDone := make(chan error, 1)
	if backlog > 0 {
		// Committed before the relay starts: the first replayed transaction
		// is the backlog's first, long before the kill.
		rr.Rows = backlog
		l := b.newLoad(p, rr.Rows, 0)
		p.idBase += rr.Rows
		if _, err := l.run(ctx); err != nil {
			return rr, err
		}
		loadDone <- nil
	}
	pr, _, err := start()
	if err != nil {
		return rr, err
	}
	defer func() {
		if pr != nil {
			_ = pr.cmd.Process.Kill() // the error paths; a stopped relay is gone already
		}
	}()
	if _, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
		return rr, err
	}
	if backlog > 0 {
		for {
			n, err := b.s.streamMsgs(ctx, p.stream)
			if err != nil {
				return rr, err
			}
			if n >= n0+uint64(backlog/2) {
				break
			}
			if pr.exited() {
				return rr, fmt.Errorf("relay exited: %v (log %s)", pr.err, pr.log)
			}
			time.Sleep(5 * time.Millisecond)
		}
	} else {
		rr.Rows = int(rate * (readBackBefore + outage).Seconds())
		l := b.newLoad(p, rr.Rows, rate)
		p.idBase += rr.Rows
		go func() { _, err := l.run(ctx); loadDone <- err }()
		time.Sleep(readBackBefore)
	}
	if pr.exited() {
		return rr, fmt.Errorf("relay exited: %v (log %s)", pr.err, pr.log)
	}
	killed := time.Now()
	_ = pr.cmd.Process.Kill() // kill -9: a tail of acked rows is not confirmed to the slot
	<-pr.done
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return rr, err
	}
	if err := <-loadDone; err != nil {
		return rr, err
	}
	time.Sleep(outage - time.Since(killed)) // under load, the load's end is the outage's
	n1, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return rr, err
	}
	rr.StoredAtKill = int(n1 - n0)
	logAt := fileSize(filepath.Join(b.dir, p.db+".log"))
	t0 := time.Now()
	pr, metricsURL, err := start()
	if err != nil {
		return rr, err
	}
	_, settled, err := b.waitDrained(ctx, p, int(n0)+rr.Rows, pr, drainTimeout(rr.Rows))
	if err != nil {
		return rr, err
	}
	rr.DrainSeconds = settled.Sub(t0).Seconds()
	rr.DrainMsgsPerSec = float64(rr.Rows-rr.StoredAtKill) / rr.DrainSeconds
	text, err := scrape(ctx, metricsURL)
	if err != nil {
		return rr, err
	}
	rr.ReadBackSeconds, _ = metricSum(text, "outbox_relay_readback_seconds")
	rr.AfterReadBackMsgsPerSec = float64(rr.Rows-rr.StoredAtKill) / (rr.DrainSeconds - rr.ReadBackSeconds)
	rr.ReadBackMessages, _ = metricSum(text, "outbox_relay_readback_messages_total")
	rr.Found, _ = metricSum(text, "outbox_relay_readback_found_total")
	rr.PublishedOK, _ = metricSum(text, "outbox_relay_messages_published_total", `result="ok"`)
	rr.PublishedDup, _ = metricSum(text, "outbox_relay_messages_published_total", `result="duplicate"`)
	rr.Log = readBackLines(pr.log, logAt)
	if err := pr.stop(); err != nil {
		return rr, err
	}
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return rr, err
	}
	n2, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return rr, err
	}
	rr.StoredTwice = int(n2-n0) - rr.Rows
	return rr, nil
}

// startRelayMetrics starts the relay of p with its /metrics on a free
// loopback port, and returns the URL to scrape.
func (b *bench) startRelayMetrics(p *path, extra ...string) (*proc, string, error) {
	port, err := freePort()
	if err != nil {
		return nil, "", err
	}
	// At info the relay logs one line per read-back (and a few per
	// session, none per message): the rounds report it.
	args := b.relayArgs(p, time.Second, append([]string{"--http-addr", "127.0.0.1:" + port, "--log-level", "info"}, extra...)...)
	pr, err := startProcEnv("relay", filepath.Join(b.dir, p.db+".log"), b.cfg.RelayBin, b.cfg.RelayEnv, args...)
	return pr, "http://127.0.0.1:" + port + "/metrics", err
}

// readBackCleanStopRows are committed after the restart that follows a
// clean stop: a session reads the stream back at its first transaction,
// so a restart with nothing to stream would read nothing either way.
const readBackCleanStopRows = 100

// CleanStopRound is a backlog drained whole, a clean stop (SIGTERM, waited
// for) and a restart: what the restart reads back of the stream. The
// previous session stored and confirmed everything, so nothing of it can
// replay: the read should find none of its messages (issue 41).
type CleanStopRound struct {
	Backlog int `json:"backlog"`
	// The session that drained the backlog, started after the clean stop
	// of the last kill round's restarted session, whose read-back was off:
	// it recorded no position, so this session reads back from the one
	// recorded before that round.
	DrainSeconds          float64  `json:"drain_seconds"`
	DrainMsgsPerSec       float64  `json:"drain_msgs_per_sec"`
	DrainReadBackMessages float64  `json:"drain_readback_messages"`
	DrainReadBackSeconds  float64  `json:"drain_readback_seconds"`
	DrainLog              []string `json:"drain_readback_log,omitempty"`
	StopSeconds           float64  `json:"stop_seconds"`
	// The restarted session: Rows committed once it streams.
	Rows             int      `json:"rows_after_restart"`
	ReadBackSeconds  float64  `json:"readback_seconds"`
	ReadBackMessages float64  `json:"readback_messages"`
	Found            float64  `json:"readback_found"`
	PublishedOK      float64  `json:"published_ok"`
	StoredTwice      int      `json:"stored_twice"`
	Log              []string `json:"readback_log,omitempty"`
	LoadAvg          string   `json:"loadavg"`
}

func (b *bench) readBackCleanStop(ctx context.Context, p *path) (CleanStopRound, error) {
	cs := CleanStopRound{Backlog: readBackBacklog, Rows: readBackCleanStopRows, LoadAvg: loadAvg()}
	logPath := filepath.Join(b.dir, p.db+".log")
	n0, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return cs, err
	}
	l := b.newLoad(p, cs.Backlog, 0)
	p.idBase += cs.Backlog
	if _, err := l.run(ctx); err != nil {
		return cs, err
	}
	var pr *proc
	defer func() {
		if pr != nil && !pr.exited() {
			_ = pr.cmd.Process.Kill() // the error paths
		}
	}()
	logAt := fileSize(logPath)
	t0 := time.Now()
	pr, metricsURL, err := b.startRelayMetrics(p)
	if err != nil {
		return cs, err
	}
	_, settled, err := b.waitDrained(ctx, p, int(n0)+cs.Backlog, pr, drainTimeout(cs.Backlog))
	if err != nil {
		return cs, err
	}
	cs.DrainSeconds = settled.Sub(t0).Seconds()
	cs.DrainMsgsPerSec = float64(cs.Backlog) / cs.DrainSeconds
	text, err := scrape(ctx, metricsURL)
	if err != nil {
		return cs, err
	}
	cs.DrainReadBackMessages, _ = metricSum(text, "outbox_relay_readback_messages_total")
	cs.DrainReadBackSeconds, _ = metricSum(text, "outbox_relay_readback_seconds")
	cs.DrainLog = readBackLines(logPath, logAt)
	s0 := time.Now()
	if err := pr.stop(); err != nil {
		return cs, err
	}
	cs.StopSeconds = time.Since(s0).Seconds()
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return cs, err
	}
	logAt = fileSize(logPath)
	if pr, metricsURL, err = b.startRelayMetrics(p); err != nil {
		return cs, err
	}
	if _, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
		return cs, err
	}
	l = b.newLoad(p, cs.Rows, 0)
	p.idBase += cs.Rows
	if _, err := l.run(ctx); err != nil {
		return cs, err
	}
	if _, _, err := b.waitDrained(ctx, p, int(n0)+cs.Backlog+cs.Rows, pr, drainTimeout(cs.Rows)); err != nil {
		return cs, err
	}
	if text, err = scrape(ctx, metricsURL); err != nil {
		return cs, err
	}
	cs.ReadBackSeconds, _ = metricSum(text, "outbox_relay_readback_seconds")
	cs.ReadBackMessages, _ = metricSum(text, "outbox_relay_readback_messages_total")
	cs.Found, _ = metricSum(text, "outbox_relay_readback_found_total")
	cs.PublishedOK, _ = metricSum(text, "outbox_relay_messages_published_total", `result="ok"`)
	cs.Log = readBackLines(logPath, logAt)
	if err := pr.stop(); err != nil {
		return cs, err
	}
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return cs, err
	}
	n2, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return cs, err
	}
	cs.StoredTwice = int(n2-n0) - cs.Backlog - cs.Rows
	return cs, nil
}

// fileSize is where the next line written to path will start; 0 when it
// does not exist yet.
func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// readBackLines are the lines of the log at path past offset that are
// about a read-back of the stream (done, by time, failed), each cut to a
// length a report can show.
func readBackLines(path string, offset int64) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return nil
	}
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	for sc.Scan() {
		if line := sc.Text(); strings.Contains(line, "the stream back") {
			if len(line) > 600 {
				line = line[:600] + "..."
			}
			out = append(out, line)
		}
	}
	return out
}

// freePort is a loopback port free a moment ago, for the relay's
// --http-addr.
func freePort() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port: %w", err)
	}
	defer ln.Close()
	_, port, err := net.SplitHostPort(ln.Addr().String())
	return port, err
}

func scrape(ctx context.Context, url string) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("scrape the relay's metrics: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("scrape the relay's metrics: %s %v", resp.Status, err)
	}
	return string(body), nil
}

// metricSum adds up the samples of one metric in Prometheus text format
// whose labels include every one of labels (as name="value"); ok is false
// when there is none.
func metricSum(text, name string, labels ...string) (sum float64, ok bool) {
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, "#") {
			continue
		}
		rest, found := strings.CutPrefix(line, name)
		if !found || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
			continue // another metric whose name starts with this one
		}
		var set string
		if rest[0] == '{' {
			i := strings.IndexByte(rest, '}')
			if i < 0 {
				continue
			}
			set, rest = rest[1:i], rest[i+1:]
		}
		match := true
		for _, l := range labels {
			if !hasLabel(set, l) {
				match = false
			}
		}
		f := strings.Fields(rest)
		if !match || len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			continue
		}
		sum += v
		ok = true
	}
	return sum, ok
}

// hasLabel reports whether a label set (a="x",b="y") holds the pair l.
func hasLabel(set, l string) bool {
	for _, kv := range strings.Split(set, ",") {
		if kv == l {
			return true
		}
	}
	return false
}

// renderReadBack is the read-back case's table.
func renderReadBack(r *ReadBackResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nread-back at restart (G18): kill -9 after %.0f s under %.0f rows/s, load going on through the outage, restart; stream duplicate window %.0f s\n\n",
		r.BeforeKillSeconds, r.Rate, r.DupWindowSeconds)
	sb.WriteString("| load | read-back | outage s | rows | stored at restart | read-back s | headers read | found stored (settled, not sent) | published again, dropped as duplicate | stored twice | restart to drained s | drain msg/s | msg/s after the read-back | load avg |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, x := range r.Rounds {
		mode := "on"
		if !x.ReadBack {
			mode = "off (--readback-limit 0)"
		}
		load := fmt.Sprintf("%.0f rows/s", r.Rate)
		if x.Backlog {
			load = "backlog, killed half way"
		}
		fmt.Fprintf(&sb, "| %s | %s | %.0f | %d | %d | %.3f | %.0f | %.0f | %.0f | %d | %.2f | %.0f | %.0f | %s |\n",
			load, mode, x.OutageSeconds, x.Rows, x.StoredAtKill, x.ReadBackSeconds, x.ReadBackMessages, x.Found, x.PublishedDup, x.StoredTwice, x.DrainSeconds, x.DrainMsgsPerSec, x.AfterReadBackMsgsPerSec, x.LoadAvg)
	}
	for _, x := range r.Rounds {
		if x.Backlog && x.ReadBack {
			writeLog(&sb, "backlog, killed half way: the restart's read-back", x.Log)
		}
	}
	if cs := r.CleanStop; cs != nil {
		fmt.Fprintf(&sb, "\nread-back after a clean stop (issue 41): a backlog of %d rows drained whole, SIGTERM (waited for), restart, %d rows committed once it streams\n\n", cs.Backlog, cs.Rows)
		sb.WriteString("| session | drain msg/s | clean stop s | read-back s | headers read | found stored | published | stored twice | load avg |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
		fmt.Fprintf(&sb, "| drained the backlog (started after a session with the read-back off) | %.0f | %.2f | %.3f | %.0f | - | - | - | %s |\n",
			cs.DrainMsgsPerSec, cs.StopSeconds, cs.DrainReadBackSeconds, cs.DrainReadBackMessages, cs.LoadAvg)
		fmt.Fprintf(&sb, "| restarted after its clean stop | - | - | %.3f | %.0f | %.0f | %.0f | %d | |\n",
			cs.ReadBackSeconds, cs.ReadBackMessages, cs.Found, cs.PublishedOK, cs.StoredTwice)
		writeLog(&sb, "the draining session's read-back", cs.DrainLog)
		writeLog(&sb, "the restarted session's read-back", cs.Log)
	}
	return sb.String()
}

// writeLog prints a session's read-back log lines under a title, or says
// there was none (no read-back ran: a finding in itself).
func writeLog(sb *strings.Builder, title string, lines []string) {
	fmt.Fprintf(sb, "\n%s, relay log:\n", title)
	if len(lines) == 0 {
		sb.WriteString("  (no line about a read-back)\n")
	}
	for _, l := range lines {
		fmt.Fprintf(sb, "  %s\n", l)
	}
}
