// Package poller is the relay's fallback path: a leased-claim poller for
// rows that need another attempt (rejected by the broker, delayed, redriven,
// backfilled). Several workers, in one process or many, share the table
// through FOR UPDATE SKIP LOCKED.
//
// A claim is one committed statement that moves due rows to 'running' with
// claimed_by = the worker, lease_until = database clock + lease, and
// claim_generation + 1. The claim commits before anything is published, so a
// crash after publishing leaves a lease that expires and a row another
// worker reclaims (the broker drops the repeat by its Nats-Msg-Id).
//
// The guards: every later statement on a claim (complete, renew, reschedule,
// fail) matches only while the row is still 'running' for this worker, with
// this claim's generation and a lease that has not expired on the database
// clock. A worker that stalled past its lease, or whose row was reclaimed by
// another worker (a newer generation), matches zero rows: it stops using that
// claim, counts it in outbox_relay_poller_stale_claims_total and logs it, and
// never overwrites the newer claim's outcome (DESIGN.md G6).
package poller

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
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

// Config holds the poller's knobs.
type Config struct {
	WorkerID     string
	Lease        time.Duration // how long a claim is held; publishes and their acks must fit in it
	PollInterval time.Duration // pause between polls when the last batch was not full (±50% jitter)
	BackoffMin   time.Duration
	BackoffMax   time.Duration
	MaxAttempts  int // attempts (claims) before a row is failed
	Batch        int // rows per claim
	// Pipeline is how many claimed batches Run keeps in flight: the next
	// claim runs while earlier batches wait for their acks and completions,
	// so the database and the broker work at the same time instead of
	// taking turns. Capped to MaxInFlightRows rows in flight (one batch at
	// least). 0: DefaultPipeline; 1: one batch at a time.
	Pipeline      int
	SubjectPrefix string
	// Format is how a row becomes its message (run --message-format); its
	// SubjectPrefix is SubjectPrefix's.
	Format wire.Format
	// Ordered claims, per aggregate, only its lowest unpublished sequence
	// (run --ordering aggregate, G12).
	Ordered bool
	// DeadlineMargin: rows closer than this to their deadline are not
	// claimed (G13); SweepInterval paces the sweep that expires them.
	DeadlineMargin time.Duration
	SweepInterval  time.Duration
	// DeadlineNow is the database's time as the relay measures it, read
	// late (by its uncertainty), for the deadline asked again just before
	// a claimed row is published: between the claim and the publish a batch
	// may wait for a standby, an uncertain row's lookup or a slow broker.
	// nil: this host's clock.
	DeadlineNow func() time.Time
	// Standby, with WALPosition, holds a claimed batch until the named
	// standbys have flushed past the claim (run --standby-slot, G14): the
	// rows' inserts committed before it. nil: no standbys.
	Standby     *standby.Gate
	WALPosition func(ctx context.Context) (replication.LSN, error)

	// LookupLimit bounds the messages a batch's stream lookup of its
	// uncertain rows reads (G18, resolveUncertain). 0: DefaultLookupLimit;
	// negative: no lookup, uncertain rows are published again as they are.
	LookupLimit int

	// Connected reports whether the broker is reachable; while it is not,
	// the poller claims nothing (a claim would only burn an attempt). nil:
	// always connected.
	Connected func() bool
	// Sleep and Rand replace the real pause and random source in tests.
	// Rand(n) returns a value in [0, n).
	Sleep func(ctx context.Context, d time.Duration) error
	Rand  func(n int64) int64
}

// Defaults of the poller, used by `run`'s flags and by WithDefaults.
const (
	DefaultLease      = 30 * time.Second
	DefaultBackoffMin = time.Second
	// DefaultBackoffMax is the default stream's duplicate window
	// (jetstream.DefaultDuplicateWindow, 2m), no longer: a retry after an
	// attempt whose ack was lost then lands inside the window, and the
	// stream a default run creates passes its own contract check (5m did
	// not: every default start warned about the window).
	DefaultBackoffMax   = 2 * time.Minute
	DefaultPollInterval = time.Second
	DefaultMaxAttempts  = 10
	DefaultBatch        = 500
	DefaultPipeline     = 2
	// MaxInFlightRows bounds Pipeline × Batch: every claimed row holds a
	// lease that its batch must publish, ack and complete within (or renew),
	// and its payload in memory until then.
	MaxInFlightRows = 2000
	// DefaultDeadlineMargin is how close to its deadline a row may still be
	// published (store.DefaultDeadlineMargin, shared with the CDC path).
	DefaultDeadlineMargin = store.DefaultDeadlineMargin
	DefaultSweepInterval  = 5 * time.Second
)

