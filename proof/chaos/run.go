// Package chaos is a repeatable chaos run of the relay: real PostgreSQL and
// NATS (internal/testenv), the relay binary as child processes behind TCP
// proxies of its own, a producer load with rolled-back transactions mixed
// in, and faults at seeded random moments. An independent test_decoding
// slot (the witness) records every committed row and its transaction's end
// LSN, so that G3 can be checked after every SIGKILL and G1/G2/G5 at the
// end, without trusting anything the relay says about itself. With the
// opt-in fault pg-failover (failover.go) a standby is promoted and the
// checker judges against the new primary's history from then on.
//
// The checker logic (Ledger, WitnessParser, Report) and the Proxy are plain
// Go and tested on their own; Run is driven by cmd/outbox-chaos.
package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Fault kinds, as named in -faults.
const (
	FaultRelayKill         = "relay-kill"
	FaultNATSKill          = "nats-kill"
	FaultPGRestartFast     = "pg-restart-fast"
	FaultPGRestartImmed    = "pg-restart-immediate"
	FaultPGTermWalsender   = "pg-terminate-walsender"
	FaultPGTermConns       = "pg-terminate-conns"
	FaultNATSCut           = "nats-cut"
	FaultPGCut             = "pg-cut"
	FaultNATSLatency       = "nats-latency"
	FaultPGLatency         = "pg-latency"
	FaultTakeoverKill      = "takeover-kill"
	FaultTakeoverPartition = "takeover-partition"
	FaultNATSLoseTail      = "nats-lose-tail"
	FaultRelayKillLong     = "relay-kill-long"
	FaultBrokerSlow        = "broker-slow"
	FaultRelayPaused       = "relay-paused"
	FaultPollerKilled      = "poller-killed-after-acks"
	FaultConsumerLimit     = "consumer-limit"
	FaultPGClockShifted    = "pg-clock-shifted"
)

// AllFaults are the kinds a run uses when -faults is not given. Each round
// of the schedule is a seeded permutation of the enabled kinds in which
// relay-kill appears relayKillWeight times. pg-failover is not among them:
// it needs a standby and changes the history the checker judges against,
// so a run asks for it (Config.Failover, -failover).
var AllFaults = []string{
	FaultRelayKill, FaultNATSKill, FaultPGRestartFast, FaultPGRestartImmed,
	FaultPGTermWalsender, FaultPGTermConns, FaultNATSCut, FaultPGCut,
	FaultNATSLatency, FaultPGLatency, FaultTakeoverKill, FaultTakeoverPartition,
	FaultNATSLoseTail, FaultRelayKillLong,
	FaultBrokerSlow, FaultRelayPaused, FaultPollerKilled, FaultConsumerLimit, FaultPGClockShifted,
}

const relayKillWeight = 3

// pollerLease is the relays' --lease: longer than their --ack-timeout (5 s),
// as the relay requires, and as short as that allows.
const pollerLease = 6 * time.Second

// DefaultDuplicateWindow is the chaos stream's duplicate window: short, so
// that outages (every nats-kill hold, relay-kill-long on purpose) outlast
// it and what keeps a replay from being stored twice is the relay's
// read-back (G18) and its lookups of uncertain rows, not the broker's
// deduplication.
const DefaultDuplicateWindow = 2 * time.Second

// maxKillLongWindow is the longest duplicate window relay-kill-long is run
// with: it keeps the relay down three to four windows.
const maxKillLongWindow = 10 * time.Second

// notApplicable says why kind cannot be run in this configuration (empty:
// it can). Such a kind is skipped with that reason whenever its turn comes
// and does not fail the run for never biting.
func (c *Config) notApplicable(kind string) string {
	if kind == FaultPGClockShifted && c.PGClockOffset == 0 {
		return "PostgreSQL runs on this host's clock: -pg-clock-offset (libfaketime) shifts it for the whole run, as make chaos-short (+60s) and chaos-short-17 (-60s) do; devenv sets a server's clock when it is created, so a run cannot shift it in the middle"
	}
	if kind == FaultRelayKillLong && c.DuplicateWindow > maxKillLongWindow {
		return fmt.Sprintf("-duplicate-window %s: an outage of several duplicate windows does not fit a short run (the default is %s)", c.DuplicateWindow, DefaultDuplicateWindow)
	}
	if kind != FaultNATSLoseTail {
		return ""
	}
	if c.Cluster > 0 {
		return "a cluster: the replicas restore a node's lost tail, and one store cut is not the single broker losing acknowledged writes"
	}
	if c.onPublish() != "mark" {
		return "--on-publish " + c.onPublish() + ": the relay reports a lost tail (log at error with the range, outbox_relay_broker_lost_total) and does not publish it again by itself (the operator runs outbox-relay republish, docs/guarantees-broker.md); the checker would count them lost"
	}
	return ""
}

