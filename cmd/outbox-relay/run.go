package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func runRun(ctx context.Context, args []string, _, stderr io.Writer) error {
	var c common
	fs := newFlagSet("run", "Streams committed outbox INSERTs from the replication slot to JetStream and confirms the slot only after the broker acked.", stderr)
	c.register(fs, commonFlags...)
	var (
		dupWindow, ackTimeout, statusInterval, drainTimeout, linger time.Duration
		maxInFlight, maxInFlightBytes, maxBufferedBytes, replicas   int
		httpAddr, appName, replicationURL                           string
		workerID                                                    string
		lease, backoffMin, backoffMax, pollInterval                 time.Duration
		maxAttempts, pollBatch, pollPipeline                        int
		statsInterval                                               time.Duration
		createStream, deadlineTTL, atomicTx, adaptiveProcs          bool
		atomicBatchMax                                              int
		natsMonitorURL                                              string
		readBackLimit                                               int
		lostCheck                                                   time.Duration
		allowStreams                                                config.List
		ordering                                                    string
		standbySlots                                                config.List
		failoverSlot                                                bool
		deadlineMargin                                              time.Duration
		consoleOpts                                                 console.Options
	)
	fs.DurationVar(&dupWindow, "duplicate-window", natssink.DefaultDuplicateWindow, "duplicate window of the stream when the relay creates it")
	fs.StringVar(&ordering, "ordering", app.OrderingNone, "none (publish as committed) or aggregate (keep each aggregate's sequence order on every path)")
	fs.DurationVar(&deadlineMargin, "deadline-margin", poller.DefaultDeadlineMargin, "a row this close to its expires_at is not published: the time a publish and its ack may take (more than 0, at most 24h)")
	fs.Var(&standbySlots, "standby-slot", "a physical slot of a standby that may be promoted: nothing is published before its standby flushed it; repeat or comma-separate. A name with no slot on the current primary holds nothing back (warned)")
	fs.BoolVar(&failoverSlot, "failover-slot", true, "create the slot as a failover slot on PostgreSQL 17+, so it survives a promotion of a standby with sync_replication_slots = on")
	fs.Var(&allowStreams, "allow-stream", "a further stream a row's subject column may name; repeat or comma-separate (default: only --stream; a subject no allowed stream binds is refused)")
	fs.BoolVar(&createStream, "create-stream", true, "create --stream when it is missing (false: it must exist, e.g. when operators own stream configuration)")
	fs.BoolVar(&deadlineTTL, "deadline-ttl", true, "publish a row with expires_at with Nats-TTL (the time left, rounded up to whole seconds), so the stream removes its message at the deadline, where the stream allows per-message TTL; the stream the relay creates allows it (which cannot be undone on it)")
	fs.BoolVar(&atomicTx, "atomic-transactions", false, "publish each transaction's rows as one JetStream atomic batch, stored all together or not at all (nats-server 2.12+, a stream with allow_atomic, which the relay sets on a stream it creates); not with --ordering aggregate. A transaction larger than --atomic-batch-max rows or --max-in-flight-bytes goes as consecutive whole batches")
	fs.IntVar(&atomicBatchMax, "atomic-batch-max", relay.DefaultAtomicBatchMax, "with --atomic-transactions: the most rows of one atomic batch; at most the server's max_batch_size (1000 unless raised)")
	fs.StringVar(&natsMonitorURL, "nats-monitor-url", "", "nats-server's monitoring endpoint (e.g. http://nats:8222), where the start's broker contract check reads the server's sync setting (empty: unknown, and an R1 file stream is warned about)")
	fs.IntVar(&readBackLimit, "readback-limit", relay.DefaultReadBackLimit, "message headers a session start reads back from the stream to find the replayed rows it already holds, which it then does not publish again (about 100 bytes of memory each; 0: no read-back, repeats left to the duplicate window); also bounds, capped at 10000, the poller's per-batch lookup of uncertain rows before it publishes them again (0 turns it off too)")
	fs.DurationVar(&lostCheck, "lost-check-interval", relay.DefaultLostCheckInterval, "how often, beside every session start, the stream's last sequence is compared with the sequences recorded as published, to find messages the broker acknowledged and then lost (under --on-publish mark they are published again, under none and delete reported); 0: only at session starts")
	fs.IntVar(&replicas, "stream-replicas", 1, "replicas of the stream when the relay creates it (3 on a JetStream cluster)")
	fs.DurationVar(&ackTimeout, "ack-timeout", natssink.DefaultAckTimeout, "how long a publish waits for the broker's ack before the session restarts")
	fs.IntVar(&maxInFlight, "max-in-flight", relay.DefaultMaxInFlight, "messages published and not yet acked")
	fs.IntVar(&maxInFlightBytes, "max-in-flight-bytes", relay.DefaultMaxInFlightBytes, "bytes published and not yet acked")
	fs.IntVar(&maxBufferedBytes, "max-buffered-bytes", relay.DefaultMaxBufferedBytes, "bytes of decoded rows the CDC path holds in all (read, held for a standby, in flight); reading WAL pauses at this bound (a single larger row passes alone)")
	fs.DurationVar(&linger, "linger", relay.DefaultLinger, "how long a committed transaction may wait for the next ones before it is published (0: not at all); groups a trickle of small transactions into fewer wake-ups")
	fs.BoolVar(&adaptiveProcs, "adaptive-procs", true, "run the relay's Go code on one thread (GOMAXPROCS 1) while it uses less than a third of a core, and on GOMAXPROCS's default from the first second it uses more than three quarters of one: at a trickle of small transactions a fifth less CPU per message (docs/benchmarks-cost.md); off when GOMAXPROCS is set")
	fs.DurationVar(&statusInterval, "status-interval", relay.DefaultStatusInterval, "standby status updates to PostgreSQL (keep well under wal_sender_timeout/2)")
	fs.DurationVar(&drainTimeout, "drain-timeout", relay.DefaultDrainTimeout, "on SIGTERM, how long to wait for in-flight acks")
	fs.StringVar(&httpAddr, "http-addr", "", "serve /metrics, /healthz and /readyz here, e.g. :8080 (empty: off)")
	fs.BoolVar(&consoleOpts.Enabled, "console", false, "serve the operator console under /ui/ on --http-addr (off by default: it reads every payload and can redrive and cancel)")
	fs.StringVar(&consoleOpts.Token, "console-token", "", "the console's token (bearer, basic auth password or login), at least 16 bytes; required unless --http-addr is loopback, and without it the console is read-only and answers only requests addressed to localhost")
	fs.BoolVar(&consoleOpts.ReadOnly, "console-read-only", false, "the console shows everything and changes nothing")
	fs.StringVar(&replicationURL, "replication-database-url", "", "the database for the replication session (the slot), when --database-url is a pooler such as PgBouncer or a managed service's pooled endpoint, which cannot carry one: the same database, directly (empty: --database-url). Its password comes from the URL, libpq's variables or --database-password-file/--database-password-command as --database-url's")
	fs.StringVar(&appName, "application-name", "outbox-relay", "application_name of the relay's PostgreSQL sessions")
	fs.StringVar(&workerID, "worker-id", app.DefaultWorkerID(), "the poller's identity in claimed_by; unique per running relay")
	fs.DurationVar(&lease, "lease", poller.DefaultLease, "how long a poller claim is held; must exceed --ack-timeout")
	fs.IntVar(&maxAttempts, "max-attempts", poller.DefaultMaxAttempts, "publish attempts of a row before the poller fails it (dead letter)")
	fs.DurationVar(&backoffMin, "backoff-min", poller.DefaultBackoffMin, "retry delay of the first failed attempt (full jitter, doubling)")
	fs.DurationVar(&backoffMax, "backoff-max", poller.DefaultBackoffMax, "upper bound of the retry delay")
	fs.DurationVar(&pollInterval, "poll-interval", poller.DefaultPollInterval, "pause between poller claims when the last batch was not full (±50% jitter)")
	fs.IntVar(&pollBatch, "poll-batch", poller.DefaultBatch, "rows per poller claim")
	fs.IntVar(&pollPipeline, "poll-pipeline", poller.DefaultPipeline, "claimed batches the poller keeps in flight: the next claim runs while earlier batches wait for their acks (1: one at a time)")
	fs.DurationVar(&statsInterval, "stats-interval", app.DefaultStatsInterval, "how often the rows-by-state and oldest-eligible metrics are read from the table (one scan of it; 0: never)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := checkRunRanges(
		[]intRange{{"max-attempts", maxAttempts}, {"poll-batch", pollBatch}, {"poll-pipeline", pollPipeline},
			{"max-in-flight-bytes", maxInFlightBytes}, {"max-buffered-bytes", maxBufferedBytes}, {"stream-replicas", replicas}},
		[]durationRange{{"status-interval", statusInterval, 0}, {"drain-timeout", drainTimeout, 0},
			{"poll-interval", pollInterval, 0}, {"backoff-min", backoffMin, 0}, {"backoff-max", backoffMax, 0},
			{"deadline-margin", deadlineMargin, maxDeadlineMargin}},
	); err != nil {
		return err
	}
	if lease <= 0 {
		return fmt.Errorf("--lease %s: must be longer than --ack-timeout %s, or a claim expires while its publish is still waiting for the ack", lease, ackTimeout)
	}
	log, err := c.log.Logger(stderr)
	if err != nil {
		return err
	}
	o, err := c.options()
	if err != nil {
		return err
	}
	o.AllowStreams = allowStreams
	o.Ordering, o.DeadlineMargin = ordering, deadlineMargin
	o.StandbySlots, o.FailoverSlot = standbySlots, failoverSlot
	o.DuplicateWindow, o.StreamReplicas, o.AckTimeout, o.NoCreateStream = dupWindow, replicas, ackTimeout, !createStream
	o.DeadlineTTL, o.NATSMonitorURL = deadlineTTL, natsMonitorURL
	if readBackLimit < 0 {
		return fmt.Errorf("--readback-limit %d: must be 0 (off) or more", readBackLimit)
	}
	o.ReadBackLimit = readBackLimit
	if lostCheck < 0 {
		return fmt.Errorf("--lost-check-interval %s: must be 0 (only at session starts) or more", lostCheck)
	}
	o.LostCheckInterval = lostCheck
	if lostCheck == 0 {
		o.LostCheckInterval = -1
	}
	if readBackLimit == 0 {
		o.ReadBackLimit = -1
	}
	o.AtomicTransactions, o.AtomicBatchMax = atomicTx, atomicBatchMax
	o.MaxInFlight, o.MaxInFlightBytes, o.MaxBufferedBytes = maxInFlight, maxInFlightBytes, maxBufferedBytes
	o.StatusInterval, o.DrainTimeout = statusInterval, drainTimeout
	o.Linger, o.AdaptiveProcs = linger, adaptiveProcs
	if linger == 0 {
		o.Linger = -1
	}
	if linger < 0 {
		return errors.New("--linger " + linger.String() + ": must be 0 or more")
	}
	o.HTTPAddr, o.AppName, o.StatsInterval, o.ReplicationURL = httpAddr, appName, statsInterval, replicationURL
	if consoleOpts.Enabled && httpAddr == "" {
		return errors.New("--console needs --http-addr: the console is served on it under /ui/")
	}
	o.Console = consoleOpts
	o.WorkerID, o.Lease, o.MaxAttempts = workerID, lease, maxAttempts
	o.BackoffMin, o.BackoffMax, o.PollInterval, o.PollBatch = backoffMin, backoffMax, pollInterval, pollBatch
	o.PollPipeline = pollPipeline
	tuneMemoryLimit(maxBufferedBytes)
	return app.Run(ctx, o, log)
}