// maxInFlightBytes stops pipelining batches of large payloads: their time
// goes to moving bytes, which a second batch in flight does not shorten,
// while it would hold another batch of payloads in memory.
const maxInFlightBytes = 8 << 20

// WithDefaults returns c with its zero knobs set to the defaults.
func (c Config) WithDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	def(&c.Lease, DefaultLease)
	def(&c.BackoffMin, DefaultBackoffMin)
	def(&c.BackoffMax, DefaultBackoffMax)
	def(&c.PollInterval, DefaultPollInterval)
	def(&c.DeadlineMargin, DefaultDeadlineMargin)
	def(&c.SweepInterval, DefaultSweepInterval)
	if c.MaxAttempts == 0 {
		c.MaxAttempts = DefaultMaxAttempts
	}
	if c.Batch == 0 {
		c.Batch = DefaultBatch
	}
	if c.Pipeline == 0 {
		c.Pipeline = DefaultPipeline
	}
	return c
}

// Poller is one worker.
type Poller struct {
	cfg  Config
	st   *store.Store
	sink sinks.Sink
	log  zerolog.Logger
	// repeats summarises duplicate acks in the log.
	repeats *repeats.Log
	// noisy logs what can repeat every poll during an outage (poll
	// failures, stale claims): a few per half minute, not one per poll.
	noisy zerolog.Logger
	m     *metrics.Metrics
	// The per-row counters, bound once: a label lookup per message is a
	// measurable share of a batch's CPU.
	pubOK, pubDuplicate prometheus.Counter
	// wake cuts an idle pause short (Wake): rows due at once were written.
	wake chan struct{}
}

// Wake tells the poller that rows it may claim at once were just committed
// (the CDC path handed a held aggregate's rows over), so an idle pause ends
// now instead of a poll interval later. A released aggregate then drains
// while its new rows still arrive, and the CDC path finds it caught up and
// takes it back (G12). Never blocks; wakes that come while the poller is
// busy fold into one.
func (p *Poller) Wake() {
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

// pause waits d, or less when Wake is called; an error only when ctx ends.
func (p *Poller) pause(ctx context.Context, d time.Duration) error {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		select {
		case <-p.wake:
			cancel()
		case <-sctx.Done():
		}
	}()
	if err := p.cfg.Sleep(sctx, d); err != nil && ctx.Err() != nil {
		return err
	}
	return nil
}

// New returns a poller; Run starts it.
func New(cfg Config, st *store.Store, sink sinks.Sink, log zerolog.Logger, m *metrics.Metrics) *Poller {
	cfg.Format.SubjectPrefix = cfg.SubjectPrefix
	if cfg.Sleep == nil {
		cfg.Sleep = retry.Sleep
	}
	if cfg.Rand == nil {
		cfg.Rand = rand.Int64N
	}
	if cfg.Batch < 1 {
		cfg.Batch = 1
	}
	if cfg.MaxAttempts < 1 {
		cfg.MaxAttempts = 1
	}
	if cfg.Pipeline < 1 {
		cfg.Pipeline = DefaultPipeline
	}
	cfg.Pipeline = max(1, min(cfg.Pipeline, MaxInFlightRows/cfg.Batch))
	l := log.With().Str("component", "poller").Str("worker", cfg.WorkerID).Logger()
	return &Poller{cfg: cfg, st: st, sink: sink, log: l, m: m,
		noisy:        l.Sample(&zerolog.BurstSampler{Burst: 5, Period: 30 * time.Second}),
		repeats:      repeats.New(l, store.DuplicateLog, 0),
		wake:         make(chan struct{}, 1),
		pubOK:        m.Published.WithLabelValues("poller", "ok"),
		pubDuplicate: m.Published.WithLabelValues("poller", "duplicate"),
	}
}

