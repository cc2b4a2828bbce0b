// Package bigtable is the whole-system check of G16 (DESIGN.md: cost grows
// with the batch, not the table): a table preloaded with many published rows
// (a fifth of them in aggregates, one dead letter holding an aggregate), the
// relay binary run on it with --ordering aggregate, its console's overview
// and dead letters fetched every 2 s and /metrics every 5 s, and a trickle of
// new rows committed meanwhile. It measures what the outbox table went
// through in that window (pg_stat_user_tables.seq_scan), the trickle's
// commit-to-stored latency, and each statement the database ran
// (pg_stat_statements for calls and times, auto_explain's plans for which
// ones scanned the outbox table sequentially).
//
// The e2e test TestNoTableScansAtAMillionRows (proof/e2e) runs it at a
// million rows and asserts on the result; the benchmark's bigtable case
// (proof/bench) runs it at 20 million and prints the table.
package bigtable

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Config is one run.
type Config struct {
	DBURL   string // an empty database on a server started with ServerConf
	PGLog   string // that server's log, where auto_explain writes the plans
	NATSURL string
	// RelayBin is the outbox-relay binary; RelayEnv its environment.
	RelayBin string
	RelayEnv []string
	Dir      string // the relay's log goes here

	Rows       int // preloaded published rows
	Aggregates int // the fifth of Rows in aggregates is spread over this many (0: 1000)
	// Rate is the trickle's rows per second (0: 20); Window how long it and
	// the console and metrics polling run after the warm-up (0: 60 s).
	Rate   float64
	Window time.Duration
	// WarmUp runs after the relay streams and before the window opens
	// (0: 12 s): long enough for every backend to flush the counters of
	// its start-up statements (PostgreSQL 15+ flushes an idle backend's
	// table counters within 10 s), so none lands in the window.
	WarmUp time.Duration

	Stream, SubjectPrefix, Slot, Publication string // "" for defaults

	// Control leaves out what G16 is about: no dead letter and no delayed
	// rows (so no aggregate is ever held), no console or /metrics polling,
	// no table metrics (--stats-interval 0). The relay's own path, the trickle and the
	// measurement stay: a control run shows that the harness sees no scan
	// where there is none, i.e. that the test can pass.
	Control bool

	Logf func(format string, args ...any) // progress; nil: quiet
}

