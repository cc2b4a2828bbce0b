package bench

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

const (
	slotName     = "outbox_relay"
	relayAppName = "outbox-bench-relay"
)

type bench struct {
	cfg     Config
	s       *servers
	dir     string
	self    string
	payload string
	// payloadSQL is how the producers' INSERT turns the text parameter p
	// into the payload column ("": p::jsonb); the formats case sets it per
	// payload type.
	payloadSQL string
	kept       map[string]*path // -same-table: each case's path, kept for the next round
	// checkCPU is the CPU the last waitDrained's own backend spent counting
	// unsettled rows.
	checkCPU float64
	// checkLast is how long the last waitDrained's last count took: the
	// drain's end is known up to about five times that late (the count is
	// repeated after four times its own time), and on a table without an
	// index on state, as the relay's, the count scans the whole table.
	checkLast time.Duration
}

// path is one way rows get from the table to the stream: the relay's CDC
// path, the relay's poller, or the naive polling publisher.
type path struct {
	kind      string // cdc, poller, naive
	db, url   string
	stream    string
	prefix    string
	table     string // for the producers' INSERT
	state     string // inserted state; "" = default ready
	remaining string // SQL: rows not published yet
	start     func() (*proc, error)
	idBase    int    // -same-table: rows of earlier rounds already in the table
	baseMsgs  uint64 // -same-table: messages of earlier rounds already in the stream
}

func caseKind(k string) string {
	switch k {
	case CDCBacklog, CDCLive, Decode, ReadBack, RestartDrains:
		return "cdc"
	case PollerBacklog, PollerLive:
		return "poller"
	case PollBacklog, PollLive, restartDrainsPoll:
		return "naive"
	}
	return ""
}

func (b *bench) names(k string, round int) (db, stream, prefix string) {
	if b.cfg.SameTable && round > 1 {
		round = 1
	}
	flat := strings.ReplaceAll(k, "-", "_")
	return fmt.Sprintf("b%d_%s", round, flat), strings.ToUpper(fmt.Sprintf("b%d_%s", round, flat)),
		fmt.Sprintf("b%d.%s.", round, strings.ReplaceAll(k, "-", ""))
}

// relayArgs are the relay's flags for path p; a case's extra flags come
// before -relay-args, so that an experiment's flags still win.
func (b *bench) relayArgs(p *path, poll time.Duration, extra ...string) []string {
	args := append([]string{"run",
		"--database-url", b.relayURL(p.url), "--nats-url", b.s.nats.URL(),
		"--stream", p.stream, "--subject-prefix", p.prefix, "--on-publish", b.cfg.Policy,
		"--poll-interval", poll.String(), "--stats-interval", "0",
		"--application-name", relayAppName, "--worker-id", "bench", "--log-level", "warn",
	}, extra...)
	return append(args, b.cfg.RelayArgs...)
}

// relayURL adds -relay-pg-options (server settings for the relay's
// sessions, libpq's options parameter) to a database URL.
func (b *bench) relayURL(u string) string {
	if b.cfg.RelayPGOptions == "" {
		return u
	}
	return u + "&options=" + strings.ReplaceAll(url.QueryEscape(b.cfg.RelayPGOptions), "+", "%20")
}

func (b *bench) migrate(url string) error {
	cmd := exec.Command(b.cfg.RelayBin, "migrate", "--database-url", url)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox-relay migrate: %w: %s", err, out)
	}
	return nil
}