// Run polls until ctx ends; it returns nil then, once the batches in flight
// are finished. Database and broker errors are logged and retried at the
// next poll: the poller never gives up.
//
// Up to cfg.Pipeline batches are in flight: the next claim runs while the
// batches before it wait for their acks and completions. Each batch is on
// its own from its claim on (its own leases, renewals and guarded
// statements), exactly as if another worker had claimed it, so pipelining
// changes no guard.
func (p *Poller) Run(ctx context.Context) error {
	p.log.Info().Dur("lease", p.cfg.Lease).Int("max_attempts", p.cfg.MaxAttempts).Int("batch", p.cfg.Batch).
		Int("pipeline", p.cfg.Pipeline).Msg("poller started")
	f := flight{done: make(chan int, p.cfg.Pipeline)}
	// Claimed batches are finished even when ctx ends: a stop records what
	// the broker acked instead of leaving it to a reclaim.
	defer p.repeats.Flush()
	defer f.waitAll()
	// The first claim runs at once, before the first sweep: a relay that
	// starts on a backlog has no reason to wait a poll interval, and the
	// sweep then runs while the first batch is published. Sweeping second
	// lets no expired row through: the claim itself leaves alone rows too
	// close to their deadline.
	immediate := true
	var lastSweep time.Time
	for first := true; ; first = false {
		if !first && time.Since(lastSweep) >= p.cfg.SweepInterval {
			lastSweep = time.Now()
			p.sweep(ctx)
		}
		if !immediate {
			d := p.cfg.PollInterval
			if d > 0 {
				d = d/2 + time.Duration(p.cfg.Rand(int64(d)))
			}
			if err := p.pause(ctx, d); err != nil || ctx.Err() != nil {
				return nil
			}
		}
		if ctx.Err() != nil {
			return nil
		}
		immediate = false
		claimed, err := p.claimNext(ctx, &f)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			p.noisy.Warn().Err(err).Msg("poll failed; retrying at the next interval (repeats are sampled)")
			continue
		}
		if len(claimed) == 0 {
			// With ordering on, due rows may be waiting only behind the
			// batches in flight (the rest of an aggregate's run): claim
			// again as soon as one of them ends, not a poll interval later.
			if p.cfg.Ordered && f.batches > 0 {
				immediate = f.waitOne(ctx, p.cfg.PollInterval, p.wake)
			}
			continue
		}
		size := 0
		for _, c := range claimed {
			size += len(c.Payload) + len(c.Headers)
		}
		f.batches++
		f.bytes += size
		go func() {
			defer func() { f.done <- size }()
			if err := p.process(ctx, claimed); err != nil {
				p.noisy.Warn().Err(err).Int("claims", len(claimed)).Msg("batch failed; its rows are reclaimed once their leases expire (repeats are sampled)")
			}
		}()
		immediate = len(claimed) >= p.cfg.Batch
	}
}

// claimNext claims the next batch once there is room for it in f, unless
// the broker is unreachable (a claim would only burn an attempt). It
// returns nothing when ctx ends first.
func (p *Poller) claimNext(ctx context.Context, f *flight) ([]store.Claimed, error) {
	if p.cfg.Connected != nil && !p.cfg.Connected() {
		return nil, nil
	}
	if !f.waitRoom(ctx, p.cfg.Pipeline) {
		return nil, nil
	}
	return p.claim(ctx)
}

// flight counts the batches Run has claimed and not finished, and their
// payload bytes. Only Run's goroutine touches the counts; a batch reports
// its end (its bytes) on done, which has room for every batch in flight.
type flight struct {
	batches, bytes int
	done           chan int
}

// waitRoom waits until another batch may be claimed: fewer than pipeline
// batches in flight, and fewer than maxInFlightBytes of payload unless none
// is. false: ctx ended first.
func (f *flight) waitRoom(ctx context.Context, pipeline int) bool {
	for {
		select {
		case n := <-f.done:
			f.batches--
			f.bytes -= n
			continue
		default:
		}
		if f.batches == 0 || (f.batches < pipeline && f.bytes < maxInFlightBytes) {
			return true
		}
		select {
		case n := <-f.done:
			f.batches--
			f.bytes -= n
		case <-ctx.Done():
			return false
		}
	}
}

