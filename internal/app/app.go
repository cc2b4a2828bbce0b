// Package app wires the relay's parts into the running daemon: PostgreSQL
// pool, NATS connection, stream, CDC path, HTTP endpoints. cmd/outbox-relay
// parses flags into Options and calls Run; the demo and the end-to-end tests
// call it the same way.
package app

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"
	"golang.org/x/sync/errgroup"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/dbclock"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/procs"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/standby"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// The --ordering modes (G12).
const (
	OrderingNone      = "none"
	OrderingAggregate = "aggregate"
)

// DefaultStatsInterval paces the table-wide metrics (one scan of the table).
const DefaultStatsInterval = 30 * time.Second

// Options is everything `outbox-relay run` can be told.
type Options struct {
	DatabaseURL string
	// ReplicationURL, when set, is where the replication session
	// connects: the same database as DatabaseURL, directly, where
	// DatabaseURL is a pooler that cannot carry a replication connection.
	ReplicationURL string
	// DBPassword, when set, gives every new connection its password
	// (--database-password-file, --database-password-command).
	DBPassword DBPassword
	// Pooler says what --database-url reaches: PostgreSQL, or a pooler in
	// transaction mode (DB.Pooler).
	Pooler        string
	NATSURL       string // comma-separated server URLs
	Table         store.Table
	Slot          string
	Publication   string
	Stream        string
	SubjectPrefix string
	// Format is how rows become messages (--message-format); its
	// SubjectPrefix is SubjectPrefix's.
	Format wire.Format
	// AllowStreams are streams besides Stream that a row's subject column
	// may name (run --allow-stream); every other subject is refused.
	AllowStreams []string
	// Ordering is "none" or "aggregate" (G12); DeadlineMargin is how close
	// to its deadline a row may still be published (G13).
	Ordering       string
	DeadlineMargin time.Duration
	// StandbySlots are the physical slots of the standbys that may be
	// promoted; nothing is published before they flushed it (G14).
	// FailoverSlot creates the slot as a failover slot on PostgreSQL 17+.
	StandbySlots []string
	FailoverSlot bool
	Policy       store.Policy

	DuplicateWindow time.Duration
	StreamReplicas  int
	NoCreateStream  bool // --create-stream=false: the stream must exist
	AckTimeout      time.Duration
	MaxInFlight     int
	Linger          time.Duration // 0: relay.DefaultLinger; <0: none
	// AdaptiveProcs runs the process on one P while the relay is quiet
	// and on GOMAXPROCS's default once it is busy (internal/procs). A
	// process setting: run sets it, tests with several relays in one
	// process do not.
	AdaptiveProcs    bool
	MaxInFlightBytes int
	MaxBufferedBytes int // every decoded row the CDC path holds, in bytes (relay.Config.MaxBufferedBytes); 0: the default
	StatusInterval   time.Duration
	DrainTimeout     time.Duration
	HTTPAddr         string
	AppName          string
	// StatsInterval paces the table-wide metrics (rows by state, oldest
	// eligible age); 0 turns them off.
	StatsInterval time.Duration
	// HTTP bounds the --http-addr server; zero fields take the Default*
	// values of http.go.
	HTTP HTTPLimits
	// Console serves the operator console under /ui/ on HTTPAddr when
	// Console.Enabled (run --console).
	Console console.Options

	// The fallback poller (zero values take the defaults of `run`).
	WorkerID     string
	Lease        time.Duration
	MaxAttempts  int
	BackoffMin   time.Duration
	BackoffMax   time.Duration
	PollInterval time.Duration
	PollBatch    int
	PollPipeline int // claimed batches in flight; 0: poller.DefaultPipeline
	// RejectRetry (the delay before the poller retries a row the broker
	// rejected on the CDC path) and SweepInterval (the poller's deadline
	// sweep) have no flags: the demo shortens them to show a dead letter
	// and an expiry in seconds. 0: the relay's and the poller's defaults.
	RejectRetry   time.Duration
	SweepInterval time.Duration
	// RestartCheck paces the relay's check of the slot's restart position
	// (relay.DefaultRestartCheck when 0); no flag, tests shorten it.
	RestartCheck time.Duration

	NATS NATSAuth

	// DeadlineTTL publishes a row with a deadline with Nats-TTL where its
	// stream allows per-message TTL, and creates the stream allowing it
	// (run --deadline-ttl, G21).
	DeadlineTTL bool
	// NATSMonitorURL is nats-server's monitoring endpoint (run
	// --nats-monitor-url), where the broker contract check reads the
	// server's sync setting; "" leaves it unknown.
	NATSMonitorURL string
	// ReadBackLimit bounds a session start's read-back of the stream (run
	// --readback-limit, G18): 0 the default, negative off.
	ReadBackLimit int
	// LostCheckInterval is how often the stream is checked for messages
	// the broker lost (run --lost-check-interval, G19): 0 the default,
	// negative only at session starts.
	LostCheckInterval time.Duration
	// AtomicTransactions publishes each transaction's rows as one atomic
	// batch (run --atomic-transactions, G20) and creates the stream
	// allowing atomic publish; AtomicBatchMax is the most rows of one
	// batch (run --atomic-batch-max; 0: relay.DefaultAtomicBatchMax).
	AtomicTransactions bool
	AtomicBatchMax     int

	// Listening, when set, receives the HTTP server's address once it listens.
	Listening func(addr string)
	// Started, when set, receives the relay once it is built (tests read its role).
	Started func(r *relay.Relay)
	// CDCSink, when set, wraps the CDC path's sink (tests make the broker
	// fail in ways a real one does only by chance).
	CDCSink func(*natssink.Sink) sinks.Sink
	// SessionBackoff, when set, is the CDC path's wait between failed
	// sessions, fixed (tests: the relay's default grows from 200 ms to 30 s).
	SessionBackoff time.Duration
}