func (c *Config) defaults() {
	if c.Aggregates <= 0 {
		c.Aggregates = 1000
	}
	if c.Rate <= 0 {
		c.Rate = 20
	}
	if c.Window <= 0 {
		c.Window = 60 * time.Second
	}
	if c.WarmUp <= 0 {
		c.WarmUp = 12 * time.Second
	}
	if c.Stream == "" {
		c.Stream = "BIGTABLE"
	}
	if c.SubjectPrefix == "" {
		c.SubjectPrefix = "bigtable."
	}
	if c.Slot == "" {
		c.Slot = "bigtable"
	}
	if c.Publication == "" {
		c.Publication = "outbox_relay"
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
}

// statsFlush is how long after the window the counters are read: an idle
// backend flushes its pending table counters within 10 s
// (PGSTAT_IDLE_INTERVAL), a busy one every second.
const statsFlush = 11 * time.Second

// Result is what one run measured.
type Result struct {
	Rows        int     `json:"rows"`
	LoadSeconds float64 `json:"load_seconds"` // insert, dead letter, VACUUM ANALYZE
	TableMB     float64 `json:"table_mb"`     // pg_total_relation_size of the outbox table
	HeapBlocks  int64   `json:"heap_blocks"`  // its heap's blocks (pg_relation_size / 8 kB)
	DeadLetter  string  `json:"dead_letter"`  // its work_id
	HeldRows    int     `json:"held_rows"`    // rows of its aggregate behind it

	// WindowSeconds is from the counters' first read to their last:
	// Window plus the wait for the counters to be flushed.
	WindowSeconds float64 `json:"window_seconds"`
	// SeqScans and IdxScans on the outbox table in the window
	// (pg_stat_user_tables); SeqTupRead the rows those scans read.
	SeqScans   int64 `json:"seq_scans"`
	SeqTupRead int64 `json:"seq_tup_read"`
	IdxScans   int64 `json:"idx_scans"`

	Trickle    int      `json:"trickle_rows"`   // committed by the producer
	Stored     int      `json:"trickle_stored"` // found in the stream, once each
	Missing    []string `json:"missing,omitempty"`
	Duplicates []string `json:"duplicates,omitempty"`
	// Commit-to-stored latency of the trickle, ms: from the moment the
	// producer's INSERT (one autocommitted row) returned to the JetStream
	// timestamp of its message (the server's clock, the same machine's).
	P50MS, P99MS, MaxMS float64
	// Early counts messages stored before their commit returned to the
	// producer (decoding follows the commit record's flush, the client hears
	// later): counted as 0 ms.
	Early int `json:"early"`
	// The delayed rows (a tenth) are not in those figures: they go
	// through the poller, whose claims come every --poll-interval.
	// DelayedP99MS is theirs, from when they were due.
	Delayed      int     `json:"delayed_rows"`
	DelayedP99MS float64 `json:"delayed_p99_ms"`
	// ByKind is the latency of each kind of trickle row (unordered, in an
	// aggregate of its own, in a preloaded aggregate, delayed), ms; the
	// delayed ones from when they were due.
	ByKind map[string]Latency `json:"by_kind"`

	// Fetches of the console and /metrics in the window, by page; any
	// answer other than 200 is in FetchErrors.
	Fetches     map[string]Fetches `json:"fetches"`
	FetchErrors []string           `json:"fetch_errors,omitempty"`
	// DeadLetterShown: the dead letters page listed the dead letter, and
	// /metrics counted it.
	DeadLetterShown, MetricsShown bool

	// Statements are what pg_stat_statements recorded in the window, most
	// total time first; StatementsNote says why there are none.
	Statements     []Statement `json:"statements"`
	StatementsNote string      `json:"statements_note,omitempty"`
	// Cancelled are the statements cancelled in the window (from the
	// server's log), which Statements cannot show.
	Cancelled []Cancelled `json:"cancelled,omitempty"`
}

// Latency sums up some rows' latencies, ms.
type Latency struct {
	N                   int
	P50MS, P99MS, MaxMS float64
}

// Fetches are the polls of one page.
type Fetches struct {
	N     int     `json:"n"`
	MaxMS float64 `json:"max_ms"`
	SumMS float64 `json:"sum_ms"`
}

// Run preloads the table, runs the relay and everything around it, and
// measures. An error means the run could not be made; what it measured is in
// the Result, for the caller to judge.
func Run(ctx context.Context, c Config) (Result, error) {
	c.defaults()
	r := Result{Rows: c.Rows, Fetches: map[string]Fetches{}}
	admin, err := pgx.Connect(ctx, c.DBURL)
	if err != nil {
		return r, fmt.Errorf("connect: %w", err)
	}
	defer admin.Close(context.Background())

	if err := c.migrate(ctx); err != nil {
		return r, err
	}
	t0 := time.Now()
	pl, err := preload(ctx, admin, c)
	if err != nil {
		return r, err
	}
	r.LoadSeconds = time.Since(t0).Seconds()
	r.DeadLetter, r.HeldRows = pl.deadLetter, pl.held
	if err := admin.QueryRow(ctx, `SELECT pg_total_relation_size('outbox') / 1048576.0, pg_relation_size('outbox') / current_setting('block_size')::int`).
		Scan(&r.TableMB, &r.HeapBlocks); err != nil {
		return r, fmt.Errorf("table size: %w", err)
	}
	c.Logf("preloaded %d rows (%.0f MB with indexes) in %.1fs; dead letter %s holds %d rows", c.Rows, r.TableMB, r.LoadSeconds, r.DeadLetter, r.HeldRows)
	pgss, note := statStatements(ctx, admin)
	r.StatementsNote = note

	httpAddr, err := freeAddr()
	if err != nil {
		return r, err
	}
	relay, err := c.startRelay(httpAddr)
	if err != nil {
		return r, err
	}
	defer relay.stop()
	if err := waitStreaming(ctx, admin, c.Slot, relay, 120*time.Second); err != nil {
		return r, err
	}
	c.Logf("relay streams slot %s; console and /metrics on %s", c.Slot, httpAddr)

	js, nc, err := connectJS(c.NATSURL)
	if err != nil {
		return r, err
	}
	defer nc.Close()

	// The trickle and the polling start with the warm-up and run through
	// the window.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var wg sync.WaitGroup
	tr := &trickle{url: c.DBURL, rate: c.Rate, aggregates: c.Aggregates, noDelayed: c.Control}
	trErr := make(chan error, 1)
	wg.Add(1)
	go func() { defer wg.Done(); trErr <- tr.run(runCtx) }()
	pol := newPoller(httpAddr, r.DeadLetter)
	if !c.Control {
		wg.Add(1)
		go func() { defer wg.Done(); pol.run(runCtx) }()
	}

	select {
	case <-time.After(c.WarmUp):
	case <-ctx.Done():
		return r, ctx.Err()
	}
	before, err := tableStats(ctx, admin)
	if err != nil {
		return r, err
	}
	logStart := fileSize(c.PGLog)
	if pgss {
		if err := explain(ctx, admin, true); err != nil {
			return r, err
		}
		if _, err := admin.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
			return r, fmt.Errorf("reset pg_stat_statements: %w", err)
		}
	}
	pol.open()
	opened := time.Now()
	c.Logf("window open: %v of a %g rows/s trickle, console every 2 s, /metrics every 5 s", c.Window, c.Rate)
	select {
	case <-time.After(c.Window):
	case <-ctx.Done():
		return r, ctx.Err()
	}
	pol.close() // what was fetched before the window opened is not counted
	stopRun()
	wg.Wait()
	if err := <-trErr; err != nil && !errors.Is(err, context.Canceled) {
		return r, fmt.Errorf("trickle: %w", err)
	}
	if relay.exited() {
		return r, fmt.Errorf("relay exited during the window: %v (log %s)", relay.err, relay.log)
	}
	c.Logf("window closed; waiting %v for the counters to be flushed", statsFlush)
	time.Sleep(statsFlush)
	after, err := tableStats(ctx, admin)
	if err != nil {
		return r, err
	}
	if pgss {
		if err := explain(ctx, admin, false); err != nil {
			return r, err
		}
	}
	r.WindowSeconds = time.Since(opened).Seconds()
	r.SeqScans, r.SeqTupRead, r.IdxScans = after.seqScan-before.seqScan, after.seqTupRead-before.seqTupRead, after.idxScan-before.idxScan
	if pgss {
		plans := readPlans(c.PGLog, logStart, "outbox")
		r.Cancelled = cancelledList(plans.cancelled)
		if r.Statements, err = readStatements(ctx, admin, plans, r.WindowSeconds); err != nil {
			return r, err
		}
	}
	r.Fetches, r.FetchErrors, r.DeadLetterShown, r.MetricsShown = pol.result()

	// Every trickle row must reach the stream, however late.
	r.Trickle = len(tr.commits)
	if err := waitStored(ctx, js, c.Stream, tr.commits, 60*time.Second); err != nil {
		c.Logf("%v", err)
	}
	if err := measure(ctx, js, c.Stream, tr.commits, tr.kinds, &r); err != nil {
		return r, err
	}
	if err := relay.stop(); err != nil {
		return r, err
	}
	return r, nil
}