// Config is one run's settings.
type Config struct {
	Duration         time.Duration // how long the load and the faults last
	Seed             uint64
	Rate             int // committed rows per second over all producers
	Rows             int // stop the load after this many committed rows (0: Duration decides)
	Producers        int
	Faults           []string
	MinGap, MaxGap   time.Duration // pause between two faults
	MaxHold          time.Duration // longest outage of most kinds (relay-kill-long outlasts DuplicateWindow on purpose)
	DuplicateWindow  time.Duration // the duplicate window the relay creates the stream with (--duplicate-window)
	WalSenderTimeout time.Duration
	DrainTimeout     time.Duration
	Cluster          int           // 0: one nats-server; n: an n-node JetStream cluster and an R<n> stream
	PGVersion        int           // PostgreSQL major version (0: testenv's default)
	PGClockOffset    time.Duration // PostgreSQL's wall clock this far from the host's for the whole run (libfaketime; 0: the host's)
	Failover         bool          // add pg-failover to the faults (and run a standby)
	OnPublish        string        // the relay's --on-publish (mark when empty); none adds the watermark's check (G17)
	Race             bool          // build the relay with -race
	RelayBin         string        // use this binary instead of building one
	Keep             bool          // keep the work directory even when the run passes
	Command          string        // recorded in the report
	Replay           string        // the command that replays this run, recorded in the report
	Log              io.Writer
}

func (c *Config) onPublish() string {
	if c.OnPublish == "" {
		return "mark"
	}
	return c.OnPublish
}

// coveredSQL: the outbox row o is 'ready' and covered by the table's newest
// recorded watermark (--on-publish none, G17), written out here so the run
// checks the relay's watermark with its own reading of it.
const coveredSQL = `coalesce(pg_visible_in_snapshot(o.xact_id, (SELECT watermark_snapshot FROM outbox_slots
	WHERE watermark_lsn IS NOT NULL ORDER BY watermark_lsn DESC LIMIT 1)), false)`

func (c *Config) defaults() {
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	def(&c.Duration, 2*time.Minute)
	def(&c.MinGap, 500*time.Millisecond)
	def(&c.MaxGap, 3*time.Second)
	def(&c.MaxHold, 5*time.Second)
	def(&c.WalSenderTimeout, 5*time.Second)
	def(&c.DuplicateWindow, DefaultDuplicateWindow)
	def(&c.DrainTimeout, 3*time.Minute)
	if c.Rate <= 0 {
		c.Rate = 400
	}
	if c.Producers <= 0 {
		c.Producers = 4
	}
	if len(c.Faults) == 0 {
		c.Faults = AllFaults
		if c.Cluster > 0 {
			c.Faults = ClusterFaults
		}
	}
	if c.Failover && !slices.Contains(c.Faults, FaultPGFailover) {
		c.Faults = append(slices.Clone(c.Faults), FaultPGFailover)
	}
	if c.Log == nil {
		c.Log = io.Discard
	}
}

// ValidateFaults rejects unknown fault names, so a typo in -faults does not
// silently run fewer faults.
func ValidateFaults(names []string) error {
	all := append(slices.Clone(ClusterFaults), FaultPGFailover)
	for _, n := range names {
		if !slices.Contains(all, n) {
			return fmt.Errorf("unknown fault %q (known: %s)", n, strings.Join(all, ","))
		}
	}
	return nil
}

// Schedule returns the first n fault kinds of the seeded schedule. The
// first round has every enabled kind once, so a short run reaches each of
// them soonest; later rounds repeat relay-kill relayKillWeight times.
func Schedule(seed uint64, enabled []string, n int) []string {
	rng := rand.New(rand.NewPCG(seed, 2))
	var out []string
	for len(out) < n {
		var round []string
		for _, f := range enabled {
			k := 1
			if f == FaultRelayKill && len(out) > 0 {
				k = relayKillWeight
			}
			for range k {
				round = append(round, f)
			}
		}
		rng.Shuffle(len(round), func(i, j int) { round[i], round[j] = round[j], round[i] })
		out = append(out, round...)
	}
	return out[:n]
}

const (
	dbName      = "chaos"
	slotName    = "chaos_relay"
	witnessSlot = "chaos_witness"
	publication = "outbox_relay"
	streamName  = "CHAOS"
	subjPrefix  = "chaos."
)

type runner struct {
	cfg     Config
	rng     *rand.Rand
	start   time.Time
	workDir string
	pg      *testenv.Postgres    // the primary: every PostgreSQL fault targets it
	ns      *testenv.NATS        // one server, when cfg.Cluster is 0
	cl      *testenv.NATSCluster // otherwise
	js      jetstream.JetStream
	nc      *nats.Conn
	ledger  *Ledger
	relays  [2]*relayInst
	primary int // the instance that runs between takeover faults
	load    *load

	// With pg-failover: the standby it promotes (nil once promoted) and
	// the primaries it killed, which must never run again (the relay's
	// multi-host URL still names them).
	standby   *testenv.Postgres
	former    []*testenv.Postgres
	failovers []Failover

	dbMu  sync.Mutex
	dbURL string // the checker's way to the current primary, not through a proxy

	witnessMu sync.Mutex
	witness   WitnessParser
	streamMu  sync.Mutex

	maxLag atomic.Int64

	mu       sync.Mutex
	report   Report
	takeover []Takeover
	windows  []FaultWindow
	faultN   int // the number of the fault being injected
	clocks   Clocks
	// faultRows numbers the bursts of rows faults insert themselves, for
	// their work ids.
	faultRows int
}