func (o *Options) natsOptions(log zerolog.Logger) ([]nats.Option, error) {
	name := o.NATS.Name
	if name == "" {
		name = "outbox-relay"
	}
	// Every handler scrubs: nats.go's own redaction hides passwords but not
	// a token in the user position, and its errors may quote the URL.
	scrub := NewNATSScrubber(o.NATSURL, o.NATS)
	opts := []nats.Option{
		nats.Name(name),
		// The handshake waits for the server's INFO and PONG: a broker
		// answering 1.3 s late took 2.6 s, past nats.go's 2 s default, and
		// the relay could not start (the chaos run's broker-slow).
		nats.Timeout(10 * time.Second),
		nats.MaxReconnects(-1),
		// No buffering while disconnected: a publish then fails at once
		// and the session restarts from the slot. A buffered one would go
		// out whenever the connection returns, possibly after its row's
		// deadline (G13); the republish is deduplicated anyway.
		nats.ReconnectBufSize(-1),
		// A broker back is found within about a third of a second: the
		// session waiting to restart starts at the reconnect (issue 42,
		// item 4). An attempt against a broker still down is one refused
		// TCP connect.
		nats.ReconnectWait(250 * time.Millisecond),
		nats.ReconnectJitter(100*time.Millisecond, time.Second),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err == nil {
				// Our own Drain or Close at shutdown: nothing went wrong.
				log.Debug().Msg("NATS connection closed")
				return
			}
			log.Warn().Err(scrub.Err(err)).Msg("disconnected from NATS")
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info().Str("server", scrub.Scrub(RedactNATSURLs(nc.ConnectedUrl()))).Msg("reconnected to NATS")
		}),
		// Without a handler nats.go prints asynchronous errors to stderr
		// as they are, outside the log and its redaction.
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			ev := log.Warn().Err(scrub.Err(err))
			if sub != nil {
				ev = ev.Str("subject", sub.Subject)
			}
			ev.Msg("NATS error")
		}),
	}
	auth, err := o.NATS.Options()
	if err != nil {
		return nil, err
	}
	opts = append(opts, auth...)
	return opts, nil
}

