// Package relay is the CDC path: it streams committed outbox INSERTs from the
// replication slot, publishes them through a sink, settles each row (marks it
// published, or hands it to the poller) and confirms the slot only past the
// contiguous prefix of settled transactions (G3). Any failure it cannot
// settle row by row (broker outage, database loss) ends the session; the next
// session resumes from the slot and the broker drops the repeats by
// Nats-Msg-Id, so nothing is skipped and nothing is confirmed early.
package relay

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/repeats"
	"github.com/outbox-relay/outbox-relay/internal/retry"
	"github.com/outbox-relay/outbox-relay/internal/standby"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/replication"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// Config is the CDC path's configuration.
type Config struct {
	DatabaseURL string // for the replication connection; the pool is passed in
	// SeparateReplication: DatabaseURL came from --replication-database-url,
	// not the pool's URL; each session checks it reaches the pool's
	// database.
	SeparateReplication bool
	// Password, when set, gives each replication connection its password
	// as it opens (a rotated secret: app.DBPassword).
	Password      replication.PasswordFunc
	Table         store.Table
	Slot          string
	Publication   string
	SubjectPrefix string
	// Format is how a row becomes its message (run --message-format); its
	// SubjectPrefix is SubjectPrefix's.
	Format  wire.Format
	AppName string

	// DuplicateWindow is the stream's duplicate window as configured, used
	// until the sink has read the stream's own (staleAfter).
	DuplicateWindow time.Duration

	MaxInFlight      int // messages published and not yet acked
	MaxInFlightBytes int // their bytes: bounds the memory unacked messages hold (the NATS connection buffers nothing while disconnected, app sets ReconnectBufSize(-1))
	// MaxBufferedBytes bounds every decoded row the session holds, in
	// bytes (replication.Row.Size): in the stream's batch and channel, in
	// the loop, parked behind its aggregate, held by the standby gate and
	// in flight to the broker, until its ack (G15). When it is spent the
	// stream stops reading WAL. Rows acked and waiting for their mark hold
	// no payload (handleResult drops it) and are bounded by MaxUnsettled.
	MaxBufferedBytes int
	SettleBatch      int           // rows per settle statement
	SettleDelay      time.Duration // how long a partial batch waits for more rows before it is settled
	MaxUnsettled     int           // rows acked (or handed off) and not yet settled before reading WAL pauses
	StatusInterval   time.Duration // standby status updates
	Linger           time.Duration // how long a transaction waits for the next ones (replication.StreamConfig.Linger); <0: not at all
	DrainTimeout     time.Duration // how long shutdown waits for in-flight acks
	RejectRetry      time.Duration // delay before the poller retries a row the broker rejected
	BackoffMin       time.Duration // reconnect backoff after a failed session
	BackoffMax       time.Duration
	WaitingRetry     time.Duration // START_REPLICATION retry of a waiting instance (another instance holds the slot)

	// Ordered keeps the order of work per aggregate (run --ordering
	// aggregate, G12); HeldRefresh paces the reads that release held
	// aggregates.
	Ordered     bool
	HeldRefresh time.Duration
	// HandedOver, when set, is called after a settle committed held rows
	// (due at once) for the poller, e.g. to wake a poller in this process
	// instead of leaving them to its next poll.
	HandedOver func()
	// DeadlineMargin: a row closer than this to its deadline is handed to
	// the poller, which decides on the database clock (G13).
	DeadlineMargin time.Duration
	// DeadlineClock is the database's clock as measured (G13: deadlines
	// are the database's); nil: this process's.
	DeadlineClock DeadlineClock
	// Standby holds delivery back until the named standbys flushed each
	// transaction's commit (run --standby-slot, G14); nil: no standbys.
	Standby *standby.Gate
	// FailoverSlot creates the slot as a failover slot where the server
	// supports it (PostgreSQL 17+, run --failover-slot).
	FailoverSlot bool

	// AtomicTransactions publishes each transaction's rows as one atomic
	// batch (run --atomic-transactions, G20; atomic.go); the sink must be
	// a sinks.Batcher. AtomicBatchMax is the most rows of one batch (the
	// server's max_batch_size).
	AtomicTransactions bool
	AtomicBatchMax     int

	// RestartCheck is how often a streaming relay checks whether the
	// slot's restart_lsn lags its confirmed position (restart.go).
	RestartCheck time.Duration

	// WatermarkEvery paces the watermark of --on-publish none (G17,
	// watermark.go); the store's policy decides whether there is one.
	WatermarkEvery time.Duration

	// ReadBackLimit bounds the messages a session reads back from the
	// stream before replaying (readback.go, G18): 0 takes
	// DefaultReadBackLimit, a negative value turns the read-back off.
	ReadBackLimit int
	// LostCheckInterval is how often the stream's state is compared with
	// the sequences the relay recorded, beside every session start (G19,
	// lost.go); DefaultLostCheckInterval when zero, never when negative.
	LostCheckInterval time.Duration

	// BeforeSession runs before each session, e.g. to create the stream when
	// missing. An error fails the session (and is retried with backoff).
	BeforeSession func(ctx context.Context) error

	// Settings, when set, are this instance's --ordering and --on-publish:
	// Preflight and every session start compare them with those recorded
	// for the table (store.CheckSettings), recording them as SettingsBy
	// when none are.
	Settings   *store.Settings
	SettingsBy string
}