func (r *runner) logf(format string, args ...any) {
	fmt.Fprintf(r.cfg.Log, "chaos t+%6.1fs  %s\n", time.Since(r.start).Seconds(), fmt.Sprintf(format, args...))
}

// Run performs one chaos run and returns its report. An error means the run
// could not be carried out (a server would not start, the relay would not
// build); what the run found is in the report.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg.defaults()
	if err := ValidateFaults(cfg.Faults); err != nil {
		return nil, err
	}
	if err := validateCluster(cfg.Cluster, cfg.Faults); err != nil {
		return nil, err
	}
	r := &runner{cfg: cfg, rng: rand.New(rand.NewPCG(cfg.Seed, 1)), start: time.Now(), ledger: NewLedger()}
	r.report = Report{Seed: cfg.Seed, Command: cfg.Command, Replay: cfg.Replay, Started: r.start, WalSenderTimeout: cfg.WalSenderTimeout.String(),
		Faults: map[string]int{}, FaultsSkipped: map[string]int{}, FaultsSkipReason: map[string]string{},
		FaultsNotApplicable: map[string]string{}, ClusterNodes: cfg.Cluster, DuplicateWindow: cfg.DuplicateWindow.String(),
		FaultsEnabled: slices.Clone(cfg.Faults), FaultsBit: map[string]int{},
		FailoverEnabled: slices.Contains(cfg.Faults, FaultPGFailover)}
	r.logf("seed %d; faults %s", cfg.Seed, strings.Join(cfg.Faults, ","))
	// A kind this configuration cannot run is known before the load
	// starts: it takes no turn of the schedule, which a short run needs
	// for the kinds it can run.
	for _, k := range cfg.Faults {
		if why := cfg.notApplicable(k); why != "" {
			r.report.FaultsNotApplicable[k] = why
			r.logf("fault %s not applicable: %s", k, why)
		}
	}
	if cfg.Replay != "" {
		r.logf("replay: %s", cfg.Replay)
	}
	var err error
	if r.workDir, err = os.MkdirTemp("", "outbox-chaos-"); err != nil {
		return nil, fmt.Errorf("create work directory: %w", err)
	}
	r.report.WorkDir = r.workDir
	defer r.cleanup()
	if err := r.setup(ctx); err != nil {
		return &r.report, err
	}
	if err := r.run(ctx); err != nil {
		return &r.report, err
	}
	return &r.report, nil
}