// Validate rejects invalid combinations before anything connects.
func (o *Options) Validate() error {
	if o.NATSURL == "" {
		return errors.New("--nats-url is empty: give the broker's URL, e.g. nats://127.0.0.1:4222")
	}
	// Names first: PostgreSQL and the broker refuse bad ones only once the
	// relay has connected and started its loops, which then retry forever.
	if err := replication.ValidateName("slot", o.Slot); err != nil {
		return err
	}
	if err := replication.ValidateName("publication", o.Publication); err != nil {
		return err
	}
	if err := ValidateStream(o.Stream); err != nil {
		return err
	}
	for _, s := range o.StandbySlots {
		if err := replication.ValidateName("standby-slot", s); err != nil {
			return err
		}
	}
	for _, s := range o.AllowStreams {
		if err := validateStreamName("--allow-stream", s); err != nil {
			return err
		}
	}
	// Before the general subject rules, so a reserved prefix hears why.
	if err := checkReservedPrefix(o.SubjectPrefix); err != nil {
		return err
	}
	if !strings.HasSuffix(o.SubjectPrefix, ".") || natssink.ValidateSubject(strings.TrimSuffix(o.SubjectPrefix, ".")) != nil {
		return fmt.Errorf("--subject-prefix %q: want dot-separated tokens ending in '.', e.g. outbox.", o.SubjectPrefix)
	}
	if err := o.DB().Validate(); err != nil {
		return err
	}
	if o.DB().Pooled() && o.ReplicationURL == "" {
		return errors.New("--database-pooler transaction: a replication session cannot go through a transaction pooler (nor through PgBouncer before 1.23 at all): give --replication-database-url, the same database directly, for the slot")
	}
	if o.ReplicationURL != "" {
		if _, err := pgconn.ParseConfig(o.ReplicationURL); err != nil {
			return fmt.Errorf("parse --replication-database-url: %w", redactErr(err, o.ReplicationURL))
		}
	}
	if err := o.NATS.Validate(); err != nil {
		return err
	}
	if o.Console.Enabled {
		// Before anything connects: a console that may not serve must not
		// wait for a database first.
		if err := console.CheckToken(o.Console.Token); err != nil {
			return err
		}
		if err := console.CheckAddr(o.HTTPAddr, o.Console.Token); o.HTTPAddr != "" && err != nil {
			return fmt.Errorf("--console on --http-addr %s: %w", o.HTTPAddr, err)
		}
	}
	if o.StatusInterval < 0 || o.DrainTimeout < 0 || o.StatsInterval < 0 {
		return fmt.Errorf("--status-interval %s, --drain-timeout %s, --stats-interval %s: may not be negative", o.StatusInterval, o.DrainTimeout, o.StatsInterval)
	}
	switch o.Ordering {
	case "", OrderingNone, OrderingAggregate:
	default:
		return fmt.Errorf("--ordering %q: want none (publish as committed) or aggregate (keep each aggregate's sequence order, G12)", o.Ordering)
	}
	if o.DeadlineMargin < 0 {
		return fmt.Errorf("--deadline-margin %s: may not be negative", o.DeadlineMargin)
	}
	if o.AtomicTransactions && o.Ordering == OrderingAggregate {
		return errors.New("--atomic-transactions with --ordering aggregate: not supported together: order per aggregate publishes a row only after its aggregate's previous row was acknowledged, which would cut a transaction with two rows of one aggregate into pieces; choose one (docs/guarantees.md, G20)")
	}
	if o.AtomicBatchMax != 0 && (o.AtomicBatchMax < 2 || o.AtomicBatchMax > 100_000) {
		return fmt.Errorf("--atomic-batch-max %d: want 2 to 100000, and at most the server's max_batch_size (1000 unless raised)", o.AtomicBatchMax)
	}
	if o.AckTimeout <= 0 {
		return fmt.Errorf("--ack-timeout %s: must be positive (without it a publish can wait forever across a broker loss)", o.AckTimeout)
	}
	if o.DuplicateWindow < time.Second {
		return fmt.Errorf("--duplicate-window %s: must be at least 1s", o.DuplicateWindow)
	}
	if o.MaxInFlight < 1 {
		return fmt.Errorf("--max-in-flight %d: must be at least 1", o.MaxInFlight)
	}
	if pc := o.pollerConfig(nil); o.Lease < 0 || pc.Lease <= o.AckTimeout {
		return fmt.Errorf("--lease %s: must be longer than --ack-timeout %s, or a claim expires while its publish is still waiting for the ack", pc.Lease, o.AckTimeout)
	}
	if o.MaxAttempts < 0 || o.PollBatch < 0 || o.PollInterval < 0 || o.PollPipeline < 0 {
		return fmt.Errorf("--max-attempts %d, --poll-batch %d, --poll-interval %s, --poll-pipeline %d: may not be negative", o.MaxAttempts, o.PollBatch, o.PollInterval, o.PollPipeline)
	}
	if o.BackoffMin < 0 || o.BackoffMax < 0 || (o.BackoffMax > 0 && o.BackoffMin > o.BackoffMax) {
		return fmt.Errorf("--backoff-min %s, --backoff-max %s: want 0 <= min <= max", o.BackoffMin, o.BackoffMax)
	}
	return nil
}