// Defaults of the CDC path, used by `run`'s flags and by setDefaults.
const (
	DefaultMaxInFlight      = 1024
	DefaultMaxInFlightBytes = 4 << 20
	// DefaultMaxBufferedBytes keeps the relay's heap, which Go's collector
	// lets grow to about twice what is live, well inside 128 MB
	// (docs/benchmarks-scale.md, bigtx).
	DefaultMaxBufferedBytes = 32 << 20
	DefaultStatusInterval   = 2 * time.Second
	DefaultDrainTimeout     = 10 * time.Second
	// DefaultLinger groups transactions that arrive less than this apart:
	// at one row per transaction it cuts the relay's wake-ups and system
	// calls per message, for at most this much added latency
	// (docs/benchmarks-second-round.md).
	DefaultLinger = 2 * time.Millisecond

	// DefaultAtomicBatchMax is nats-server's default max_batch_size.
	DefaultAtomicBatchMax = 1000

	DefaultSettleBatch  = 1000
	DefaultSettleDelay  = 5 * time.Millisecond
	DefaultRejectRetry  = 5 * time.Second
	DefaultBackoffMin   = 200 * time.Millisecond // reconnect backoff, not the poller's retry backoff
	DefaultBackoffMax   = 30 * time.Second
	DefaultWaitingRetry = time.Second
	DefaultHeldRefresh  = time.Second
	// DefaultDeadlineMargin is the poller's: both paths hold a row back
	// from the same distance to its deadline (G13).
	DefaultDeadlineMargin = store.DefaultDeadlineMargin
)

func (c *Config) setDefaults() {
	c.Format.SubjectPrefix = c.SubjectPrefix
	if c.LostCheckInterval == 0 {
		c.LostCheckInterval = DefaultLostCheckInterval
	}
	if c.ReadBackLimit == 0 {
		c.ReadBackLimit = DefaultReadBackLimit
	}
	def := func(d *time.Duration, v time.Duration) {
		if *d <= 0 {
			*d = v
		}
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = DefaultMaxInFlight
	}
	if c.MaxInFlightBytes <= 0 {
		c.MaxInFlightBytes = DefaultMaxInFlightBytes
	}
	if c.MaxBufferedBytes <= 0 {
		c.MaxBufferedBytes = DefaultMaxBufferedBytes
	}
	if c.SettleBatch <= 0 {
		c.SettleBatch = DefaultSettleBatch
	}
	if c.MaxUnsettled <= 0 {
		c.MaxUnsettled = 4 * max(c.SettleBatch, c.MaxInFlight)
	}
	def(&c.SettleDelay, DefaultSettleDelay)
	def(&c.StatusInterval, DefaultStatusInterval)
	if c.Linger == 0 {
		c.Linger = DefaultLinger
	}
	def(&c.DrainTimeout, DefaultDrainTimeout)
	def(&c.RejectRetry, DefaultRejectRetry)
	def(&c.BackoffMin, DefaultBackoffMin)
	def(&c.BackoffMax, DefaultBackoffMax)
	def(&c.WaitingRetry, DefaultWaitingRetry)
	def(&c.HeldRefresh, DefaultHeldRefresh)
	def(&c.DeadlineMargin, DefaultDeadlineMargin)
	def(&c.RestartCheck, DefaultRestartCheck)
	def(&c.WatermarkEvery, DefaultWatermarkEvery)
	if c.AtomicBatchMax <= 0 {
		c.AtomicBatchMax = DefaultAtomicBatchMax
	}
}

// Role is what the CDC path is doing, for /readyz and status.
type Role int32

const (
	RoleStarting Role = iota
	RoleActive
	// RoleWaiting: another instance streams the slot and this one waits to
	// take over (a waiting instance, docs/design.md's glossary). Its name in
	// /readyz, the outbox_relay_role metric and the logs stays "standby",
	// which operators and alerts already use.
	RoleWaiting
	RoleReconnecting
)

// String is the role's name in /readyz and the metrics: a contract, kept
// whatever the constant is called.
func (r Role) String() string {
	return [...]string{"starting", "active", "standby", "reconnecting"}[r]
}

// Relay runs the CDC path.
type Relay struct {
	cfg     Config
	pool    *pgxpool.Pool
	store   *store.Store
	sink    sinks.Sink
	log     zerolog.Logger
	metrics *metrics.Metrics
	stats   replication.Stats
	role    atomic.Int32
	// acked is the highest stream sequence this process saw acknowledged,
	// by stream: under none and delete, the only record to tell a stream
	// that came back shorter (G19, lost.go).
	acked ackedSeqs
	// lostNow asks the session's lost check to run at once (a reconnect).
	lostNow chan struct{}
	// reconnected says the next lost check follows a reconnect;
	// lastMessageRead is when a check last read a message back (unix ns).
	reconnected     atomic.Bool
	lastMessageRead atomic.Int64
	// started is when this relay was made: the republish command its lost
	// check names under none reads the rows created since about then.
	started time.Time
	// repeats summarises duplicate acks in the log (a replay can bring
	// thousands).
	repeats *repeats.Log
	// oldestOpen is the commit time (unix nanos) of the oldest transaction
	// streamed and not yet confirmed, 0 when none: kept across sessions, so
	// the lag keeps growing through an outage.
	oldestOpen atomic.Int64
	// gatePeak is the most events the CDC gate (--standby-slot) held at
	// once, for tests of its bound (G15).
	gatePeak atomic.Int64
	// budget is the session's byte budget (nil between sessions) and
	// bufferedPeak the most bytes any earlier session held, for tests of
	// the bound (G15).
	budget       atomic.Pointer[replication.Budget]
	bufferedPeak atomic.Int64
	// preflighted: Preflight passed (the daemon runs it before it starts
	// the poller); Run does not repeat it. checked: the next session may
	// skip the checks, which Preflight has just run.
	preflighted, checked atomic.Bool
	// unrecognised counts the rows' unrecognised publish failures across
	// sessions (refusal.go); the session goroutine's own.
	unrecognised unrecognised
	// slotCreated: the last ensureSlot created the slot (the session
	// goroutine's own; nothing it replays was ever published).
	slotCreated bool
	// settingsRefused holds the error of the last session start that found
	// this instance's settings differ from the table's, nil since one that
	// found them equal (SettingsRefused).
	settingsRefused atomic.Pointer[error]
	// snapshotNoteLogged: the relay said once why it cannot use
	// pg_log_standby_snapshot() (restart.go).
	snapshotNoteLogged atomic.Bool

	// sleep waits between sessions; tests replace it.
	sleep func(ctx context.Context, d time.Duration) error
	// wake ends a wait between sessions early: the broker is back.
	wake chan struct{}
}