// maxDeadlineMargin bounds --deadline-margin. The margin covers a publish and
// its ack, which --ack-timeout (10s) bounds; a day leaves room for a policy of
// "do not start work with less than N hours left", while a larger value is a
// slip of the unit (1000000h) that would end every row whose deadline lies
// within it expired (terminal) instead of published.
const maxDeadlineMargin = 24 * time.Hour

// intRange and durationRange are run flags whose zero app.Options takes as
// "use the default": a library caller may leave the field unset, but each of
// these flags shows a non-zero default, so a 0 here was typed (or set in
// OUTBOX_RELAY_*) and silently running with something else would hide the
// mistake. They are refused as --max-in-flight 0 is, before anything connects.
type intRange struct {
	name string
	v    int
}

type durationRange struct {
	name string
	v    time.Duration
	max  time.Duration // 0: no maximum
}

func checkRunRanges(ints []intRange, durations []durationRange) error {
	for _, f := range ints {
		if f.v < 1 {
			return fmt.Errorf("--%s %d: must be at least 1", f.name, f.v)
		}
	}
	for _, f := range durations {
		switch {
		case f.max > 0 && (f.v <= 0 || f.v > f.max):
			return fmt.Errorf("--%s %s: must be more than 0 and at most %s", f.name, f.v, f.max)
		case f.v <= 0:
			return fmt.Errorf("--%s %s: must be more than 0", f.name, f.v)
		}
	}
	return nil
}