// pollerConfig fills the poller's knobs, with the defaults of `run` for
// those left zero.
func (o *Options) pollerConfig(connected func() bool) poller.Config {
	c := poller.Config{
		WorkerID: o.WorkerID, Lease: o.Lease, MaxAttempts: o.MaxAttempts,
		BackoffMin: o.BackoffMin, BackoffMax: o.BackoffMax, PollInterval: o.PollInterval, Batch: o.PollBatch, Pipeline: o.PollPipeline,
		SubjectPrefix: o.SubjectPrefix, Format: o.Format, Connected: connected,
		Ordered: o.Ordering == OrderingAggregate, DeadlineMargin: o.DeadlineMargin,
		SweepInterval: o.SweepInterval,
	}
	// --readback-limit bounds the uncertain rows' stream lookup too (G18),
	// capped at the poller's default: it runs on a batch's time, within
	// its lease. 0 (off) turns the lookup off as it does the read-back.
	switch {
	case o.ReadBackLimit < 0:
		c.LookupLimit = -1
	case o.ReadBackLimit > 0:
		c.LookupLimit = min(o.ReadBackLimit, poller.DefaultLookupLimit)
	}
	if c.WorkerID == "" {
		c.WorkerID = DefaultWorkerID()
	}
	return c.WithDefaults()
}

func (o *Options) wrapCDCSink(s *natssink.Sink) sinks.Sink {
	if o.CDCSink != nil {
		return o.CDCSink(s)
	}
	return s
}

// sinkOptions says where the sinks may publish: the relay's stream and the
// streams --allow-stream names.
func (o *Options) sinkOptions() natssink.Options {
	return natssink.Options{Stream: o.Stream, SubjectPrefix: o.SubjectPrefix, AllowStreams: o.AllowStreams, AckTimeout: o.AckTimeout,
		DeadlineTTL: o.DeadlineTTL}
}

// DefaultWorkerID is hostname-pid: unique per process on a host.
func DefaultWorkerID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "unknown"
	}
	return fmt.Sprintf("%s-%d", h, os.Getpid())
}