// New returns a relay. st holds the table's statements (and the on-publish
// policy); the pool is for catalog checks; the replication connection is
// opened per session from cfg.DatabaseURL.
func New(cfg Config, pool *pgxpool.Pool, st *store.Store, sink sinks.Sink, log zerolog.Logger, m *metrics.Metrics) *Relay {
	cfg.setDefaults()
	r := &Relay{
		cfg: cfg, pool: pool, sink: sink, metrics: m, lostNow: make(chan struct{}, 1), started: time.Now(),
		store: st,
		log:   log.With().Str("component", "cdc").Str("slot", cfg.Slot).Logger(),
		wake:  make(chan struct{}, 1),
	}
	r.sleep = r.waitToRestart
	r.repeats = repeats.New(r.log, store.DuplicateLog, 0)
	r.setRole(RoleStarting)
	return r
}

// Role reports what the CDC path is doing now.
func (r *Relay) Role() Role { return Role(r.role.Load()) }

// LagSeconds is how long ago the oldest transaction the relay has streamed
// but not yet confirmed committed; 0 when it has confirmed all it streamed.
func (r *Relay) LagSeconds(now time.Time) float64 {
	t := r.oldestOpen.Load()
	if t == 0 {
		return 0
	}
	return max(0, now.Sub(time.Unix(0, t)).Seconds())
}

// Stats exposes the stream's positions.
func (r *Relay) Stats() *replication.Stats { return &r.stats }

func (r *Relay) setRole(role Role) {
	r.role.Store(int32(role))
	if role == RoleActive {
		r.metrics.SlotOwner.Set(1)
	} else {
		r.metrics.SlotOwner.Set(0)
	}
	if role == RoleWaiting {
		// Another instance streams the slot now: the lag of what this
		// one streamed before is no longer the slot's.
		r.oldestOpen.Store(0)
	}
	for _, x := range []Role{RoleStarting, RoleActive, RoleWaiting, RoleReconnecting} {
		v := 0.0
		if x == role {
			v = 1
		}
		r.metrics.Role.WithLabelValues(x.String()).Set(v)
	}
}

// Preflight checks what no retry can fix, so a misconfiguration fails at
// start with a message that says what to do: names, wal_level, privileges,
// the table.
func (r *Relay) Preflight(ctx context.Context) error {
	if err := replication.ValidateName("slot", r.cfg.Slot); err != nil {
		return err
	}
	if err := replication.ValidateName("publication", r.cfg.Publication); err != nil {
		return err
	}
	if err := r.pool.Ping(ctx); err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	if err := replication.CheckServer(ctx, r.pool); err != nil {
		return err
	}
	enc, err := replication.ServerEncoding(ctx, r.pool)
	if err != nil {
		return err
	}
	if enc == "SQL_ASCII" {
		r.log.Warn().Str("server_encoding", enc).
			Msg("the database's encoding is SQL_ASCII: PostgreSQL stores any bytes in text and jsonb, so producers can write payloads and header values that are not UTF-8; the relay refuses each such row (rejected: invalid_payload or invalid_header, then failed), and publishes the rest. " +
				"To have PostgreSQL refuse them at insert, move the table to a database created with ENCODING 'UTF8' (pg_dump, then restore into it)")
	}
	pub, err := r.checkDatabase(ctx, true)
	if err != nil {
		return err
	}
	if !pub.Filtered {
		r.log.Info().Str("publication", r.cfg.Publication).
			Msgf("publication %s has no row filter: the slot streams rows inserted in every state and the relay drops all but 'ready' ones; outbox-relay migrate adds WHERE %s (saves the walsender and the relay that work)",
				r.cfg.Publication, replication.ReadyFilter)
	}
	if err := r.reportIgnoredWatermarks(ctx); err != nil {
		return err
	}
	r.preflighted.Store(true)
	r.checked.Store(true)
	return nil
}