// waitOne waits until a batch in flight ends, d passes or a wake comes;
// false: ctx ended first.
func (f *flight) waitOne(ctx context.Context, d time.Duration, wake <-chan struct{}) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case n := <-f.done:
		f.batches--
		f.bytes -= n
		return true
	case <-t.C:
		return true
	case <-wake:
		return true
	case <-ctx.Done():
		return false
	}
}

func (f *flight) waitAll() {
	for ; f.batches > 0; f.batches-- {
		f.bytes -= <-f.done
	}
}

// sweep moves rows whose deadline passed to 'expired' (G13): whatever the
// broker does, such a row is never claimed again.
func (p *Poller) sweep(ctx context.Context) {
	ids, err := p.st.ExpireDue(ctx)
	if err != nil {
		if ctx.Err() == nil {
			p.noisy.Warn().Err(err).Msg("deadline sweep failed; retrying at the next sweep (repeats are sampled)")
		}
		return
	}
	if len(ids) > 0 {
		p.m.Expired.WithLabelValues("poller").Add(float64(len(ids)))
		p.log.Warn().Int("rows", len(ids)).Strs("work_ids", ids[:min(len(ids), 10)]).Msg("rows expired: their business deadline passed before they were published")
	}
}

type inflight struct {
	c   store.Claimed
	f   sinks.Future
	err error // set when the row never reached a future
}

// Poll claims one batch, publishes it, and records each row's outcome with
// guarded statements. It returns how many rows it claimed.
func (p *Poller) Poll(ctx context.Context) (int, error) {
	claimed, err := p.claim(ctx)
	if err != nil || len(claimed) == 0 {
		return 0, err
	}
	return len(claimed), p.process(ctx, claimed)
}

func (p *Poller) claim(ctx context.Context) ([]store.Claimed, error) {
	o := store.ClaimOptions{Ordered: p.cfg.Ordered, DeadlineMargin: p.cfg.DeadlineMargin}
	o.StreamSeq, o.HasStreamSeq = p.streamPosition(ctx)
	claimed, err := p.st.Claim(ctx, p.cfg.WorkerID, p.cfg.Lease, p.cfg.Batch, o)
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	if len(claimed) > 0 {
		p.m.Claims.Add(float64(len(claimed)))
	}
	return claimed, nil
}

// process publishes a claimed batch and records each row's outcome.
func (p *Poller) process(ctx context.Context, claimed []store.Claimed) error {
	// The claims are committed. Finish this batch even if ctx ends meanwhile
	// (its outcomes are worth recording), renewing the leases while acks are
	// slow, but never past a lease that could not be renewed: after that
	// every guarded statement would match nothing anyway.
	wctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	keeperDone := make(chan struct{})
	stopKeeper := make(chan struct{})
	go func() {
		defer close(keeperDone)
		p.keepLeases(wctx, claimed, stopKeeper, cancel)
	}()
	defer func() { close(stopKeeper); <-keeperDone }()
	if p.cfg.Standby != nil {
		if goOn, err := p.waitStandbys(ctx, wctx, claimed); !goOn {
			return err
		}
	}

	// The rows found stored are completed beside the acked ones; the
	// lease keeper goes on holding every claim of the batch until then.
	toPublish, found, err := p.resolveUncertain(wctx, claimed)
	if err != nil {
		p.giveBackUnchecked(wctx, claimed, err)
		return nil
	}
	singles, runs := p.split(toPublish)
	// Each run of an aggregate is published in sequence order, one row at
	// a time, beside the rest of the batch (see publishRun).
	runAcked := make(chan []store.Completion, len(runs))
	for _, run := range runs {
		go func() { runAcked <- p.publishRun(wctx, run) }()
	}

	batch := make([]inflight, 0, len(singles))
	extra := make(map[string]string, 2)
	var expiring []store.Claimed
	for _, c := range singles {
		if c.Reclaimed && c.Attempts > p.cfg.MaxAttempts {
			p.failReclaimed(wctx, c)
			continue
		}
		if p.expiring(c) {
			expiring = append(expiring, c)
			continue
		}
		msg, err := p.message(c, extra)
		if err != nil {
			batch = append(batch, inflight{c: c, err: err})
			continue
		}
		f, err := p.sink.Publish(wctx, msg)
		batch = append(batch, inflight{c: c, f: f, err: err})
	}

	p.releaseExpiring(wctx, expiring)
	acked := make([]store.Completion, 0, len(claimed)+len(found))
	acked = append(acked, found...)
	for i := range batch {
		in := &batch[i]
		if in.err == nil {
			ack, err := in.f.Wait(wctx)
			if err == nil {
				acked = append(acked, p.acked(in.c, ack))
				continue
			}
			in.err = err
		}
		if wctx.Err() != nil {
			// The leases are gone (see keepLeases): the rows belong to
			// whoever reclaims them, and nothing may be recorded here.
			continue
		}
		p.retryOrFail(wctx, in.c, in.err)
	}
	for range runs {
		acked = append(acked, <-runAcked...)
	}

	if len(acked) > 0 {
		done, err := p.st.Complete(wctx, acked, p.cfg.WorkerID)
		if err != nil {
			// The rows stay running; their leases expire and another
			// claim publishes them again (deduplicated by Nats-Msg-Id).
			return fmt.Errorf("complete %d acked rows: %w", len(acked), err)
		}
		if len(done) < len(acked) {
			ok := make(map[string]struct{}, len(done))
			for _, id := range done {
				ok[id] = struct{}{}
			}
			for _, a := range acked {
				if _, found := ok[a.WorkID]; !found {
					p.stale("complete", a.WorkID, a.Generation)
				}
			}
		}
	}
	return nil
}