// Connect opens the PostgreSQL pool and the NATS connection, failing fast
// with messages that name the server (never the password).
func Connect(ctx context.Context, o *Options, log zerolog.Logger) (*pgxpool.Pool, *nats.Conn, error) {
	pcfg, err := o.DB().poolConfig(o.AppName)
	if err != nil {
		return nil, nil, err
	}
	pcfg.MaxConns = 8
	target := fmt.Sprintf("%s:%d/%s", pcfg.ConnConfig.Host, pcfg.ConnConfig.Port, pcfg.ConnConfig.Database)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, nil, fmt.Errorf("connect to PostgreSQL at %s: %w", target, err)
	}
	pctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("connect to PostgreSQL at %s: %w", target, err)
	}
	nopts, err := o.natsOptions(log)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	nc, err := nats.Connect(o.NATSURL, nopts...)
	if err != nil {
		pool.Close()
		return nil, nil, fmt.Errorf("connect to NATS at %s: %w", RedactNATSURLs(o.NATSURL), NewNATSScrubber(o.NATSURL, o.NATS).Err(err))
	}
	return pool, nc, nil
}

// replicationURL is where the replication session connects.
func (o *Options) replicationURL() string {
	if o.ReplicationURL != "" {
		return o.ReplicationURL
	}
	return o.DatabaseURL
}

// dbClockInterval is how often the database's clock is measured again.
const dbClockInterval = 30 * time.Second

// startDBClock measures the database's clock once before anything decides
// a deadline, then keeps measuring it until ctx ends. A first measurement
// that fails leaves the relay's own clock in use until one succeeds.
func startDBClock(ctx context.Context, pool *pgxpool.Pool, log zerolog.Logger) *dbclock.Clock {
	clock := &dbclock.Clock{}
	probe := func(ctx context.Context) (time.Time, error) {
		var t time.Time
		err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t)
		return t, err
	}
	mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	if err := clock.Measure(mctx, probe); err != nil {
		log.Warn().Err(err).Msg("could not measure PostgreSQL's clock at start: deadlines are decided on the relay's clock until a measurement succeeds")
	}
	cancel()
	go clock.Keep(ctx, probe, dbClockInterval, log.With().Str("component", "clock").Logger())
	return clock
}

// Run runs the daemon until ctx is cancelled.
func Run(ctx context.Context, o Options, log zerolog.Logger) error {
	// Whatever ends the run is printed by the caller: no NATS secret may
	// ride along on it, from whichever part it came.
	return NewNATSScrubber(o.NATSURL, o.NATS).Err(run(ctx, o, log))
}