// checkDatabase runs the checks of the start that a change in the database
// can undo while the relay runs: the table and its columns, the privileges,
// the publication, the slot's owner, the table's recorded settings.
// Preflight runs them (with the server's, first), and so does every session
// start (after a reconnect, a takeover, a PostgreSQL restart): a session
// that streamed past a changed setting would do what the start refuses.
// first: Preflight's call, which logs a settings record it made.
func (r *Relay) checkDatabase(ctx context.Context, first bool) (replication.Publication, error) {
	if !first {
		if err := replication.CheckServer(ctx, r.pool); err != nil {
			return replication.Publication{}, err
		}
	}
	if err := r.store.Check(ctx); err != nil {
		return replication.Publication{}, err
	}
	if err := r.store.CheckRelayGrants(ctx); err != nil {
		return replication.Publication{}, err
	}
	pub, err := replication.EnsurePublication(ctx, r.pool, r.cfg.Publication, r.cfg.Table.Schema, r.cfg.Table.Name)
	if err != nil {
		return pub, err
	}
	if err := r.checkSlotOwner(ctx); err != nil {
		return pub, err
	}
	if r.cfg.Settings == nil {
		return pub, nil
	}
	rec, recorded, err := r.store.CheckSettings(ctx, *r.cfg.Settings, r.cfg.SettingsBy)
	if errors.Is(err, store.ErrSettingsDiffer) {
		r.settingsRefused.Store(&err)
	} else if err == nil {
		r.settingsRefused.Store(nil)
	}
	if err != nil {
		return pub, err
	}
	if recorded {
		r.log.Info().Str("settings", rec.Flags()).Msgf("recorded the settings of %s: every instance of it must run with %s", r.cfg.Table.Qualified(), rec.Flags())
	}
	return pub, nil
}

// SettingsRefused returns the error of the last check that found this
// instance's --ordering or --on-publish differ from the table's record, or
// nil when the last check found them equal. While it returns an error the
// daemon's poller claims nothing either: an unordered poller beside
// ordered instances publishes a held aggregate's later rows first (G12).
func (r *Relay) SettingsRefused() error {
	if p := r.settingsRefused.Load(); p != nil {
		return *p
	}
	return nil
}

// checkSlotOwner refuses a slot that exists but was not created for this
// table. A slot is one position for one publication's changes: a relay for
// another table streaming it would confirm past rows it never published, and
// they would be lost. The relay records every slot it creates in
// <table>_slots before creating it, so a slot without that record was made
// for another table, or by hand.
func (r *Relay) checkSlotOwner(ctx context.Context) error {
	slot, err := replication.LookupSlot(ctx, r.pool, r.cfg.Slot)
	if err != nil || !slot.Exists {
		return err
	}
	if _, found, err := r.store.SlotState(ctx, r.cfg.Slot); err != nil || found {
		return err
	}
	return fmt.Errorf("slot %s exists but was not created for table %s (it is not recorded in %s): another relay (another --table) may own it, and sharing a slot loses rows. "+
		"Choose another --slot; or, if this slot was created by hand for %s, drop it (SELECT pg_drop_replication_slot('%s')) and let the relay create its own (a failover slot on PostgreSQL 17+, with --failover-slot), "+
		"or keep it and have every ready row handed to the poller at the next start: INSERT INTO %s (slot_name, backfill_pending) VALUES ('%s', true)",
		r.cfg.Slot, r.cfg.Table.Qualified(), r.store.SlotsTable(), r.cfg.Table.Qualified(), r.cfg.Slot, r.store.SlotsTable(), r.cfg.Slot)
}

// reportIgnoredWatermarks says at start which recorded watermarks count for
// nothing here (issue 30): a copy from another cluster covers no row of
// this one, and the rows it seems to cover are handed over and published.
func (r *Relay) reportIgnoredWatermarks(ctx context.Context) error {
	ignored, err := r.store.IgnoredWatermarks(ctx)
	if err != nil {
		return err
	}
	for _, w := range ignored {
		r.log.Warn().Str("watermark_slot", w.Slot).Str("lsn", w.LSN).Str("reason", w.Reason).
			Msg("ignoring the watermark recorded in " + r.store.SlotsTable() + ": it covers no row here; rows it seemed to cover are handed over again at the next backfill")
	}
	return nil
}

// Run streams until ctx is cancelled, then shuts down gracefully: stop
// reading WAL, wait (bounded) for in-flight acks, settle, confirm, close.
// It returns nil after a graceful shutdown and an error only when Preflight
// fails; every later failure is logged and retried with capped backoff.
func (r *Relay) Run(ctx context.Context) error {
	if _, ok := r.sink.(sinks.Batcher); r.cfg.AtomicTransactions && !ok {
		return fmt.Errorf("--atomic-transactions: the sink (%T) cannot publish atomic batches", r.sink)
	}
	if !r.preflighted.Load() {
		if err := r.Preflight(ctx); err != nil {
			return err
		}
	}
	attempt := 0
	for {
		started := time.Now()
		select {
		case <-r.wake: // a reconnect before this session: nothing to wake
		default:
		}
		err := r.session(ctx)
		if ctx.Err() != nil {
			if err != nil && !errors.Is(err, context.Canceled) {
				r.log.Error().Err(err).Msg("replication session ended during shutdown")
			}
			r.setRole(RoleStarting)
			return nil
		}
		var wait time.Duration
		switch {
		case replication.IsSlotActive(err):
			if r.Role() != RoleWaiting {
				r.log.Info().Msg("slot is streamed by another instance; standing by")
			}
			r.setRole(RoleWaiting)
			wait = r.cfg.WaitingRetry
			attempt = 0
		default:
			r.setRole(RoleReconnecting)
			r.metrics.Sessions.WithLabelValues("error").Inc()
			if errors.Is(err, replication.ErrSessionFenced) {
				r.metrics.Sessions.WithLabelValues("fenced").Inc()
			}
			if time.Since(started) > time.Minute {
				attempt = 0
			}
			wait = retry.Equal(attempt, r.cfg.BackoffMin, r.cfg.BackoffMax, nil)
			attempt++
			msg := "replication session ended"
			if errors.Is(err, errSessionCheck) {
				// Not an exit: a crash loop would print the same and fix
				// nothing. The fix can come from the database (the record,
				// the publication, a column), so each attempt checks again.
				msg = "a check at session start failed: not streaming until it passes; fix what the error says, and the relay streams again at its next attempt, without a restart"
			}
			r.log.Error().Err(err).Dur("retry_in", wait).Int("attempt", attempt).Msg(msg)
		}
		if err := r.sleep(ctx, wait); err != nil {
			r.setRole(RoleStarting)
			return nil
		}
	}
}