func (r *runner) setup(ctx context.Context) error {
	bin := r.cfg.RelayBin
	var buildErr error
	var wg sync.WaitGroup
	if bin == "" {
		bin = filepath.Join(r.workDir, "outbox-relay")
		wg.Add(1)
		go func() { defer wg.Done(); buildErr = testenv.BuildRelay(bin, r.cfg.Race) }()
	}
	var pgErr, nsErr error
	wg.Add(2)
	go func() {
		defer wg.Done()
		conf := map[string]string{
			"wal_sender_timeout": fmt.Sprintf("%dms", r.cfg.WalSenderTimeout.Milliseconds()),
		}
		if r.failover() {
			// The standby reconnects within half a second of a primary
			// restart instead of 5 s, for which --standby-slot would hold
			// delivery back.
			conf["wal_retrieve_retry_interval"] = "500ms"
		}
		r.pg, pgErr = testenv.StartPostgres(testenv.PostgresOptions{Version: r.cfg.PGVersion, Conf: conf, ClockOffset: r.cfg.PGClockOffset})
		if pgErr == nil && r.failover() {
			// Before anything else: making it restarts the primary.
			r.standby, pgErr = r.pg.StartStandby(testenv.StandbyOptions{Slot: standbySlot})
		}
	}()
	go func() {
		defer wg.Done()
		if r.cfg.Cluster > 0 {
			// no_advertise: the relay reaches the nodes through its proxies
			// only, never by the addresses the servers would tell it.
			r.cl, nsErr = testenv.StartNATSCluster(r.cfg.Cluster, testenv.NATSOptions{SyncAlways: true, NoAdvertise: true})
			return
		}
		r.ns, nsErr = testenv.StartNATS(testenv.NATSOptions{SyncAlways: true})
	}()
	wg.Wait()
	if err := errors.Join(buildErr, pgErr, nsErr); err != nil {
		return err
	}
	for _, n := range r.natsNodes() {
		r.logf("nats-server %s on %d (log %s)", n.ServerName(), n.Port(), n.LogPath())
	}
	r.logf("postgres %d on %d (log %s), relay %s", r.pg.Version(), r.pg.Port(), r.pg.LogPath(), bin)
	if r.standby != nil {
		r.logf("standby on %d (log %s) streams from physical slot %s", r.standby.Port(), r.standby.LogPath(), standbySlot)
	}

	conn, err := pgx.Connect(ctx, r.pg.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect to postgres: %w", err)
	}
	_, err = conn.Exec(ctx, "CREATE DATABASE "+dbName)
	conn.Close(context.Background())
	if err != nil {
		return fmt.Errorf("create database: %w", err)
	}
	r.setDB(r.pg.URL(dbName))
	env := testenv.RelayEnv()
	if out, err := exec.CommandContext(ctx, bin, "migrate", "--database-url", r.db(), "--publication", publication).CombinedOutput(); err != nil {
		return fmt.Errorf("outbox-relay migrate: %w\n%s", err, out)
	}
	// The witness exists before the relay's slot and the first row, so it
	// sees every committed row.
	if err := r.withDB(ctx, func(c *pgx.Conn) error {
		_, err := c.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, witnessSlot)
		return err
	}); err != nil {
		return fmt.Errorf("create witness slot: %w", err)
	}
	if r.nc, err = nats.Connect(r.natsURLs(), nats.MaxReconnects(-1), nats.ReconnectWait(200*time.Millisecond)); err != nil {
		return fmt.Errorf("connect to nats: %w", err)
	}
	if r.js, err = jetstream.New(r.nc); err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	for i, name := range []string{"a", "b"} {
		// One proxy per PostgreSQL server, in the order of the relay's
		// multi-host URL, so a fault cuts its path to whichever is primary.
		var pgp proxyGroup
		var pgHosts []string
		for _, s := range r.pgServers() {
			p, err := NewProxy(fmt.Sprintf("127.0.0.1:%d", s.Port()))
			if err != nil {
				pgp.Close()
				return err
			}
			pgp = append(pgp, p)
			pgHosts = append(pgHosts, fmt.Sprintf("127.0.0.1:%d", p.Port()))
		}
		dbArg := fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable", pgHosts[0], dbName)
		if r.failover() {
			dbArg = multiHostURL(pgHosts)
		}
		var nsp proxyGroup
		var natsURLs []string
		for _, n := range r.natsNodes() {
			p, err := NewProxy(fmt.Sprintf("127.0.0.1:%d", n.Port()))
			if err != nil {
				pgp.Close()
				nsp.Close()
				return err
			}
			nsp = append(nsp, p)
			natsURLs = append(natsURLs, fmt.Sprintf("nats://127.0.0.1:%d", p.Port()))
		}
		app := "chaos-relay-" + name
		r.relays[i] = &relayInst{
			name: name, appName: app, pgProxy: pgp, nsProxy: nsp, bin: bin, env: env,
			logPath: filepath.Join(r.workDir, "relay-"+name+".log"),
			args: []string{
				"--database-url", dbArg,
				"--nats-url", strings.Join(natsURLs, ","),
				"--slot", slotName, "--publication", publication,
				"--stream", streamName, "--subject-prefix", subjPrefix,
				"--application-name", app, "--worker-id", app,
				// Status updates well under wal_sender_timeout/2, as the
				// operations guide asks.
				"--status-interval", "500ms", "--ack-timeout", "5s",
				"--log-format", "json", "--on-publish", r.cfg.onPublish(),
				"--duplicate-window", r.cfg.DuplicateWindow.String(),
				// The shortest lease the ack timeout allows: a claim a
				// killed relay held is reclaimed within a fault's hold, and
				// past the duplicate window, so that only the poller's
				// lookup (G18) keeps its rows from being stored twice.
				"--lease", pollerLease.String(),
				// The checker must see every stored copy of a row with a
				// deadline, and a message past its deadline most of all;
				// with Nats-TTL the stream would remove them at the
				// deadline (G21, tested in the relay's own tests), at most
				// a second after a late one was stored.
				"--deadline-ttl=false",
			},
			onEvent: func(s string) { r.logf("%s", s) },
		}
		if r.cfg.Cluster > 0 {
			r.relays[i].args = append(r.relays[i].args, "--stream-replicas", strconv.Itoa(r.cfg.Cluster))
		}
		if r.failover() {
			r.relays[i].args = append(r.relays[i].args, "--standby-slot", standbySlot)
		}
	}
	return nil
}

func (r *runner) cleanup() {
	for _, ri := range r.relays {
		if ri != nil {
			_ = ri.kill()
			ri.pgProxy.Close()
			ri.nsProxy.Close()
		}
	}
	if r.nc != nil {
		r.nc.Close()
	}
	failed := len(r.report.Failures()) > 0
	if failed || r.cfg.Keep {
		// testenv removes its directories on Close; the server logs explain
		// a failure, so keep copies beside the relay logs.
		for _, s := range r.allPG() {
			name := filepath.Base(s.LogPath())
			if len(r.allPG()) > 1 {
				name = fmt.Sprintf("postgres-%d.log", s.Port())
			}
			if b, err := os.ReadFile(s.LogPath()); err == nil {
				_ = os.WriteFile(filepath.Join(r.workDir, name), b, 0o644)
			}
		}
		for _, n := range r.natsNodes() {
			name := filepath.Base(n.LogPath())
			if n.ServerName() != "" {
				name = n.ServerName() + "-" + name
			}
			if b, err := os.ReadFile(n.LogPath()); err == nil {
				_ = os.WriteFile(filepath.Join(r.workDir, name), b, 0o644)
			}
		}
	}
	// A standby before its primary (devenv's order); the killed primaries
	// last, they are stopped already.
	for _, s := range r.allPG() {
		s.Close()
	}
	if r.ns != nil {
		r.ns.Close()
	}
	if r.cl != nil {
		r.cl.Close()
	}
	if !failed && !r.cfg.Keep {
		_ = os.RemoveAll(r.workDir)
		r.report.WorkDir = ""
	}
}