func run(ctx context.Context, o Options, log zerolog.Logger) error {
	if err := o.Validate(); err != nil {
		return err
	}
	pool, nc, err := Connect(ctx, &o, log)
	if err != nil {
		return err
	}
	if o.ReplicationURL != "" {
		log.Info().Str("statements", dbTarget(o.DatabaseURL)).Str("replication", dbTarget(o.ReplicationURL)).
			Msg("PostgreSQL: statements through --database-url, the slot's replication session through --replication-database-url")
	}
	defer pool.Close()
	defer drainNATS(nc, 5*time.Second)
	obs, err := o.DB().ObserverPool(ctx, o.AppName)
	if err != nil {
		return err
	}
	defer obs.Close()

	m := metrics.New()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("open JetStream: %w", err)
	}
	streamCfg := natssink.StreamConfig{Name: o.Stream, SubjectPrefix: o.SubjectPrefix, DuplicateWindow: o.DuplicateWindow,
		Replicas: o.StreamReplicas, NoCreate: o.NoCreateStream, MsgTTL: o.DeadlineTTL, AtomicPublish: o.AtomicTransactions}
	// Each sink has its own pending publishes: the two paths never wait
	// behind each other's acks.
	pollOpts, cdcOpts := o.sinkOptions(), o.sinkOptions()
	pollOpts.Pending, cdcOpts.Pending = max(o.PollBatch, 1)*(o.PollPipeline+1), o.MaxInFlight
	// Deadlines are the database's (G13): the CDC path decides on its
	// clock, and Nats-TTL counts from it. For the TTL the clock reads early
	// by its uncertainty: the broker removes a message after its deadline,
	// never before.
	clock := startDBClock(ctx, pool, log)
	ttlClock := func() time.Time { return clock.Now().Add(-clock.Uncertainty()) }
	pollOpts.Clock, cdcOpts.Clock = ttlClock, ttlClock
	pollSink, cdcSink := natssink.New(js, pollOpts), natssink.New(js, cdcOpts)
	contract := newContractCheck(o, nc, log, m)
	ensureStream := func(ctx context.Context) error {
		sctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		info, created, err := natssink.EnsureStream(sctx, js, streamCfg)
		if err != nil {
			return err
		}
		if created {
			log.Info().Str("stream", o.Stream).Str("subjects", o.SubjectPrefix+">").Dur("duplicate_window", info.Config.Duplicates).
				Bool("allow_msg_ttl", info.Config.AllowMsgTTL).Bool("allow_atomic", info.Config.AllowAtomicPublish).Msg("created stream")
		}
		pollSink.Observe(info)
		cdcSink.Observe(info)
		if err := contract.check(sctx, info); err != nil {
			return err
		}
		if o.ReadBackLimit >= 0 {
			// Found at start, not after the first crash: a consumer limit
			// or a missing permission stops every read of the stream.
			return cdcSink.CheckReads(sctx)
		}
		return nil
	}
	// One store for both paths: they meet in the table and the sink only.
	st := store.New(pool, o.Table, o.Policy)
	gate := standby.New(pool, o.StandbySlots, log, m)
	if err := reportFailover(ctx, pool, o, log); err != nil {
		return err
	}
	// The poller waits while the broker is unreachable, and while the CDC
	// path found this instance's settings differ from the table's (r is
	// set before the poller runs).
	var r *relay.Relay
	pc := o.pollerConfig(func() bool { return nc.IsConnected() && r.SettingsRefused() == nil })
	pc.DeadlineNow = func() time.Time { return clock.Now().Add(clock.Uncertainty()) }
	if gate != nil {
		pc.Standby = gate
		pc.WALPosition = func(ctx context.Context) (replication.LSN, error) { return replication.CurrentFlushLSN(ctx, pool) }
	}
	p := poller.New(pc, st, pollSink, log, m)

	settings := store.Settings{Ordering: o.Ordering, OnPublish: o.Policy}
	r = relay.New(relay.Config{
		DatabaseURL:         o.replicationURL(),
		SeparateReplication: o.ReplicationURL != "",
		Password:            o.DBPassword.Func(),
		Table:               o.Table,
		Slot:                o.Slot,
		Publication:         o.Publication,
		SubjectPrefix:       o.SubjectPrefix,
		Format:              o.Format,
		AppName:             o.AppName,
		DuplicateWindow:     o.DuplicateWindow,
		MaxInFlight:         o.MaxInFlight,
		Linger:              o.Linger,
		MaxInFlightBytes:    o.MaxInFlightBytes,
		MaxBufferedBytes:    o.MaxBufferedBytes,
		StatusInterval:      o.StatusInterval,
		DrainTimeout:        o.DrainTimeout,
		BeforeSession:       ensureStream,
		Ordered:             o.Ordering == OrderingAggregate,
		DeadlineMargin:      o.DeadlineMargin,
		RejectRetry:         o.RejectRetry,
		RestartCheck:        o.RestartCheck,
		Standby:             gate,
		FailoverSlot:        o.FailoverSlot,
		HandedOver:          p.Wake,
		Settings:            &settings,
		SettingsBy:          "run --worker-id " + pc.WorkerID,
		ReadBackLimit:       o.ReadBackLimit,
		LostCheckInterval:   o.LostCheckInterval,

		AtomicTransactions: o.AtomicTransactions,
		AtomicBatchMax:     o.AtomicBatchMax,
		DeadlineClock:      clock,
		BackoffMin:         o.SessionBackoff,
		BackoffMax:         o.SessionBackoff,
	}, pool, st, o.wrapCDCSink(cdcSink), log, m)
	// A broker that comes back may have lost what it acknowledged (G19):
	// check at once rather than at the next --lost-check-interval.
	reconnected := nc.Opts.ReconnectedCB
	nc.SetReconnectHandler(func(c *nats.Conn) {
		if reconnected != nil {
			reconnected(c)
		}
		r.BrokerReconnected()
	})
	if o.Started != nil {
		o.Started(r)
	}

	// Before the poller claims a row: an instance whose --ordering or
	// --on-publish differs from the table's must not publish anything
	// (Preflight checks them last, so a missing table or privilege is
	// named as such; every session start checks them again).
	if err := r.Preflight(ctx); err != nil {
		return err
	}
	// A stream set up wrong fails the start; a broker that is only
	// unreachable is retried by every session. After the database's
	// checks: a refusal that does not need the broker (wal_level, the
	// table, a privilege) leaves nothing behind on it, not a new stream.
	if err := ensureStream(ctx); errors.Is(err, natssink.ErrStreamConfig) {
		return err
	}

	g, gctx := errgroup.WithContext(ctx)
	if o.HTTPAddr != "" {
		srv, ln, err := listenHTTP(o.HTTPAddr, o.HTTP, m, r, pool, obs, nc, &o)
		if err != nil {
			return err
		}
		if o.Listening != nil {
			o.Listening(ln.Addr().String())
		}
		g.Go(func() error {
			if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("serve http on %s: %w", o.HTTPAddr, err)
			}
			return nil
		})
		g.Go(func() error {
			<-gctx.Done()
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			return srv.Shutdown(sctx)
		})
	}
	g.Go(func() error {
		for tick := 0; ; tick++ {
			select {
			case <-gctx.Done():
				return nil
			case <-time.After(time.Second):
			}
			m.SlotLagSeconds.Set(r.LagSeconds(time.Now()))
			if r.Role() == relay.RoleActive {
				st := r.Stats()
				end, conf := st.ServerWALEnd.Load(), st.Confirmed.Load()
				m.ServerWALEnd.Set(float64(end))
				m.SlotLagBytes.Set(float64(end - min(conf, end)))
				continue
			}
			// Not streaming (waiting for the slot, or the broker or database is
			// down): the stream's figures are stale; ask the catalog,
			// which knows the WAL the slot holds whoever owns it.
			if tick%10 == 0 {
				qctx, cancel := context.WithTimeout(gctx, 5*time.Second)
				lag, found, err := replication.SlotLag(qctx, pool, o.Slot)
				cancel()
				if err == nil && found {
					m.SlotLagBytes.Set(float64(lag))
				}
			}
		}
	})
	layout, err := st.Layout(ctx)
	if err != nil {
		return err
	}
	if layout.Partitioned() {
		// Keeps the partitions producers will insert into created ahead
		// (store.PartitionKeeper); migrate made the first ones.
		kl := log.With().Str("component", "partitions").Logger()
		g.Go(func() error {
			st.PartitionKeeper(gctx, store.PartitionKeeperInterval, func(made store.PartitionsMade, err error) {
				switch {
				case err != nil:
					m.DefaultPartitionRows.Set(-1)
					kl.Warn().Err(err).Msg("could not create partitions ahead; retrying in a minute (producers insert into partitions made earlier, then into the DEFAULT partition)")
					return
				case made.DefaultRows > 0:
					kl.Warn().Int64("default_rows", made.DefaultRows).Msgf("the DEFAULT partition of %s holds rows that found no partition of their own; prune never drops them (docs/partitions.md, \"Partition sizing\")", o.Table.Qualified())
				}
				m.DefaultPartitionRows.Set(float64(made.DefaultRows))
				if len(made.Created) > 0 {
					kl.Info().Strs("created", made.Created).Msg("created partitions ahead")
				}
			})
			return nil
		})
	}
	if o.StatsInterval > 0 {
		g.Go(func() error {
			tableStats(gctx, store.New(obs, o.Table, o.Policy), m, o.StatsInterval, log)
			return nil
		})
	}
	m.GoMaxProcs.Set(float64(runtime.GOMAXPROCS(0)))
	if o.AdaptiveProcs && procs.Enabled() {
		g.Go(func() error {
			procs.Run(gctx, func(n int) {
				m.GoMaxProcs.Set(float64(n))
				log.Debug().Int("gomaxprocs", n).Msg("adaptive procs: the relay's Go code runs on this many threads now")
			})
			return nil
		})
	}
	g.Go(func() error { return p.Run(gctx) })
	g.Go(func() error {
		err := r.Run(gctx)
		if err != nil {
			return err
		}
		// The CDC path returned because ctx ended; stop the rest too.
		return context.Canceled
	})
	err = g.Wait()
	if errors.Is(err, context.Canceled) && ctx.Err() != nil {
		return nil
	}
	return err
}