// waitToRestart waits d between sessions, or less: until the broker's
// connection is back (BrokerReconnected) or PostgreSQL, found unreachable
// during the wait, answers again. A wait that only ran out its backoff
// resumed publishing 4 to 6 s after a broker came back from a 5 s stop
// (the backoff grew while each attempt failed at once); it now resumes
// within a reconnect of its return. A database that was reachable all
// along ends no wait early: the backoff of a session that fails for
// another reason holds.
func (r *Relay) waitToRestart(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	probe := time.NewTicker(pgProbeEvery)
	defer probe.Stop()
	pgDown := false
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			return nil
		case <-r.wake:
			return nil
		case <-probe.C:
			if r.pool == nil {
				continue
			}
			pctx, cancel := context.WithTimeout(ctx, pgProbeEvery)
			err := r.pool.Ping(pctx)
			cancel()
			switch {
			case err != nil:
				pgDown = true
			case pgDown:
				return nil
			}
		}
	}
}

// pgProbeEvery is how often a wait between sessions asks whether
// PostgreSQL answers.
const pgProbeEvery = 250 * time.Millisecond

// DeadlineClock is the database's clock as the relay measures it.
type DeadlineClock interface {
	Now() time.Time
	// Uncertainty is how far Now may be off.
	Uncertainty() time.Duration
	// Offset is the database's clock less this process's, and how far
	// off that figure may be; measured is false before a measurement.
	Offset() (offset, uncertainty time.Duration, measured bool)
}

// dbToBroker is what to add to a time on PostgreSQL's clock to have it on
// the broker's, measured (the database's offset by DeadlineClock, the
// broker's with the stream state's request), and how far off the figure
// may be. ok is false when either clock was not measured: then the relay
// can only assume they agree. Used only where a read of the stream has no
// position to start from and a comparison of the two servers' times is
// all there is (the read-back's fallback by time, the lost-check's
// stream creation time against the rows' published_at).
func (r *Relay) dbToBroker(state sinks.StreamState) (shift, slack time.Duration, ok bool) {
	c := r.cfg.DeadlineClock
	if c == nil || !state.OffsetKnown {
		return 0, 0, false
	}
	dbOff, dbUnc, measured := c.Offset()
	if !measured {
		return 0, 0, false
	}
	return state.BrokerOffset - dbOff, dbUnc + state.OffsetUncertainty, true
}

// dbOffset is the database's clock less this process's, 0 when not
// measured.
func (r *Relay) dbOffset() time.Duration {
	if c := r.cfg.DeadlineClock; c != nil {
		if off, _, ok := c.Offset(); ok {
			return off
		}
	}
	return 0
}

// deadlineNow is the time a deadline is compared with: the database's
// clock, read late by its uncertainty, so that a row near its deadline is
// left to the poller (which decides in SQL) rather than published after it.
func (r *Relay) deadlineNow() time.Time {
	if c := r.cfg.DeadlineClock; c != nil {
		return c.Now().Add(c.Uncertainty())
	}
	return time.Now()
}

// errSessionCheck marks a session that ended in checkDatabase.
var errSessionCheck = errors.New("session start")