// message builds c's message; extra is a scratch map for the poller's
// headers, reused across a batch (BuildMessage copies its values).
func (p *Poller) message(c store.Claimed, extra map[string]string) (*wire.Message, error) {
	return Message(c, p.cfg.Format, extra)
}

// Message builds the poller path's message of c (its attempt and claim
// generation as headers), for the poller and for the republish command,
// which publishes a row the broker lost in the same format. extra is a
// scratch map, overwritten.
func Message(c store.Claimed, f wire.Format, extra map[string]string) (*wire.Message, error) {
	extra[wire.HeaderAttempt] = strconv.Itoa(c.Attempts)
	extra[wire.HeaderClaimGeneration] = strconv.FormatInt(c.ClaimGeneration, 10)
	return f.Build(wire.Row{
		WorkID: c.WorkID, Kind: c.Kind, Subject: c.Subject, Payload: c.Payload, Headers: c.Headers,
		AggregateType: c.AggregateType, AggregateID: c.AggregateID, AggregateSeq: c.AggregateSeq, ExpiresAt: c.ExpiresAt,
		CreatedAt: c.CreatedAt, Binary: c.Binary,
	}, wire.SharedHeaders(extra))
}

// acked counts an ack and returns the completion it calls for.
func (p *Poller) acked(c store.Claimed, ack sinks.Ack) store.Completion {
	done := store.Completion{WorkID: c.WorkID, Generation: c.ClaimGeneration, Seq: ack.Sequence, Stream: ack.Stream}
	if !ack.Duplicate {
		p.pubOK.Inc()
		return done
	}
	p.pubDuplicate.Inc()
	p.m.Duplicates.Inc()
	// See the CDC path (relay.handleResult): the row points at the message
	// the broker kept.
	done.Note = store.DuplicateNote(ack.Stream, ack.Sequence)
	p.repeats.Add(c.WorkID, ack.Stream, ack.Sequence)
	return done
}

// failReclaimed dead-letters a row a worker held and vanished (or stalled)
// with on its last allowed attempt: whether that publish landed is unknown.
func (p *Poller) failReclaimed(ctx context.Context, c store.Claimed) {
	p.m.Failures.WithLabelValues("uncertain", "lease_expired").Inc()
	p.fail(ctx, c, store.ClassUncertain.Notef("lease expired after %d attempts (max attempts reached)", c.Attempts-1))
}

// expiring asks a claimed row's deadline again just before its publish
// (G13): the claim left it at least DeadlineMargin, but a batch can wait
// after its claim (a standby, the lookup of uncertain rows, a slow broker,
// a paused process), and a publish after the deadline is what the margin
// exists to prevent. The chaos run's pg-latency and takeover windows found
// rows of the poller's stored 0.4 s past their deadline.
func (p *Poller) expiring(c store.Claimed) bool {
	if c.ExpiresAt.IsZero() {
		return false
	}
	now := time.Now()
	if p.cfg.DeadlineNow != nil {
		now = p.cfg.DeadlineNow()
	}
	return !c.ExpiresAt.After(now.Add(p.cfg.DeadlineMargin))
}