// reportFailover says at start what a promotion will do to the slot and to
// delivery (G14), so an operator learns it before the first failover.
func reportFailover(ctx context.Context, pool *pgxpool.Pool, o Options, log zerolog.Logger) error {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	fs, err := replication.ReadFailoverSupport(qctx, pool)
	if err != nil {
		return err
	}
	l := log.With().Str("component", "failover").Int("server_version_num", fs.Version).Logger()
	switch {
	case !fs.Supported:
		l.Info().Msg("PostgreSQL before 17 has no failover slots: after a promotion the relay creates a new slot and hands the rows it cannot stream to the poller (lossless, not in commit order)")
	case !o.FailoverSlot:
		l.Info().Msg("--failover-slot=false: the slot will not survive a promotion")
	default:
		l.Info().Msg("the slot is a failover slot: standbys with sync_replication_slots = on keep a copy that survives a promotion")
	}
	if len(o.StandbySlots) == 0 {
		return nil
	}
	listed := map[string]bool{}
	for _, s := range strings.Split(fs.SynchronizedStandbySlots, ",") {
		listed[strings.TrimSpace(s)] = true
	}
	all := fs.Supported && o.FailoverSlot
	for _, s := range o.StandbySlots {
		all = all && listed[s]
	}
	if all {
		l.Info().Strs("standby_slots", o.StandbySlots).Msg("synchronized_standby_slots lists every --standby-slot: the server itself withholds WAL from the failover slot until they flushed it; the relay's own wait then costs nothing")
	}
	return nil
}