// session runs one replication connection from connect to close.
func (r *Relay) session(ctx context.Context) error {
	if !r.checked.Swap(false) {
		if _, err := r.checkDatabase(ctx, false); err != nil {
			return fmt.Errorf("%w: %w", errSessionCheck, err)
		}
	}
	if r.cfg.BeforeSession != nil {
		if err := r.cfg.BeforeSession(ctx); err != nil {
			return err
		}
	}
	conn, err := replication.ConnectWith(ctx, r.cfg.DatabaseURL, r.cfg.AppName, r.cfg.Password)
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()

	if r.cfg.SeparateReplication {
		if err := r.checkSameDatabase(ctx, conn); err != nil {
			return err
		}
	}
	slot, ident, err := r.ensureSlot(ctx, conn)
	if err != nil {
		return err
	}
	budget := replication.NewBudget(int64(r.cfg.MaxBufferedBytes))
	r.budget.Store(budget)
	marks := &posMarks{}
	defer func() {
		r.budget.Store(nil)
		r.metrics.BufferedBytes.Set(0)
		r.bufferedPeak.Store(max(r.bufferedPeak.Load(), budget.Peak()))
	}()
	stream, err := replication.Start(ctx, conn, replication.StreamConfig{
		Slot:           r.cfg.Slot,
		Publication:    r.cfg.Publication,
		Table:          replication.Table{Schema: r.cfg.Table.Schema, Name: r.cfg.Table.Name},
		CreatedAt:      r.cfg.Format.Mode != wire.ModeOutbox,
		StatusInterval: r.cfg.StatusInterval,
		Linger:         max(r.cfg.Linger, 0),
		Budget:         budget,
		// Nothing is confirmed to the slot past what its record allows
		// (issue 30, item 3): the next session tells a slot moved by
		// someone else by a confirmed position past the record.
		// With it, the stream position of pos (position.go, G18).
		// It runs in the replication goroutine before a status update:
		// bounded, so that a slow PostgreSQL or an exhausted pool ends the
		// session instead of holding the status updates until the server
		// drops it (wal_sender_timeout).
		RecordBound: func(ctx context.Context, pos replication.LSN) error {
			at, _ := marks.position(pos)
			ctx, cancel := context.WithTimeout(ctx, recordBoundTimeout)
			defer cancel()
			return r.store.RaiseConfirmBound(ctx, r.cfg.Slot, ident.SlotLSN, store.LSN(pos), at)
		},
		Bound: replication.LSN(ident.ConfirmBound),
		// G18 across instances: WAL that reaches this session after the
		// server may have dropped it is not published (stream.go, fence).
		Slots:      r.pool,
		StaleAfter: r.staleAfter(),
		Logger:     r.log,
	}, slot.ConfirmedFlush, &r.stats)
	if err != nil {
		return err
	}
	if r.Role() != RoleActive {
		r.log.Info().Str("lsn", slot.ConfirmedFlush.String()).Msg("streaming slot")
	}
	r.setRole(RoleActive)
	r.metrics.Sessions.WithLabelValues("started").Inc()

	// The session's goroutines outlive ctx on purpose: a graceful shutdown
	// still needs them to drain acks and send the last confirmation.
	sessCtx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var held map[store.AggregateKey]string
	if r.cfg.Ordered {
		// From the table, not memory: a restart (or another instance's
		// handoffs) must leave nothing unheld that waits at the poller.
		if held, err = r.store.HeldAggregates(ctx); err != nil {
			return err
		}
		if len(held) > 0 {
			r.log.Info().Int("aggregates", len(held)).Msg("aggregates held behind rows with the poller")
		}
	}
	l := newLoop(r, slot.ConfirmedFlush, held, budget)
	l.slotLSN = ident.SlotLSN
	l.newSlot = r.slotCreated
	l.pos.marks = marks
	l.stream = stream
	l.keeper = r.newRestartKeeper(ctx)
	// Before the session publishes: rows whose messages the broker lost
	// go back to the poller (G19), and this session's replay leaves them,
	// and those handed back before and not yet published again, to it: the
	// replay can hold their transactions too, and a row both paths publish
	// is stored twice when the poller's lookup ends before the replay's
	// copy is stored (seed 1796656652090348769: 99 rows). The rows pending
	// are read first: one the poller publishes in between stays its own.
	var pending []string
	if r.store.Policy() == store.PolicyMark {
		// A stop asked for meanwhile is the loop's to carry out (it
		// records the session's position); a failure otherwise ends the
		// session, to be tried again, rather than replay without the set.
		if pending, err = r.store.LostPending(ctx); err != nil && ctx.Err() == nil {
			return err
		}
	}
	l.pollerOwns = ownedBy(pending, r.checkLost(ctx, true))
	events := make(chan []replication.Event, 16)
	confirms := make(chan replication.LSN, 1)
	stop := make(chan struct{})
	streamDone := make(chan error, 1)
	streamExited := make(chan struct{})
	go func() {
		defer close(streamExited)
		streamDone <- stream.Run(sessCtx, events, confirms, stop)
	}()
	err = l.run(ctx, sessCtx, events, confirms, stop, streamDone)
	r.repeats.Flush()
	cancel()
	l.wait()
	// The stream goroutine owns the connection until it returns; only then
	// may the deferred Close touch it.
	<-streamExited
	return err
}

// recordBoundTimeout bounds the write of the confirmation bound (and its
// stream position) before a status update: well inside PostgreSQL's
// default wal_sender_timeout of 60 s.
const recordBoundTimeout = 10 * time.Second

// staleAfter is how old the evidence that this session's walsender holds
// the slot may grow before the stream checks it again: half the stream's
// duplicate window. A session the server dropped (a partition past
// wal_sender_timeout, a terminated walsender, a paused process) can still
// read WAL its walsender sent before: the next instance, streaming the
// slot, has published it already, and past the window the broker would
// store it again. Held to half the window, a late copy stays inside it.
func (r *Relay) staleAfter() time.Duration {
	w := r.cfg.DuplicateWindow
	if ws, ok := r.sink.(sinks.Windowed); ok && ws.DuplicateWindow() > 0 {
		w = ws.DuplicateWindow()
	}
	return w / 2
}