// releaseExpiring gives rows too close to their deadline back unpublished:
// the claim leaves them alone (they are within the margin) and the sweep
// expires them at their deadline.
func (p *Poller) releaseExpiring(ctx context.Context, rows []store.Claimed) {
	if len(rows) == 0 {
		return
	}
	if err := p.release(ctx, rows, store.ClassHeld.Note("within --deadline-margin of its deadline at publish; expired by the sweep at its deadline")); err != nil {
		p.log.Warn().Err(err).Int("claims", len(rows)).
			Msg("could not give back rows too close to their deadline to publish; their leases expire and the claim leaves them to the sweep")
	}
}

// release gives claimed rows back (store.Release, guarded by their claim
// generation), a row another claim has taken meanwhile counted stale.
func (p *Poller) release(ctx context.Context, rows []store.Claimed, why string) error {
	items := unclaimed(rows)
	released, err := p.st.Release(ctx, items, p.cfg.WorkerID, why)
	if err != nil {
		return err
	}
	if len(released) < len(items) {
		ok := make(map[string]struct{}, len(released))
		for _, id := range released {
			ok[id] = struct{}{}
		}
		for _, it := range items {
			if _, found := ok[it.WorkID]; !found {
				p.stale("release", it.WorkID, it.Generation)
			}
		}
	}
	return nil
}

// split sorts a claimed batch into rows published together (singles) and,
// with ordering on, runs: two or more rows of one aggregate, in sequence
// order. The ordered claim gives an aggregate's rows to one claim only, so
// a run holds every claimed row of its aggregate (store.orderedClaimSQL).
func (p *Poller) split(claimed []store.Claimed) (singles []store.Claimed, runs [][]store.Claimed) {
	if !p.cfg.Ordered {
		return claimed, nil
	}
	byAgg := map[store.AggregateKey][]store.Claimed{}
	for _, c := range claimed {
		if c.AggregateType != "" {
			k := store.AggregateKey{Type: c.AggregateType, ID: c.AggregateID}
			byAgg[k] = append(byAgg[k], c)
		}
	}
	for _, c := range claimed {
		if c.AggregateType == "" || len(byAgg[store.AggregateKey{Type: c.AggregateType, ID: c.AggregateID}]) == 1 {
			singles = append(singles, c)
		}
	}
	for _, run := range byAgg {
		if len(run) > 1 {
			slices.SortFunc(run, func(a, b store.Claimed) int { return cmp.Compare(a.AggregateSeq, b.AggregateSeq) })
			runs = append(runs, run)
		}
	}
	return singles, runs
}

// publishRun publishes a run of one aggregate's rows in sequence order and
// returns the completions of those acked. Each row waits for the ack of the
// one before it: a broker can refuse a message at ack time (a stream's
// maximum message size) when the next one would already be stored, as on
// the CDC path. At the first row that fails, the run stops: that row is
// rescheduled (or failed) as usual, and the rows after it are given back
// without an attempt, to wait behind it (store.Release). When the leases
// are lost (ctx ends), nothing more is recorded.
func (p *Poller) publishRun(ctx context.Context, run []store.Claimed) []store.Completion {
	acked := make([]store.Completion, 0, len(run))
	extra := make(map[string]string, 2)
	for i, c := range run {
		var err error
		if c.Reclaimed && c.Attempts > p.cfg.MaxAttempts {
			p.failReclaimed(ctx, c)
		} else if p.expiring(c) {
			// The run stops here: its later rows wait behind this one,
			// which the sweep expires at its deadline.
			p.releaseExpiring(ctx, []store.Claimed{c})
		} else {
			var msg *wire.Message
			var f sinks.Future
			var ack sinks.Ack
			if msg, err = p.message(c, extra); err == nil {
				if f, err = p.sink.Publish(ctx, msg); err == nil {
					ack, err = f.Wait(ctx)
				}
			}
			if err == nil {
				acked = append(acked, p.acked(c, ack))
				continue
			}
			if ctx.Err() != nil {
				return acked
			}
			p.retryOrFail(ctx, c, err)
		}
		p.giveBack(ctx, c, run[i+1:])
		return acked
	}
	return acked
}