func (r *runner) db() string {
	r.dbMu.Lock()
	defer r.dbMu.Unlock()
	return r.dbURL
}

func (r *runner) setDB(u string) {
	r.dbMu.Lock()
	r.dbURL = u
	r.dbMu.Unlock()
}

// withDB runs fn on a fresh connection straight to PostgreSQL (not through
// a proxy), retrying for up to a minute while the server restarts.
func (r *runner) withDB(ctx context.Context, fn func(*pgx.Conn) error) error {
	deadline := time.Now().Add(time.Minute)
	for {
		err := func() error {
			cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			c, err := pgx.Connect(cctx, r.db())
			if err != nil {
				return err
			}
			defer c.Close(context.Background())
			return fn(c)
		}()
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(200 * time.Millisecond)
	}
}

type slotInfo struct {
	exists    bool
	pid       int32 // 0: not active
	app       string
	confirmed pglogrepl.LSN
}

func (r *runner) readSlot(ctx context.Context) (slotInfo, error) {
	var s slotInfo
	err := r.withDB(ctx, func(c *pgx.Conn) error {
		var pid *int32
		var app, confirmed *string
		err := c.QueryRow(ctx, `SELECT s.active_pid, a.application_name, s.confirmed_flush_lsn::text
			FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
			WHERE s.slot_name = $1`, slotName).Scan(&pid, &app, &confirmed)
		if errors.Is(err, pgx.ErrNoRows) {
			s = slotInfo{}
			return nil
		}
		if err != nil {
			return err
		}
		s = slotInfo{exists: true}
		if pid != nil {
			s.pid = *pid
		}
		if app != nil {
			s.app = *app
		}
		if confirmed != nil {
			if s.confirmed, err = pglogrepl.ParseLSN(*confirmed); err != nil {
				return err
			}
		}
		return nil
	})
	return s, err
}

// catchUpWitness consumes the witness slot up to the current WAL position.
func (r *runner) catchUpWitness(ctx context.Context) error {
	r.witnessMu.Lock()
	defer r.witnessMu.Unlock()
	const batch = 20000
	for {
		n := 0
		err := r.withDB(ctx, func(c *pgx.Conn) error {
			n = 0
			rows, err := c.Query(ctx, `SELECT lsn::text, xid::text, data FROM pg_logical_slot_get_changes($1, NULL, $2, 'include-xids', '1', 'skip-empty-xacts', '1')`, witnessSlot, batch)
			if err != nil {
				return err
			}
			defer rows.Close()
			var got []WitnessRow
			for rows.Next() {
				var lsnText, xidText, data string
				if err := rows.Scan(&lsnText, &xidText, &data); err != nil {
					return err
				}
				n++
				lsn, err := pglogrepl.ParseLSN(lsnText)
				if err != nil {
					return fmt.Errorf("witness lsn %q: %w", lsnText, err)
				}
				xid, err := strconv.ParseUint(xidText, 10, 32)
				if err != nil {
					return fmt.Errorf("witness xid %q: %w", xidText, err)
				}
				got = append(got, r.witness.Feed(lsn, uint32(xid), data)...)
			}
			if err := rows.Err(); err != nil {
				return err
			}
			r.ledger.AddWitness(got)
			return nil
		})
		if err != nil {
			return fmt.Errorf("read witness slot: %w", err)
		}
		if n < batch {
			return nil
		}
	}
}