func (c *Config) migrate(ctx context.Context) error {
	cmd := exec.CommandContext(ctx, c.RelayBin, "migrate", "--database-url", c.DBURL, "--publication", c.Publication)
	cmd.Env = c.env()
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("outbox-relay migrate: %w: %s", err, out)
	}
	return nil
}

func (c *Config) env() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			env = append(env, kv)
		}
	}
	return append(env, c.RelayEnv...)
}

// relayProc is the running relay.
type relayProc struct {
	cmd  *exec.Cmd
	log  string
	done chan struct{}
	err  error
	once sync.Once
	serr error
}

func (c *Config) startRelay(httpAddr string) (*relayProc, error) {
	log := filepath.Join(c.Dir, "relay.log")
	f, err := os.Create(log)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	args := []string{"run",
		"--database-url", c.DBURL, "--nats-url", c.NATSURL,
		"--slot", c.Slot, "--publication", c.Publication,
		"--stream", c.Stream, "--subject-prefix", c.SubjectPrefix,
		"--ordering", "aggregate",
		"--http-addr", httpAddr, "--console",
		// The table metrics as often as /metrics is scraped (default 30 s):
		// a dashboard that wants fresh numbers.
		"--stats-interval", "5s",
		"--log-format", "json",
	}
	if c.Control {
		args[len(args)-3] = "0"
	}
	cmd := exec.Command(c.RelayBin, args...)
	cmd.Env = c.env()
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start relay: %w", err)
	}
	p := &relayProc{cmd: cmd, log: log, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *relayProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and kills the relay when it has not exited 30 s later.
func (p *relayProc) stop() error {
	p.once.Do(func() {
		if p.exited() {
			p.serr = fmt.Errorf("relay had exited: %v (log %s)", p.err, p.log)
			return
		}
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			_ = p.cmd.Process.Kill()
			<-p.done
			p.serr = fmt.Errorf("relay did not exit within 30 s of SIGTERM (log %s)", p.log)
		}
	})
	return p.serr
}