// giveBack releases the claims of rest, the rows of a run after blocker.
func (p *Poller) giveBack(ctx context.Context, blocker store.Claimed, rest []store.Claimed) {
	if len(rest) == 0 {
		return
	}
	why := store.ClassHeld.Note("waiting for " + blocker.WorkID + " (an earlier row of aggregate " + store.AggregateKey{Type: blocker.AggregateType, ID: blocker.AggregateID}.String() + ")")
	if err := p.release(ctx, rest, why); err != nil {
		p.log.Warn().Err(err).Int("claims", len(rest)).Str("behind", blocker.WorkID).
			Msg("could not give back the rest of an aggregate's run; their leases will expire and the rows be reclaimed in order")
	}
}

// waitStandbys holds a claimed batch until its rows' inserts are on the
// standbys (G14). The leases are renewed meanwhile; a batch that cannot
// wait within them is abandoned to a reclaim. Unlike the publishing after
// it, the wait ends with the caller's ctx (a stop): nothing was published,
// so abandoning the batch loses nothing, and a stop must not wait for a
// standby that may be behind for hours. The claims are given back, so the
// rows are claimable at once rather than when their leases run out.
// goOn: the standbys flushed the rows, publish them.
func (p *Poller) waitStandbys(ctx, wctx context.Context, claimed []store.Claimed) (goOn bool, err error) {
	sctx, cancel := context.WithCancel(wctx)
	defer cancel()
	defer context.AfterFunc(ctx, cancel)()
	lsn, err := p.cfg.WALPosition(sctx)
	if err == nil {
		err = p.cfg.Standby.Wait(sctx, lsn)
	}
	if err == nil {
		return true, nil
	}
	if ctx.Err() == nil || wctx.Err() != nil {
		return false, fmt.Errorf("wait for the standbys to flush the claimed rows: %w", err)
	}
	items := unclaimed(claimed)
	rctx, rcancel := context.WithTimeout(wctx, 5*time.Second)
	defer rcancel()
	released, rerr := p.st.Release(rctx, items, p.cfg.WorkerID, "released unpublished: the relay stopped while the claim waited for the standbys (--standby-slot)")
	if rerr != nil {
		p.log.Warn().Err(rerr).Int("claims", len(items)).
			Msg("stopping while a claimed batch waited for the standbys: could not give the claims back; the rows are reclaimed once their leases expire")
		return false, nil
	}
	p.log.Info().Int("claims", len(released)).Msg("stopping while a claimed batch waited for the standbys: gave the unpublished claims back")
	return false, nil
}

// giveBackUnchecked returns a batch unpublished whose uncertain rows could not be
// looked up in the stream: past the duplicate window a row the broker did
// store would be stored twice. The claims go back without counting an
// attempt and keep their notes; the next claim looks again.
func (p *Poller) giveBackUnchecked(ctx context.Context, claimed []store.Claimed, why error) {
	items := unclaimed(claimed)
	rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	released, err := p.st.Release(rctx, items, p.cfg.WorkerID, "")
	ev := p.noisy.Warn().Err(why).Int("claims", len(items)).Int("given_back", len(released))
	if err != nil {
		ev = ev.AnErr("give_back_error", err)
	}
	ev.Msg("could not look the batch's uncertain rows up in the stream: gave the batch back unpublished, the next claim looks again (the rows not given back are reclaimed when their leases expire; repeats are sampled)")
}