// ensureSlot returns the slot to stream, creating it when missing and
// handing the rows it can never stream to the poller (G9), and the
// relay's record of it. A slot that is not the one the relay created, or
// that someone else moved, is treated as missing (issue 30, item 3).
func (r *Relay) ensureSlot(ctx context.Context, conn replication.PgConn) (replication.SlotInfo, store.SlotState, error) {
	var none store.SlotState
	r.slotCreated = false
	slot, err := replication.LookupSlot(ctx, r.pool, r.cfg.Slot)
	if err != nil {
		return slot, none, err
	}
	if slot.Exists && slot.Plugin != "pgoutput" {
		return slot, none, fmt.Errorf("slot %s uses plugin %q, not pgoutput: drop it (SELECT pg_drop_replication_slot('%s')) or choose another --slot", r.cfg.Slot, slot.Plugin, r.cfg.Slot)
	}
	if slot.Invalidated() {
		// The slot can never stream again. Rows committed since its last
		// confirmation are still 'ready' in the table, so a new slot plus a
		// backfill recovers every one of them.
		ev := r.log.Error()
		why := "it held more WAL than max_slot_wal_keep_size; raise max_slot_wal_keep_size or alert on slot lag to avoid this"
		switch slot.InvalidationReason {
		case "", "wal_removed":
		case "idle_timeout":
			// Expected after the relay was away longer than the server
			// allows: nothing is lost, the backfill hands the rows over.
			ev = r.log.Warn()
			why = "no relay streamed it for longer than idle_replication_slot_timeout; set it to 0, or longer than the relay may be away (a deploy, an outage), to keep the slot and the commit order of its rows"
		default:
			why = "PostgreSQL gives the reason " + slot.InvalidationReason
		}
		ev.Str("confirmed_lsn", slot.ConfirmedFlush.String()).Str("wal_status", slot.WALStatus).Str("reason", slot.InvalidationReason).
			Msg("replication slot was invalidated by PostgreSQL (" + why + "); re-creating it and handing every row still ready to the poller")
		r.metrics.SlotInvalidations.Inc()
		if err := r.store.RecordInvalidation(ctx, r.cfg.Slot); err != nil {
			return slot, none, err
		}
		if err := replication.DropSlot(ctx, r.pool, r.cfg.Slot); err != nil {
			return slot, none, err
		}
		slot = replication.SlotInfo{}
	} else if slot.Exists && slot.WALStatus == "unreserved" {
		r.log.Warn().Str("confirmed_lsn", slot.ConfirmedFlush.String()).
			Msg("replication slot holds more WAL than max_slot_wal_keep_size and will be invalidated at the next checkpoint unless it catches up")
	}
	fs, err := replication.ReadFailoverSupport(ctx, r.pool)
	if err != nil {
		return slot, none, err
	}
	failover := r.cfg.FailoverSlot && fs.Supported
	if slot.Exists {
		why, err := r.foreignSlot(ctx, slot, fs)
		if err != nil {
			return slot, none, err
		}
		if why == "" {
			if err := r.checkFailoverSlot(ctx, conn, fs); err != nil {
				return slot, none, err
			}
			ident, err := r.finishBackfill(ctx, slot)
			return slot, ident, err
		}
		// Its confirmed position says nothing about what was published:
		// the rows between the relay's last confirmation and it would
		// never be streamed. A slot of the relay's own, created now,
		// exports the snapshot that hands them over.
		r.log.Warn().Str("confirmed_lsn", slot.ConfirmedFlush.String()).Str("reason", why).
			Msg("the slot was not created by this relay, or was moved behind its back: dropping it, creating the relay's own and handing the rows committed before it to the poller (G9)")
		if err := replication.DropSlot(ctx, r.pool, r.cfg.Slot); err != nil {
			return slot, none, err
		}
		slot = replication.SlotInfo{}
	}

	// The marker is committed before the slot exists, so a crash anywhere
	// from here to the handoff's commit leaves it set for the next session.
	if err := r.store.MarkBackfillPending(ctx, r.cfg.Slot); err != nil {
		return slot, none, err
	}
	created, err := replication.CreateSlot(ctx, conn, r.cfg.Slot, failover)
	if replication.IsDuplicateObject(err) {
		// Another instance created it first; its backfill may not be done.
		if slot, err = replication.LookupSlot(ctx, r.pool, r.cfg.Slot); err != nil {
			return slot, none, err
		}
		ident, err := r.finishBackfill(ctx, slot)
		return slot, ident, err
	}
	if err != nil {
		return slot, none, err
	}
	r.log.Info().Str("lsn", created.ConsistentPoint.String()).Bool("failover", failover).Msg("created replication slot")
	r.metrics.SlotsCreated.Inc()
	r.slotCreated = true
	n, err := r.store.BackfillFromSnapshot(ctx, r.cfg.Slot, created.Snapshot, created.ConsistentPoint.String())
	switch {
	case errors.Is(err, store.ErrBackfillNotPending):
		r.log.Info().Msg("another instance already handed the rows committed before the slot to the poller")
	case err != nil:
		// The next session finds the slot with the marker set and hands
		// over every ready row.
		return slot, none, err
	default:
		r.metrics.BackfilledRows.Add(float64(n))
		r.log.Info().Int64("rows", n).Str("lsn", created.ConsistentPoint.String()).
			Msg("handed rows committed before the slot to the poller (backfill)")
	}
	ident, _, err := r.store.SlotState(ctx, r.cfg.Slot)
	return replication.SlotInfo{Exists: true, Plugin: "pgoutput", Active: true, ConfirmedFlush: created.ConsistentPoint}, ident, err
}