// drainNATS drains nc and waits for it to close: Drain itself returns at
// once, and a process that exits then drops what was still buffered.
func drainNATS(nc *nats.Conn, timeout time.Duration) {
	closed := make(chan struct{})
	nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	if nc.IsClosed() || nc.Drain() != nil {
		nc.Close()
		return
	}
	select {
	case <-closed:
	case <-time.After(timeout):
		nc.Close()
	}
}

// tableStats refreshes the table-wide gauges every interval, first at once.
// A failure is logged once per streak, not per interval.
func tableStats(ctx context.Context, st *store.Store, m *metrics.Metrics, every time.Duration, log zerolog.Logger) {
	failing := false
	for {
		qctx, cancel := context.WithTimeout(ctx, max(every, 5*time.Second))
		c, err := st.Counts(qctx)
		cancel()
		switch {
		case ctx.Err() != nil:
			return
		case err != nil:
			if !failing {
				log.Warn().Str("component", "stats").Err(err).Msg("could not read table metrics; retrying every interval")
			}
			failing = true
		default:
			failing = false
			for state, n := range c.ByState {
				if n < 0 {
					continue // published on a large table not yet analyzed: no estimate
				}
				m.RowsByState.WithLabelValues(state).Set(float64(n))
			}
			m.OldestEligible.Set(c.OldestEligibleSeconds)
			m.BlockedAggregates.Set(float64(c.BlockedAggregates))
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(every):
		}
	}
}