// keepLeases renews the batch's leases every third of the lease until stop
// closes, and cancels the batch once the leases can no longer be held (every
// claim gone, or the last renewal's lease run out while the database is
// unreachable). The deadline is kept on the local clock from just before each
// renewal, which is never later than the database's own lease_until.
func (p *Poller) keepLeases(ctx context.Context, claimed []store.Claimed, stop <-chan struct{}, cancel context.CancelFunc) {
	held := make([]store.Completion, len(claimed))
	for i, c := range claimed {
		held[i] = store.Completion{WorkID: c.WorkID, Generation: c.ClaimGeneration}
	}
	deadline := time.Now().Add(p.cfg.Lease)
	every := p.cfg.Lease / 3
	for {
		wait := min(every, time.Until(deadline))
		t := time.NewTimer(wait)
		select {
		case <-stop:
			t.Stop()
			return
		case <-t.C:
		}
		if !time.Now().Before(deadline) {
			p.log.Warn().Int("claims", len(held)).Msg("could not renew the batch's leases in time; abandoning the batch to a reclaim")
			cancel()
			return
		}
		started := time.Now()
		rctx, rcancel := context.WithDeadline(ctx, deadline)
		renewed, err := p.st.RenewClaims(rctx, held, p.cfg.WorkerID, p.cfg.Lease)
		rcancel()
		if err != nil {
			p.log.Warn().Err(err).Int("claims", len(held)).Msg("lease renewal failed; retrying until the lease runs out")
			continue
		}
		deadline = started.Add(p.cfg.Lease)
		p.m.LeaseRenewals.Add(float64(len(renewed)))
		if len(renewed) < len(held) {
			ok := make(map[string]struct{}, len(renewed))
			for _, id := range renewed {
				ok[id] = struct{}{}
			}
			kept := held[:0]
			for _, h := range held {
				if _, found := ok[h.WorkID]; found {
					kept = append(kept, h)
				} else {
					p.stale("renew", h.WorkID, h.Generation)
				}
			}
			held = kept
		}
		if len(held) == 0 {
			cancel()
			return
		}
	}
}

// retryOrFail records a failed publish: rejected (the broker will never take
// it as it is) or uncertain (timeout, outage: it may have been stored).
func (p *Poller) retryOrFail(ctx context.Context, c store.Claimed, err error) {
	var class, reason, text string
	if re, ok := wire.IsRejected(err); ok {
		class, reason = "rejected", re.Reason
		text = store.ClassRejected.Notef("%s: %v", re.Reason, re.Err)
		p.m.Published.WithLabelValues("poller", "rejected").Inc()
	} else {
		class, reason = "uncertain", "outage"
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, sinks.ErrAckTimeout) {
			reason = "timeout"
		}
		text = store.ClassUncertain.Notef("%v", err)
		p.m.Published.WithLabelValues("poller", "error").Inc()
	}
	p.m.Failures.WithLabelValues(class, reason).Inc()
	if c.Attempts >= p.cfg.MaxAttempts {
		p.fail(ctx, c, text)
		return
	}
	delay := retry.Full(c.Attempts, p.cfg.BackoffMin, p.cfg.BackoffMax, p.cfg.Rand)
	ok, werr := p.st.Reschedule(ctx, c.WorkID, p.cfg.WorkerID, c.ClaimGeneration, delay, text)
	switch {
	case werr != nil:
		p.log.Warn().Err(werr).Str("work_id", c.WorkID).Msg("reschedule failed; the lease will expire and the row be reclaimed")
	case !ok:
		p.stale("reschedule", c.WorkID, c.ClaimGeneration)
	default:
		p.log.Debug().Str("work_id", c.WorkID).Int("attempt", c.Attempts).Dur("retry_in", delay).Str("error", text).Msg("rescheduled")
	}
}

func (p *Poller) fail(ctx context.Context, c store.Claimed, text string) {
	ok, err := p.st.Fail(ctx, c.WorkID, p.cfg.WorkerID, c.ClaimGeneration, text)
	switch {
	case err != nil:
		p.log.Warn().Err(err).Str("work_id", c.WorkID).Msg("fail failed; the lease will expire and the row be reclaimed")
	case !ok:
		p.stale("fail", c.WorkID, c.ClaimGeneration)
	default:
		class, _, _ := strings.Cut(text, ":")
		p.m.DeadLetters.WithLabelValues(class).Inc()
		p.log.Warn().Str("work_id", c.WorkID).Int("attempts", c.Attempts).Str("error", text).Msg("row failed: redrive it once the cause is fixed")
	}
}

func (p *Poller) stale(op, workID string, gen int64) {
	p.m.StaleCompletions.WithLabelValues(op).Inc()
	p.noisy.Warn().Str("op", op).Str("work_id", workID).Int64("claim_generation", gen).
		Msg("claim expired or superseded: the guarded update matched no row; leaving it to the newer claim")
}

// unclaimed is the claims cs as Release takes them.
func unclaimed(cs []store.Claimed) []store.Unclaimed {
	items := make([]store.Unclaimed, len(cs))
	for i, c := range cs {
		items[i] = store.Unclaimed{WorkID: c.WorkID, Generation: c.ClaimGeneration, Reclaimed: c.Reclaimed}
	}
	return items
}