// setup creates the case's database and stream. For the relay's paths it
// starts the relay once, so the slot and the stream exist before any row is
// inserted (rows committed before the slot would go to the poller, G9), and
// stops it again.
func (b *bench) setup(ctx context.Context, k string, round int) (*path, error) {
	if p := b.kept[k]; p != nil {
		// -same-table: the case's database, table, slot and stream of round 1,
		// holding every earlier round's rows and messages.
		p.idBase += b.cfg.Rows
		n, err := b.s.streamMsgs(ctx, p.stream)
		p.baseMsgs = n
		return p, err
	}
	db, stream, prefix := b.names(k, round)
	url, err := b.s.createDB(ctx, db)
	if err != nil {
		return nil, err
	}
	p := &path{kind: caseKind(k), db: db, url: url, stream: stream, prefix: prefix}
	logPath := filepath.Join(b.dir, db+".log")
	switch p.kind {
	case "cdc", "poller":
		if err := b.migrate(url); err != nil {
			return p, err
		}
		p.table = "outbox"
		poll := time.Second // the default of `run`: the CDC cases keep the poller as deployed
		p.remaining = unsettledSQL(b.cfg.Policy)
		if p.kind == "poller" {
			p.state = "scheduled"
			poll = b.cfg.PollInterval
			p.remaining = `SELECT count(*) FROM outbox WHERE state IN ('scheduled', 'running')`
		}
		p.start = func() (*proc, error) {
			return startProcEnv("relay", logPath, b.cfg.RelayBin, b.cfg.RelayEnv, b.relayArgs(p, poll)...)
		}
		pr, err := p.start()
		if err != nil {
			return p, err
		}
		_, werr := b.s.walsenderPID(ctx, db, slotName, 60*time.Second)
		for werr == nil {
			if _, err := b.s.js.Stream(ctx, stream); err == nil {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err := pr.stop(); err != nil || werr != nil {
			return p, errors.Join(werr, err)
		}
		// The next relay must find its own walsender, not this one exiting.
		if err := b.s.waitSlotInactive(ctx, db, slotName, 30*time.Second); err != nil {
			return p, err
		}
	case "naive":
		if _, err := b.s.admin.Exec(ctx, "SELECT 1"); err != nil {
			return p, err
		}
		conn, err := pgx.Connect(ctx, url)
		if err != nil {
			return p, err
		}
		_, err = conn.Exec(ctx, naiveTable)
		conn.Close(context.Background())
		if err != nil {
			return p, fmt.Errorf("create naive_outbox: %w", err)
		}
		if err := b.createStream(ctx, stream, prefix); err != nil {
			return p, err
		}
		p.table = "naive_outbox"
		p.remaining = `SELECT count(*) FROM naive_outbox WHERE state = 'ready'`
		p.start = func() (*proc, error) {
			return startProc("naive publisher", logPath, b.self, "naive-publish",
				"-database-url", url, "-nats-url", b.s.nats.URL(), "-subject", prefix+"bench",
				"-poll-interval", b.cfg.PollInterval.String(), "-policy", naivePolicy(b.cfg.Policy), "-mode", b.cfg.NaiveMode)
		}
	default:
		if err := b.migrate(url); err != nil {
			return p, err
		}
	}
	return p, nil
}

// createStream makes a stream like the one the relay creates: file storage,
// one replica, 2 minute duplicate window.
func (b *bench) createStream(ctx context.Context, name, prefix string) error {
	_, err := b.s.js.CreateStream(ctx, jetstream.StreamConfig{
		Name: name, Subjects: []string{prefix + ">"}, Storage: jetstream.FileStorage,
		Replicas: 1, Duplicates: 2 * time.Minute,
	})
	if err != nil {
		return fmt.Errorf("create stream %s: %w", name, err)
	}
	return nil
}

func (b *bench) teardown(p *path, k string, round int) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if p == nil {
		return
	}
	if b.cfg.SameTable && round >= 1 && round < b.cfg.Rounds && caseKind(k) != "" {
		if b.kept == nil {
			b.kept = map[string]*path{}
		}
		b.kept[k] = p
		return
	}
	delete(b.kept, k)
	b.s.deleteStream(ctx, p.stream)
	if err := b.s.dropDB(ctx, p.db); err != nil {
		fmt.Fprintf(os.Stderr, "outbox-bench: %v\n", err)
	}
}

func (b *bench) newLoad(p *path, rows int, rate float64) *load {
	return &load{
		url: p.url, table: p.table, state: p.state, rows: rows, rowsPerTx: b.cfg.RowsPerTx,
		producers: b.cfg.Producers, rate: rate, payload: b.payload, payloadSQL: b.payloadSQL, base: time.Now(), idBase: p.idBase,
	}
}

func (b *bench) runCase(ctx context.Context, k string, round int) (r Result, err error) {
	p, err := b.setup(ctx, k, round)
	defer b.teardown(p, k, round)
	if err != nil {
		return r, err
	}
	switch k {
	case CeilingPG, CDCBacklog, PollerBacklog, PollBacklog, CDCLive, PollerLive, PollLive:
		// The cases whose WAL is measured start from the same state (wal.go).
		if err := b.s.checkpoint(ctx); err != nil {
			return r, err
		}
	}
	switch k {
	case CeilingPG:
		r, err = b.ceilingPG(ctx, p)
	case CeilingJS:
		r, err = b.ceilingJS(ctx, p)
	case CDCBacklog, PollerBacklog, PollBacklog:
		r, err = b.backlog(ctx, p)
	case Decode:
		r, err = b.decode(ctx, p)
	case CDCLive, PollerLive, PollLive:
		r, err = b.live(ctx, p)
	}
	r.Case, r.Round = k, round
	return r, err
}

func (b *bench) ceilingPG(ctx context.Context, p *path) (Result, error) {
	p.table = "outbox"
	wal0, err := b.s.walNow(ctx)
	if err != nil {
		return Result{}, err
	}
	machine := newCPUMeter(MachineBusy)
	pgCPU := newCPUMeter(b.serverCPU)
	self := newCPUMeter(pidCPU(os.Getpid()))
	l := b.newLoad(p, b.cfg.Rows, 0)
	el, err := l.run(ctx)
	if err != nil {
		return Result{}, err
	}
	rate := float64(l.rows) / el.Seconds()
	r := Result{Case: CeilingPG, Rows: l.rows, Seconds: el.Seconds(), MsgsPerSec: rate, InsertRate: rate,
		MachineBusy: machine.delta(), PGCPU: pgCPU.delta()}
	r.Extra = insertWindow(el, map[string]float64{"machine": r.MachineBusy, "pg": r.PGCPU, "bench": self.delta()})
	return r, b.recordWAL(ctx, &r, wal0, l.rows)
}

func (b *bench) serverCPU() (float64, error) { return ServerCPU(b.s.pg.PID()) }

// unsettledSQL counts the rows the relay's CDC path has not settled under
// policy: rows still 'ready' (the mark or the delete not committed), or
// under none, where a published row stays 'ready', the rows the newest
// watermark does not cover (G17; the condition of internal/store's
// coveredSQL, on the benchmark's table and its slots table).
func unsettledSQL(policy string) string {
	if policy == "none" {
		return `SELECT count(*) FROM outbox AS o WHERE o.state = 'ready' AND NOT coalesce(pg_visible_in_snapshot(o.xact_id,
			(SELECT w.watermark_snapshot FROM outbox_slots AS w WHERE w.watermark_lsn IS NOT NULL ORDER BY w.watermark_lsn DESC LIMIT 1)), false)`
	}
	return `SELECT count(*) FROM outbox WHERE state = 'ready'`
}

// naivePolicy is what the naive polling publisher does after the ack: it
// has no watermark, so under none it marks, as under mark.
func naivePolicy(policy string) string {
	if policy == "none" {
		return "mark"
	}
	return policy
}

func (b *bench) ceilingJS(ctx context.Context, p *path) (Result, error) {
	if err := b.createStream(ctx, p.stream, p.prefix); err != nil {
		return Result{}, err
	}
	natsCPU := newCPUMeter(pidCPU(b.s.nats.PID()))
	machine := newCPUMeter(MachineBusy)
	data := []byte(b.payload)
	subject := p.prefix + "bench"
	n := b.cfg.Rows
	start := time.Now()
	futs := make([]jetstream.PubAckFuture, 0, n)
	for i := range n {
		f, err := b.s.js.PublishMsgAsync(&nats.Msg{Subject: subject, Data: data, Header: nats.Header{"Nats-Msg-Id": []string{workID(i)}}})
		if err != nil {
			return Result{}, fmt.Errorf("publish: %w", err)
		}
		futs = append(futs, f)
	}
	select {
	case <-b.s.js.PublishAsyncComplete():
	case <-time.After(5 * time.Minute):
		return Result{}, errors.New("acks not complete after 5m")
	}
	el := time.Since(start)
	for _, f := range futs {
		select {
		case err := <-f.Err():
			return Result{}, fmt.Errorf("publish: %w", err)
		default:
		}
	}
	return Result{Rows: n, Seconds: el.Seconds(), MsgsPerSec: float64(n) / el.Seconds(),
		NATSCPU: natsCPU.delta(), MachineBusy: machine.delta()}, nil
}

// waitDrained waits until the stream holds n messages and then until no
// row is left unpublished; it returns both times.
func (b *bench) waitDrained(ctx context.Context, p *path, n int, pr *proc, timeout time.Duration) (acked, settled time.Time, err error) {
	return b.waitDrainedThen(ctx, p, n, pr, timeout, nil)
}

// waitDrainedThen is waitDrained calling onAcked once every message is in
// the stream. The count of unpublished rows scans the table, so it is
// polled at most every fourth of the time: the check costs the server at
// most a fifth of a core, and the end is known within a few scans.
func (b *bench) waitDrainedThen(ctx context.Context, p *path, n int, pr *proc, timeout time.Duration, onAcked func()) (acked, settled time.Time, err error) {
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return acked, settled, err
	}
	b.checkCPU, b.checkLast = 0, 0
	defer func() {
		// The count below is the benchmark's work, not the path's: its
		// backend's CPU is taken out of the server's (checkCPU).
		b.checkCPU, _ = ProcCPU(int(conn.PgConn().PID()))
		conn.Close(context.Background())
	}()
	deadline := time.Now().Add(timeout)
	for {
		got, err := b.s.streamMsgs(ctx, p.stream)
		if err != nil {
			return acked, settled, err
		}
		if got >= uint64(n) {
			acked = time.Now()
			if onAcked != nil {
				onAcked()
			}
			break
		}
		if pr != nil && pr.exited() {
			return acked, settled, fmt.Errorf("%s exited: %v (log %s)", pr.name, pr.err, pr.log)
		}
		if time.Now().After(deadline) {
			return acked, settled, fmt.Errorf("stream %s holds %d of %d messages after %v", p.stream, got, n, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for {
		var left int64
		q0 := time.Now()
		if err := conn.QueryRow(ctx, p.remaining).Scan(&left); err != nil {
			return acked, settled, err
		}
		b.checkLast = time.Since(q0)
		if left == 0 {
			return acked, time.Now(), nil
		}
		if time.Now().After(deadline) {
			return acked, settled, fmt.Errorf("%d rows not published after %v", left, timeout)
		}
		time.Sleep(max(10*time.Millisecond, 4*time.Since(q0)))
	}
}

func drainTimeout(n int) time.Duration { return max(2*time.Minute, time.Duration(n/500)*time.Second) }

// backlog commits all rows first, then starts the publisher and times it
// from its start to the last row published.
func (b *bench) backlog(ctx context.Context, p *path) (Result, error) {
	return b.backlogThen(ctx, p, b.cfg.Rows, nil)
}

// backlogThen is backlog of rows rows, calling atEnd, if not nil, with the
// publisher still running once every row is settled and its CPU is read:
// what only the running process can tell (the relay's /metrics) is read
// then, without counting in the drain.
func (b *bench) backlogThen(ctx context.Context, p *path, rows int, atEnd func(pr *proc) error) (Result, error) {
	wal0, err := b.s.walNow(ctx)
	if err != nil {
		return Result{}, err
	}
	l := b.newLoad(p, rows, 0)
	el, err := l.run(ctx)
	if err != nil {
		return Result{}, err
	}
	r := Result{Rows: l.rows, InsertRate: float64(l.rows) / el.Seconds(), Extra: map[string]float64{}}
	if p.kind != "naive" {
		if r.Extra["slot_wal_mb_from_restart"], r.Extra["slot_wal_mb_from_confirmed"], err = b.s.slotWAL(ctx, p.db, slotName); err != nil {
			return r, err
		}
	}
	walDrain, err := b.s.walNow(ctx)
	if err != nil {
		return r, err
	}
	natsCPU := newCPUMeter(pidCPU(b.s.nats.PID()))
	machine := newCPUMeter(MachineBusy)
	pgCPU := newCPUMeter(b.serverCPU)
	t0 := time.Now()
	pr, err := p.start()
	if err != nil {
		return r, err
	}
	defer pr.stop() //nolint:errcheck // stopped below; this covers the error paths
	wsPID := 0
	if p.kind != "naive" {
		if wsPID, err = b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
			return r, err
		}
	}
	acked, settled, err := b.waitDrained(ctx, p, l.rows+int(p.baseMsgs), pr, drainTimeout(l.rows))
	if err != nil {
		return r, err
	}
	r.Seconds = settled.Sub(t0).Seconds()
	r.MsgsPerSec = float64(l.rows) / r.Seconds
	r.Extra["acked_seconds"] = acked.Sub(t0).Seconds()
	if r.PubCPUSeconds, r.PubPeakRSSMB, err = pr.usage(); err != nil {
		return r, err
	}
	r.PubCPUPerMsgUS = r.PubCPUSeconds / float64(l.rows) * 1e6
	if sw, sc, err := ProcSwitches(pr.pid()); err == nil {
		r.Extra["pub_switches_per_msg"] = sw / float64(l.rows)
		r.Extra["pub_syscalls_per_msg"] = sc / float64(l.rows)
	}
	if wsPID != 0 {
		// A new walsender started with this relay: all its CPU is this drain's.
		r.WalsenderCPU, _ = ProcCPU(wsPID)
	}
	r.NATSCPU, r.MachineBusy, r.PGCPU = natsCPU.delta(), machine.delta(), pgCPU.delta()-b.checkCPU
	r.Extra["pg_check_cpu_seconds"] = b.checkCPU
	r.Extra["pg_check_last_seconds"] = b.checkLast.Seconds()
	if atEnd != nil {
		if err := atEnd(pr); err != nil {
			return r, err
		}
	}
	// The drain's WAL alone (from the publisher's start): what it made the
	// database write, without the inserts; a check on the share that
	// addWALShares derives from ceiling-pg.
	if end, err := b.s.walNow(ctx); err == nil {
		r.Extra["drain_wal_bytes_per_msg"] = float64(end.lsn-walDrain.lsn) / float64(l.rows)
	}
	if err := b.recordWAL(ctx, &r, wal0, l.rows); err != nil {
		return r, err
	}
	return r, pr.stop()
}

// live runs the producers and the publisher together; a consumer on the
// stream times each row from its COMMIT to its arrival.
func (b *bench) live(ctx context.Context, p *path) (Result, error) {
	n := b.cfg.liveRows()
	pr, err := p.start()
	if err != nil {
		return Result{}, err
	}
	defer pr.stop() //nolint:errcheck // stopped below; this covers the error paths
	wsPID := 0
	if p.kind != "naive" {
		if wsPID, err = b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
			return Result{}, err
		}
	}
	time.Sleep(300 * time.Millisecond) // let the publisher connect and settle
	l := b.newLoad(p, n, b.cfg.Rate)
	col, err := collect(ctx, b.s.js, p.stream, l.base, n, p.idBase)
	if err != nil {
		return Result{}, err
	}
	wal0, err := b.s.walNow(ctx)
	if err != nil {
		return Result{}, err
	}
	pubCPU := newCPUMeter(pidCPU(pr.pid()))
	sw0, sc0, _ := ProcSwitches(pr.pid())
	wsCPU := newCPUMeter(pidCPU(wsPID))
	natsCPU := newCPUMeter(pidCPU(b.s.nats.PID()))
	machine := newCPUMeter(MachineBusy)
	pgCPU := newCPUMeter(b.serverCPU)
	self := newCPUMeter(pidCPU(os.Getpid()))
	el, err := l.run(ctx)
	if err != nil {
		return Result{}, err
	}
	window := insertWindow(el, map[string]float64{"machine": machine.delta(), "pg": pgCPU.delta(), "walsender": wsCPU.delta(),
		"pub": pubCPU.delta(), "nats": natsCPU.delta(), "bench": self.delta()})
	if err := col.wait(ctx, drainTimeout(n)); err != nil {
		return Result{}, err
	}
	_, settled, err := b.waitDrained(ctx, p, n+int(p.baseMsgs), pr, drainTimeout(n))
	if err != nil {
		return Result{}, err
	}
	_, last := firstLast(col.recvNs)
	r := Result{Rows: n, InsertRate: float64(n) / el.Seconds()}
	// Rows not settled after their ack: the marks (or deletes) lagging, or
	// under none the watermark (unsettledSQL).
	r.Extra = window
	r.Extra["settled_seconds"] = settled.Sub(l.base).Seconds()
	r.Seconds = time.Duration(last).Seconds()
	r.MsgsPerSec = float64(n) / r.Seconds
	lat := latencies(l.commitNs, col.recvNs)
	sum := Summarize(lat)
	r.Latency = &sum
	r.Latencies = make([]float64, len(lat))
	for i, d := range lat {
		r.Latencies[i] = float64(d) / float64(time.Millisecond)
	}
	r.Throughput = throughput(col.recvNs)
	r.PubCPUSeconds = pubCPU.delta()
	r.PubCPUPerMsgUS = r.PubCPUSeconds / float64(n) * 1e6
	if sw1, sc1, err := ProcSwitches(pr.pid()); err == nil {
		r.Extra["pub_switches_per_msg"] = (sw1 - sw0) / float64(n)
		r.Extra["pub_syscalls_per_msg"] = (sc1 - sc0) / float64(n)
	}
	if _, rss, err := pr.usage(); err == nil {
		r.PubPeakRSSMB = rss
	} else {
		return r, err
	}
	if wsPID != 0 {
		r.WalsenderCPU = wsCPU.delta()
	}
	r.NATSCPU, r.MachineBusy, r.PGCPU = natsCPU.delta(), machine.delta(), pgCPU.delta()-b.checkCPU
	r.Extra["pg_check_cpu_seconds"] = b.checkCPU
	if err := b.recordWAL(ctx, &r, wal0, n); err != nil {
		return r, err
	}
	return r, pr.stop()
}

// insertWindow records where the machine's CPU went while the producers
// inserted (the window their insert rate is measured over), by process, as
// Extra entries insert_<name>_cpu_s beside insert_seconds: the figures that
// split the producers' lost share beside the relay (docs/benchmarks-append-only.md,
// "Where the producers' share goes"). The counters go on past the window
// (the meters are read again at the case's end); these are read at its end.
func insertWindow(el time.Duration, cpu map[string]float64) map[string]float64 {
	out := map[string]float64{"insert_seconds": el.Seconds()}
	for k, v := range cpu {
		out["insert_"+k+"_cpu_s"] = v
	}
	return out
}