// foreignSlot says why an existing slot is not the one the relay created
// and may not be streamed as it is, "" when it is (issue 30, item 3). The
// relay recorded, when it created the slot, the cluster and the slot's
// consistent point, and records before each confirmation how far it may
// have confirmed (replication.StreamConfig.RecordBound). A slot confirmed
// before where the relay's began, or past what the relay confirmed, was
// re-created or advanced by someone else: the rows committed between the
// relay's last confirmation and its position would never be streamed.
func (r *Relay) foreignSlot(ctx context.Context, slot replication.SlotInfo, fs replication.FailoverSupport) (string, error) {
	st, found, err := r.store.SlotState(ctx, r.cfg.Slot)
	if err != nil {
		return "", err
	}
	if !found {
		// Preflight refused it; the record was deleted since.
		return "", r.checkSlotOwner(ctx)
	}
	confirmed := store.LSN(slot.ConfirmedFlush)
	switch {
	case st.BackfillPending:
		// A slot created after the marker: finishBackfill hands every
		// ready row over, whoever created it.
		return "", nil
	case st.SystemIdentifier == 0:
		return fmt.Sprintf("its record in %s was not written by the relay on this cluster (inserted by hand, or copied from elsewhere): nothing says which rows it skipped", r.store.SlotsTable()), nil
	case st.SystemIdentifier != st.System:
		return fmt.Sprintf("its record was written on another cluster (system identifier %d, this one is %d: a copy by pg_dump, a restore, pg_upgrade): this slot was not created by this relay here", st.SystemIdentifier, st.System), nil
	case st.SlotLSN == 0:
		// Recorded before migration 0016: trusted as before, and from
		// now on known by its position.
		if err := r.store.AdoptSlot(ctx, r.cfg.Slot, confirmed); err != nil {
			return "", err
		}
		r.log.Info().Str("lsn", slot.ConfirmedFlush.String()).Msg("recorded the identity of a slot created before migration 0016")
		return "", nil
	case confirmed < st.SlotLSN:
		return fmt.Sprintf("its confirmed position %s is before %s, where the slot this relay created began: it was re-created by hand or restored", confirmed, st.SlotLSN), nil
	}
	if fs.Supported {
		if _, synced, err := replication.SlotFailover(ctx, r.pool, r.cfg.Slot); err != nil {
			return "", err
		} else if synced {
			// A standby's copy of the relay's failover slot, at most as
			// far as the WAL the standby received; the record of the
			// bound may trail it by the last confirmation's write.
			return "", nil
		}
	}
	if confirmed > st.ConfirmBound+replication.BoundSlack {
		return fmt.Sprintf("its confirmed position %s is past %s, the highest position this relay confirmed to it: it was advanced (pg_replication_slot_advance) or dropped and re-created by hand", confirmed, st.ConfirmBound), nil
	}
	return "", nil
}

// checkFailoverSlot reports what an existing slot does across a promotion
// (G14), and makes it a failover slot where it can: PostgreSQL 17+, asked
// for, and nobody streaming it (this session has not started yet).
func (r *Relay) checkFailoverSlot(ctx context.Context, conn replication.PgConn, fs replication.FailoverSupport) error {
	if !fs.Supported {
		return nil
	}
	failover, synced, err := replication.SlotFailover(ctx, r.pool, r.cfg.Slot)
	if err != nil {
		return err
	}
	if synced {
		// A copy a standby kept of the former primary's failover slot:
		// the promotion kept it. Rows acked but not confirmed before the
		// promotion are published again and dropped by the broker.
		r.metrics.FailoverPath.WithLabelValues("slot_survived").Inc()
		r.log.Info().Msg("the slot is a synced failover slot that survived a promotion: resuming from its confirmed position, no backfill")
	}
	if failover || !r.cfg.FailoverSlot {
		return nil
	}
	if err := replication.EnableFailover(ctx, conn, r.cfg.Slot); err != nil {
		r.log.Warn().Err(err).Msg("could not make the slot a failover slot; it will not survive a promotion (status says how to fix it)")
		return nil
	}
	r.log.Info().Msg("made the slot a failover slot (PostgreSQL 17+): standbys with sync_replication_slots keep a copy that survives a promotion")
	return nil
}

// finishBackfill completes a handoff that a crash (or an instance that lost
// the race to create the slot) left pending. The snapshot is gone, so it
// hands over every ready row; the ones the slot also streams are published
// twice under one Nats-Msg-Id and stored once. It returns the record of the
// slot, with the identity the handoff recorded.
func (r *Relay) finishBackfill(ctx context.Context, slot replication.SlotInfo) (store.SlotState, error) {
	n, pending, err := r.store.BackfillAllReady(ctx, r.cfg.Slot)
	if err != nil {
		return store.SlotState{}, err
	}
	if pending {
		r.metrics.BackfilledRows.Add(float64(n))
		r.log.Warn().Int64("rows", n).Str("lsn", slot.ConfirmedFlush.String()).
			Msg("found an unfinished backfill (the relay stopped between creating the slot and handing over older rows): handed every ready row to the poller")
	}
	st, _, err := r.store.SlotState(ctx, r.cfg.Slot)
	return st, err
}

var errOutage = errors.New("broker outage")

// checkSameDatabase refuses a replication session on another database than
// the pool's: the slot would decode another table's WAL, or none.
func (r *Relay) checkSameDatabase(ctx context.Context, conn replication.PgConn) error {
	ident, err := pglogrepl.IdentifySystem(ctx, conn)
	if err != nil {
		return fmt.Errorf("identify the replication session's server: %w", err)
	}
	var db string
	if err := r.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		return fmt.Errorf("read the statements' database: %w", err)
	}
	if ident.DBName != db {
		return fmt.Errorf("--replication-database-url reaches database %q and --database-url %q: both must name the same database (the replication URL directly, the other through its pooler)", ident.DBName, db)
	}
	return nil
}