func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func waitStreaming(ctx context.Context, conn *pgx.Conn, slot string, p *relayProc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var ok bool
		err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming'))`, slot).Scan(&ok)
		if err != nil {
			return fmt.Errorf("wait for slot %s: %w", slot, err)
		}
		if ok {
			return nil
		}
		if p.exited() {
			return fmt.Errorf("relay exited before streaming: %v (log %s)", p.err, p.log)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("slot %s not streamed after %v (relay log %s)", slot, timeout, p.log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func connectJS(url string) (jetstream.JetStream, *nats.Conn, error) {
	nc, err := nats.Connect(url, nats.Name("bigtable"), nats.Timeout(5*time.Second))
	if err != nil {
		return nil, nil, fmt.Errorf("connect to NATS: %w", err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return js, nc, nil
}

type counters struct{ seqScan, seqTupRead, idxScan int64 }

// tableStats reads the outbox table's scan counters, fresh: a snapshot of
// the statistics taken earlier in this session is dropped first.
func tableStats(ctx context.Context, conn *pgx.Conn) (counters, error) {
	var c counters
	if _, err := conn.Exec(ctx, `SELECT pg_stat_clear_snapshot()`); err != nil {
		return c, fmt.Errorf("clear statistics snapshot: %w", err)
	}
	err := conn.QueryRow(ctx, `SELECT coalesce(seq_scan, 0), coalesce(seq_tup_read, 0), coalesce(idx_scan, 0)
		FROM pg_stat_user_tables WHERE relid = 'outbox'::regclass`).Scan(&c.seqScan, &c.seqTupRead, &c.idxScan)
	if err != nil {
		return c, fmt.Errorf("read pg_stat_user_tables for outbox: %w", err)
	}
	return c, nil
}

func fileSize(path string) int64 {
	st, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return st.Size()
}

var httpClient = &http.Client{Timeout: 30 * time.Second}