// streamLastSeq is the stream's last sequence (0 before the relay created it).
func (r *runner) streamLastSeq(ctx context.Context) (uint64, error) {
	deadline := time.Now().Add(time.Minute)
	for {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s, err := r.js.Stream(cctx, streamName)
		var info *jetstream.StreamInfo
		if err == nil {
			info, err = s.Info(cctx)
		}
		cancel()
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return 0, nil
		}
		if err == nil {
			return info.State.LastSeq, nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return 0, fmt.Errorf("stream %s info: %w", streamName, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// catchUpStream reads the stream's messages (headers only) into the ledger
// until it holds every sequence up to upto.
func (r *runner) catchUpStream(ctx context.Context, upto uint64) error {
	r.streamMu.Lock()
	defer r.streamMu.Unlock()
	deadline := time.Now().Add(5 * time.Minute)
	for r.ledger.LastSeq() < upto {
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("read stream up to seq %d: at %d: %w", upto, r.ledger.LastSeq(), errors.Join(ctx.Err(), errors.New("deadline")))
		}
		err := func() error {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			cons, err := r.js.OrderedConsumer(cctx, streamName, jetstream.OrderedConsumerConfig{
				DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
				OptStartSeq:   r.ledger.LastSeq() + 1,
				HeadersOnly:   true,
			})
			if err != nil {
				return err
			}
			for r.ledger.LastSeq() < upto {
				want := int(min(upto-r.ledger.LastSeq(), 2000))
				batch, err := cons.Fetch(want, jetstream.FetchMaxWait(5*time.Second))
				if err != nil {
					return err
				}
				got := 0
				for m := range batch.Messages() {
					md, err := m.Metadata()
					if err != nil {
						return err
					}
					h := m.Headers()
					from := md.Timestamp.UTC().Format("15:04:05.000")
					if lsn := h.Get(wire.HeaderCommitLSN); lsn != "" {
						from += " lsn " + lsn
					}
					if gen := h.Get(wire.HeaderClaimGeneration); gen != "" {
						from += " claim " + gen
					}
					var expires time.Time
					if v := h.Get(wire.HeaderExpiresAt); v != "" {
						if expires, err = time.Parse(time.RFC3339Nano, v); err != nil {
							return fmt.Errorf("seq %d: %s %q: %w", md.Sequence.Stream, wire.HeaderExpiresAt, v, err)
						}
					}
					r.ledger.Add(Msg{ID: h.Get(jetstream.MsgIDHeader), Seq: md.Sequence.Stream, From: from, Stored: md.Timestamp, ExpiresAt: expires})
					got++
				}
				if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
					return err
				}
				if got == 0 {
					return fmt.Errorf("no messages after seq %d", r.ledger.LastSeq())
				}
			}
			return nil
		}()
		if err != nil {
			r.logf("reading the stream: %v (retrying)", err)
			time.Sleep(500 * time.Millisecond)
		}
	}
	return nil
}

// g3Check reads the relay's slot and checks G3 against it. killedPid is the
// walsender of a relay just killed: its exit can still apply a status update
// the relay sent before dying, so the slot is read once it is gone.
func (r *runner) g3Check(ctx context.Context, label string, killedPid int32) error {
	if killedPid != 0 {
		deadline := time.Now().Add(time.Minute)
		for {
			s, err := r.readSlot(ctx)
			if err != nil {
				return err
			}
			if s.pid != killedPid {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("%s: walsender %d still holds the slot a minute after its relay was killed", label, killedPid)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	// Order matters: the confirmation first, then what was settled.
	s, err := r.readSlot(ctx)
	if err != nil {
		return err
	}
	unsettled := map[string]string{}
	if err := r.withDB(ctx, func(c *pgx.Conn) error {
		clear(unsettled)
		// Under none a published row stays 'ready': whether it is in the
		// stream is G3's question, whether the watermark claims it only
		// when it is, CheckCovered's.
		q := `SELECT work_id, state FROM outbox WHERE state <> 'published'`
		if r.cfg.onPublish() == "none" {
			q += ` AND state <> 'ready'`
		}
		rows, err := c.Query(ctx, q)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id, st string
			if err := rows.Scan(&id, &st); err != nil {
				return err
			}
			unsettled[id] = st
		}
		return rows.Err()
	}); err != nil {
		return fmt.Errorf("%s: read unsettled rows: %w", label, err)
	}
	var claimed []string
	if r.cfg.onPublish() == "none" {
		if err := r.withDB(ctx, func(c *pgx.Conn) error {
			rows, err := c.Query(ctx, `SELECT o.work_id FROM outbox o WHERE o.state = 'ready' AND `+coveredSQL)
			if err != nil {
				return err
			}
			claimed, err = pgx.CollectRows(rows, pgx.RowTo[string])
			return err
		}); err != nil {
			return fmt.Errorf("%s: read the rows the watermark covers: %w", label, err)
		}
	}
	last, err := r.streamLastSeq(ctx)
	if err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	if err := r.catchUpWitness(ctx); err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	if err := r.catchUpStream(ctx, last); err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	covered, bad := r.ledger.CheckG3(label, s.confirmed, last, unsettled)
	if r.cfg.onPublish() == "none" {
		bad = append(bad, r.ledger.CheckCovered(label, claimed, last)...)
	}
	r.logf("G3 check %s: confirmed_flush_lsn %s, stream last seq %d, %d rows newly covered, %d unsettled rows, %d rows the watermark covers, %d violations", label, s.confirmed, last, covered, len(unsettled), len(claimed), len(bad))
	for i, v := range bad {
		if i == 5 {
			break
		}
		r.logf("  G3 VIOLATION %s", v)
	}
	return nil
}

// sample records the slot's lag and keeps the witness read, so that it
// neither holds WAL nor grows one huge read at the end.
func (r *runner) sample(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	n := 0
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n++
		var lag *int64
		cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		if c, err := pgx.Connect(cctx, r.db()); err == nil {
			if c.QueryRow(cctx, `SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&lag) == nil && lag != nil {
				for {
					cur := r.maxLag.Load()
					if *lag <= cur || r.maxLag.CompareAndSwap(cur, *lag) {
						break
					}
				}
			}
			c.Close(context.Background())
		}
		cancel()
		if n%5 == 0 {
			wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			_ = r.catchUpWitness(wctx)
			cancel()
		}
		for _, ri := range r.relays {
			ri.supervise()
		}
	}
}

func (r *runner) run(ctx context.Context) error {
	a := r.relays[r.primary]
	if err := a.start(); err != nil {
		return err
	}
	// Producers start once the slot exists: rows committed before it are
	// the snapshot hand-off's business (G9), not this run's.
	deadline := time.Now().Add(2 * time.Minute)
	for {
		s, err := r.readSlot(ctx)
		if err != nil {
			return err
		}
		if s.exists && s.pid != 0 {
			break
		}
		if time.Now().After(deadline) || !a.running() {
			return fmt.Errorf("the relay did not start streaming slot %s within 2 minutes (log %s)", slotName, a.logPath)
		}
		time.Sleep(50 * time.Millisecond)
	}
	r.logf("relay %s streams the slot; load starts: %d producers, %d rows/s", a.name, r.cfg.Producers, r.cfg.Rate)
	c, err := r.measureClocks(ctx)
	if err != nil {
		return fmt.Errorf("measure the clocks of PostgreSQL and the broker: %w", err)
	}
	r.clocks = c
	r.logf("clocks: %s", c)
	if r.cfg.PGClockOffset != 0 {
		if d := c.DBMinusHost - r.cfg.PGClockOffset; d > time.Second || d < -time.Second {
			return fmt.Errorf("PostgreSQL's clock is %v from this host's, not the %v asked for (-pg-clock-offset): is libfaketime preloaded?", c.DBMinusHost.Round(time.Millisecond), r.cfg.PGClockOffset)
		}
	}

	sctx, stopSampler := context.WithCancel(ctx)
	var swg sync.WaitGroup
	swg.Add(1)
	go func() { defer swg.Done(); r.sample(sctx) }()
	if r.cl != nil {
		swg.Add(1)
		go func() { defer swg.Done(); r.watchLeader(sctx) }()
	}
	defer func() { stopSampler(); swg.Wait() }()

	pctx, stopLoad := context.WithCancel(ctx)
	load := newLoad(r.cfg, r.loadURL())
	r.load = load
	var pwg sync.WaitGroup
	for p := range r.cfg.Producers {
		pwg.Add(1)
		go func() { defer pwg.Done(); load.produce(pctx, p) }()
	}
	loadStart := time.Now()

	var applicable []string
	for _, k := range r.cfg.Faults {
		if _, na := r.report.FaultsNotApplicable[k]; !na {
			applicable = append(applicable, k)
		}
	}
	schedule := Schedule(r.cfg.Seed, applicable, 100000)
	// The first round (every applicable kind once) always runs to its end,
	// however long it takes on a loaded machine: -duration only adds rounds.
	// A duration-bound first round left kinds uninjected on a slow CI run.
	more := func(n int) bool {
		return (n < len(applicable) || time.Since(loadStart) < r.cfg.Duration) && ctx.Err() == nil && !load.exhausted()
	}
	var faultErr error
	n := 0
	for ; more(n); n++ {
		r.pause(ctx, r.between(r.cfg.MinGap, r.cfg.MaxGap))
		if !more(n) {
			break
		}
		kind := schedule[n]
		if err := r.inject(ctx, kind, n+1); err != nil {
			faultErr = fmt.Errorf("fault #%d %s: %w", n+1, kind, err)
			r.logf("%v", faultErr)
			break
		}
	}
	if faultErr == nil {
		faultErr = r.catchUpFaults(ctx, load, n)
	}
	stopLoad()
	pwg.Wait()
	r.report.LoadSeconds = time.Since(loadStart).Seconds()
	r.logf("load stopped: %d rows committed in %d txns, %d rolled back, %d commits with unknown outcome",
		load.committedRows.Load(), load.committedTxns.Load(), load.rolledRows.Load(), load.unknown.Load())

	drainErr := r.drain(ctx)
	r.finish(ctx, load)
	return errors.Join(faultErr, drainErr)
}

// catchUpFaults injects, after the scheduled ones, every enabled kind that
// has not bitten yet (the schedule did not reach it, it was skipped, or it
// hit nothing), under the same load, up to three times each and for at
// most a minute or half the duration. The report fails a run in which a
// kind still has not bitten; this gives a short run its chance to cover
// every kind without letting it pass uncovered.
func (r *runner) catchUpFaults(ctx context.Context, load *load, n int) error {
	limit := max(time.Minute, r.cfg.Duration/2)
	start := time.Now()
	tries := map[string]int{}
	for ctx.Err() == nil && !load.exhausted() && time.Since(start) < limit {
		// The kind with the fewest catch-up turns goes next (one never
		// injected before one that missed), so a kind that keeps missing
		// does not spend the others' time.
		kind := ""
		r.mu.Lock()
		for _, k := range r.cfg.Faults {
			if _, na := r.report.FaultsNotApplicable[k]; na || r.report.FaultsBit[k] > 0 || tries[k] >= 3 {
				continue
			}
			if kind == "" || tries[k] < tries[kind] || tries[k] == tries[kind] && r.report.Faults[k] < r.report.Faults[kind] {
				kind = k
			}
		}
		r.mu.Unlock()
		if kind == "" {
			return nil
		}
		if len(tries) == 0 {
			r.logf("catching up after %d scheduled faults: kinds that have not bitten yet get up to 3 more turns", n)
		}
		tries[kind]++
		n++
		r.pause(ctx, r.between(r.cfg.MinGap, r.cfg.MaxGap))
		// Most kinds bite only a relay that streams the slot; after the
		// previous fault it may still be in its reconnect back-off.
		if err := r.waitStreaming(ctx, 30*time.Second); err != nil {
			return err
		}
		if err := r.inject(ctx, kind, n); err != nil {
			err = fmt.Errorf("fault #%d %s: %w", n, kind, err)
			r.logf("%v", err)
			return err
		}
	}
	return nil
}

// waitStreaming waits up to timeout for a relay to stream the slot; past
// it the fault is injected anyway (and may not bite).
func (r *runner) waitStreaming(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		s, err := r.readSlot(ctx)
		if err != nil || s.pid != 0 {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
	return nil
}

func (r *runner) between(lo, hi time.Duration) time.Duration {
	if hi <= lo {
		return lo
	}
	return lo + time.Duration(r.rng.Int64N(int64(hi-lo)))
}

func (r *runner) pause(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// heal undoes every fault: proxies back to pass, servers up, the primary
// relay running and the other one stopped.
func (r *runner) heal(ctx context.Context) error {
	for _, ri := range r.relays {
		ri.pgProxy.Set(Pass, 0)
		ri.nsProxy.Set(Pass, 0)
	}
	var errs []error
	if err := r.startNATS(ctx); err != nil {
		errs = append(errs, err)
	}
	if err := r.pg.Start(); err != nil && !strings.Contains(err.Error(), "already running") {
		errs = append(errs, err)
	}
	if err := r.relays[r.primary].start(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (r *runner) drain(ctx context.Context) error {
	if err := r.heal(ctx); err != nil {
		return fmt.Errorf("heal before the drain: %w", err)
	}
	if err := r.relays[1-r.primary].stop(15 * time.Second); err != nil {
		r.logf("%v", err)
	}
	start := time.Now()
	var left int64
	for {
		err := r.withDB(ctx, func(c *pgx.Conn) error {
			// An expired row is settled too: its deadline passed before it
			// could be published (G13).
			q := `SELECT count(*) FROM outbox o WHERE o.state NOT IN ('published', 'expired')`
			if r.cfg.onPublish() == "none" {
				q += ` AND NOT (o.state = 'ready' AND ` + coveredSQL + `)`
			}
			return c.QueryRow(ctx, q).Scan(&left)
		})
		if err == nil && left == 0 {
			break
		}
		if time.Since(start) > r.cfg.DrainTimeout || ctx.Err() != nil {
			r.logf("drain: %d rows still not published after %v", left, r.cfg.DrainTimeout)
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	r.report.NotPublished = int(left)
	r.report.DrainSeconds = time.Since(start).Seconds()
	r.logf("drain: %d rows not published after %.1fs", left, r.report.DrainSeconds)
	return nil
}

func (r *runner) finish(ctx context.Context, load *load) {
	if err := r.g3Check(ctx, "final", 0); err != nil {
		r.logf("final G3 check: %v", err)
	}
	if err := r.catchUpWitness(ctx); err != nil {
		r.logf("final witness read: %v", err)
	}
	if last, err := r.streamLastSeq(ctx); err != nil {
		r.logf("final stream read: %v", err)
	} else if err := r.catchUpStream(ctx, last); err != nil {
		r.logf("final stream read: %v", err)
	}
	var expired []string
	if err := r.withDB(ctx, func(c *pgx.Conn) error {
		rows, err := c.Query(ctx, `SELECT work_id FROM outbox WHERE state = 'expired'`)
		if err != nil {
			return err
		}
		expired, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	}); err != nil {
		r.logf("read the expired rows: %v", err)
	}
	r.ledger.SetExpired(expired)
	if c, err := r.measureClocks(ctx); err != nil {
		r.logf("measure the clocks at the end: %v (the first reading stands)", err)
	} else {
		r.logf("clocks at the end: %s", c)
		r.mu.Lock()
		if c.Uncertainty < r.clocks.Uncertainty || r.clocks.Uncertainty == 0 {
			r.clocks = c
		}
		r.mu.Unlock()
	}
	r.mu.Lock()
	r.ledger.SetClocks(r.clocks)
	r.ledger.SetWindows(r.windows)
	r.report.Clocks = r.clocks
	r.report.Windows = r.windows
	r.mu.Unlock()
	r.report.Figures = r.ledger.Figures(load.ackedIDs())
	r.report.CommittedTxns = load.committedTxns.Load()
	r.report.RolledBackRows = load.rolledRows.Load()
	r.report.RolledBackTxns = load.rolledTxns.Load()
	r.report.UnknownCommits = load.unknown.Load()
	r.report.MaxSlotLagBytes = r.maxLag.Load()
	r.report.Takeovers = r.takeover
	r.report.Failovers = r.failovers
	for _, f := range r.failovers {
		if !f.OK {
			r.report.FailoverFailures++
		}
	}
	for _, t := range r.takeover {
		if !t.OK {
			r.report.TakeoverFailures++
		}
	}
	for _, ri := range r.relays {
		ri.mu.Lock()
		r.report.RelayStarts += ri.starts
		r.report.RelayExits += ri.exits
		ri.mu.Unlock()
		for _, l := range scanLog(ri.logPath) {
			r.report.RelayPanics++
			addSample(&r.report.RelayPanicSample, l)
		}
	}
	sort.Slice(r.report.Takeovers, func(i, j int) bool { return r.report.Takeovers[i].Cause < r.report.Takeovers[j].Cause })
}
