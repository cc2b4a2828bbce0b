// Package metrics defines the relay's Prometheus metrics, all prefixed
// outbox_relay_, on a registry of their own so tests and several relays in
// one process never collide.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Metrics is the relay's instrumentation. A nil *Metrics is not allowed;
// use New.
type Metrics struct {
	Registry *prometheus.Registry

	Published        *prometheus.CounterVec // path (cdc, poller), result (ok, duplicate, rejected, error)
	Duplicates       prometheus.Counter
	CommitToAck      prometheus.Histogram
	ConfirmedLSN     prometheus.Gauge
	WatermarkLSN     prometheus.Gauge
	ServerWALEnd     prometheus.Gauge
	SlotLagBytes     prometheus.Gauge
	InFlight         prometheus.Gauge
	InFlightBytes    prometheus.Gauge
	BufferedBytes    prometheus.Gauge
	Handoffs         *prometheus.CounterVec // reason (delayed, rejected, deadline, held): the values internal/relay passes
	SettleRetries    prometheus.Counter
	Sessions         *prometheus.CounterVec // result (started, error, fenced)
	SlotOwner        prometheus.Gauge
	Claims           prometheus.Counter
	StaleCompletions *prometheus.CounterVec // op (complete, renew, reschedule, fail)
	Failures         *prometheus.CounterVec // class (rejected, uncertain), reason
	RowsByState      *prometheus.GaugeVec
	OldestEligible   prometheus.Gauge
	SlotLagSeconds   prometheus.Gauge
	// DefaultPartitionRows: rows in a partitioned table's DEFAULT partition
	// (-1 while the keeper could not create partitions).
	DefaultPartitionRows prometheus.Gauge
	// GoMaxProcs: the Ps the relay's Go code runs on now (run
	// --adaptive-procs: one at a trickle, the default once busy).
	GoMaxProcs        prometheus.Gauge
	Role              *prometheus.GaugeVec // role: 1 for the CDC path's current role
	SlotsCreated      prometheus.Counter
	DeadLetters       *prometheus.CounterVec // class: rows the poller moved to failed
	UncertainResolved *prometheus.CounterVec // outcome: uncertain rows looked up in the stream before a republish
	LeaseRenewals     prometheus.Counter
	BackfilledRows    prometheus.Counter
	SlotInvalidations prometheus.Counter
	Expired           *prometheus.CounterVec // path: rows that ended expired (G13)
	BlockedAggregates prometheus.Gauge       // aggregates whose rows wait behind a row with the poller or dead-lettered (G12)

	StandbyLagBytes    *prometheus.GaugeVec   // slot: WAL the standby has not flushed yet (G14)
	StandbySlotMissing *prometheus.GaugeVec   // slot: 1 when --standby-slot names no slot here
	StandbyGated       *StandbyGated          // path: how long delivery has waited for the standbys now (held.go)
	FailoverPath       *prometheus.CounterVec // path: how a session found its slot after a promotion
	BrokerContract     *prometheus.GaugeVec   // check, level: 1 while the stream or server falls short of that check (G21)
	// The read-back of a session start (G18): rows of the replay found
	// already stored (not published again), messages read, the last
	// read's duration.
	ReadBackFound    prometheus.Counter
	BrokerLost       prometheus.Counter
	ReadBackMessages prometheus.Counter
	ReadBackSeconds  prometheus.Gauge
	AtomicBatches    *prometheus.CounterVec // result (stored, refused): atomic batches of the CDC path (G20)
	AtomicSplit      prometheus.Counter     // transactions published as more than one atomic batch (G20)
}

// New registers every metric on a fresh registry, with Go and process
// collectors.
func New() *Metrics {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	f := func(c prometheus.Collector) { reg.MustRegister(c) }
	m := &Metrics{Registry: reg}
	m.Published = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_messages_published_total", Help: "Publish outcomes by path (cdc, poller) and result (ok, duplicate, rejected, error).",
	}, []string{"path", "result"})
	m.Duplicates = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_duplicate_acks_total", Help: "PubAcks that JetStream marked duplicate (already stored under the same Nats-Msg-Id).",
	})
	m.CommitToAck = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "outbox_relay_commit_to_ack_seconds", Help: "Time from the row's transaction commit to the broker's ack (CDC path).",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
	})
	m.ConfirmedLSN = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_slot_confirmed_lsn", Help: "Last position confirmed to the slot, as a byte offset.",
	})
	m.WatermarkLSN = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_watermark_lsn", Help: "Position of the last watermark this instance recorded (--on-publish none, G17), as a byte offset: 'ready' rows committed before it are published.",
	})
	m.ServerWALEnd = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_server_wal_end_lsn", Help: "Newest server WAL position the stream heard of, as a byte offset.",
	})
	m.SlotLagBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_slot_lag_bytes", Help: "Server WAL end minus the confirmed position: WAL the slot holds.",
	})
	m.InFlight = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_in_flight_messages", Help: "Messages published and not yet acked.",
	})
	m.InFlightBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_in_flight_bytes", Help: "Bytes published and not yet acked.",
	})
	m.BufferedBytes = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_buffered_bytes", Help: "Bytes of decoded rows the CDC path holds (--max-buffered-bytes bounds them; at the bound reading WAL waits).",
	})
	m.Handoffs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_handoffs_total", Help: "Rows the CDC path handed to the poller, by reason (delayed, rejected, deadline, held).",
	}, []string{"reason"})
	m.SettleRetries = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_settle_retries_total", Help: "Marks that found their row not yet visible (streamed before visible) and were retried.",
	})
	m.Sessions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_replication_sessions_total", Help: "Replication sessions started, ended in error (reconnects), and fenced (ended because WAL read late came from a walsender that no longer held the slot: another instance streams it).",
	}, []string{"result"})
	m.SlotOwner = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_slot_owner", Help: "1 while this instance streams the slot, 0 while standby or reconnecting.",
	})
	m.Claims = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_poller_claims_total", Help: "Rows claimed by the poller.",
	})
	m.StaleCompletions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_poller_stale_claims_total", Help: "Guarded updates that matched zero rows because the claim expired or was superseded.",
	}, []string{"op"})
	m.Failures = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_failures_total", Help: "Failed publish attempts by class (rejected, uncertain) and reason.",
	}, []string{"class", "reason"})
	m.RowsByState = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_relay_rows", Help: "Outbox rows by state.",
	}, []string{"state"})
	m.OldestEligible = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_oldest_eligible_age_seconds", Help: "Age of the oldest row that is due and not published.",
	})
	m.SlotLagSeconds = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_slot_lag_seconds", Help: "Age (from its commit time) of the oldest outbox transaction streamed and not yet confirmed; 0 when caught up.",
	})
	m.DefaultPartitionRows = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_default_partition_rows", Help: "Partitioned table: rows in its DEFAULT partition, rows that found no partition of their own (0 normally; prune never drops them); -1 when the last attempt to create partitions ahead failed.",
	})
	m.GoMaxProcs = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_gomaxprocs", Help: "GOMAXPROCS the relay runs with now: with --adaptive-procs one while it uses less than a third of a core, GOMAXPROCS's default once it uses more than three quarters of one.",
	})
	m.Role = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_relay_role", Help: "1 for the CDC path's current role (starting, active, standby, reconnecting), 0 for the others.",
	}, []string{"role"})
	m.SlotsCreated = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_slots_created_total", Help: "Replication slots this instance created (first start, dropped or invalidated slot); each is followed by a backfill.",
	})
	m.UncertainResolved = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_uncertain_resolved_total", Help: "Rows whose last attempt was uncertain, looked up in the stream before the poller published them again, by outcome: found (settled as published, not sent again), not_found (published), inconclusive (the lookup hit its bound: published, repeats left to the duplicate window), lookup_failed (the lookup failed: the batch given back unpublished, looked up again at its next claim).",
	}, []string{"outcome"})
	m.DeadLetters = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_dead_letters_total", Help: "Rows the poller moved to failed, by class (rejected, uncertain).",
	}, []string{"class"})
	m.LeaseRenewals = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_poller_lease_renewals_total", Help: "Leases the poller extended while a batch waited for acks.",
	})
	m.BackfilledRows = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_backfilled_rows_total", Help: "Rows committed before the slot existed that were handed to the poller when the slot was created.",
	})
	m.SlotInvalidations = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_slot_invalidations_total", Help: "Times the slot was found invalidated (wal_status lost) and re-created.",
	})
	m.Expired = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_expired_total", Help: "Rows that ended expired because their business deadline passed before they were published, each counted once, when the deadline sweep moves it (path=\"poller\"; the CDC path hands such rows over, counted in outbox_relay_handoffs_total{reason=\"deadline\"}).",
	}, []string{"path"})
	m.BlockedAggregates = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_blocked_aggregates", Help: "Aggregates whose later rows wait behind a row with the poller or dead-lettered (--ordering aggregate); counted among the first 10000 held aggregates (fewer on a partitioned table: store.BlockedLookAt), so a lower bound past that.",
	})
	m.StandbyLagBytes = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_relay_standby_lag_bytes", Help: "WAL the standby behind each --standby-slot has not flushed yet; delivery waits for it (G14).",
	}, []string{"slot"})
	m.StandbySlotMissing = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_relay_standby_slot_missing", Help: "1 when a --standby-slot names no physical slot on the connected server (it then gates nothing).",
	}, []string{"slot"})
	m.StandbyGated = newStandbyGated()
	m.FailoverPath = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_failover_path_total", Help: "Sessions that found the slot a synced failover slot after a promotion (slot_survived); a slot re-created instead counts in outbox_relay_slots_created_total.",
	}, []string{"path"})
	m.BrokerContract = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "outbox_relay_broker_contract", Help: "1 for each check of the broker contract (G21) the stream or server falls short of, as found at the last session's start, by check and level (warn, refuse); docs/deploy.md lists the checks.",
	}, []string{"check", "level"})
	m.BrokerLost = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_broker_lost_total", Help: "Messages the broker acknowledged and then lost (its stream ends below sequences the relay recorded, G19): under --on-publish mark the rows are handed back to the poller and published again; under none and delete they are counted and logged only.",
	})
	m.ReadBackFound = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_readback_found_total", Help: "Replayed rows a session start found already stored in the stream (published before a restart, a takeover or a reconnect) and settled with their stored sequence instead of publishing them again (G18).",
	})
	m.ReadBackMessages = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_readback_messages_total", Help: "Message headers read back from the stream at session starts, to find the replayed rows already stored (G18).",
	})
	m.ReadBackSeconds = prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "outbox_relay_readback_seconds", Help: "How long the last session start's read-back of the stream took (G18).",
	})
	m.AtomicBatches = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outbox_relay_atomic_batches_total", Help: "Atomic batches of the CDC path (--atomic-transactions, G20) by the broker's answer: stored (whole), refused (whole, nothing stored: its rows were published again one by one). A transaction of one row goes as a plain message, not counted here.",
	}, []string{"result"})
	m.AtomicSplit = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "outbox_relay_atomic_split_transactions_total", Help: "Transactions too large for one atomic batch (--atomic-batch-max rows, or the bytes of --max-in-flight-bytes), published as consecutive batches, each stored whole (G20).",
	})
	for _, c := range []prometheus.Collector{m.GoMaxProcs, m.BrokerLost, m.AtomicBatches, m.AtomicSplit, m.ReadBackFound, m.ReadBackMessages, m.ReadBackSeconds, m.BrokerContract, m.FailoverPath, m.StandbyLagBytes, m.StandbySlotMissing, m.StandbyGated, m.Expired, m.UncertainResolved, m.BlockedAggregates, m.SlotLagSeconds, m.DefaultPartitionRows, m.Role, m.SlotsCreated, m.DeadLetters, m.LeaseRenewals, m.BackfilledRows, m.SlotInvalidations, m.Published, m.Duplicates, m.CommitToAck, m.ConfirmedLSN, m.WatermarkLSN, m.ServerWALEnd,
		m.SlotLagBytes, m.InFlight, m.InFlightBytes, m.BufferedBytes, m.Handoffs, m.SettleRetries, m.Sessions, m.SlotOwner, m.Claims,
		m.StaleCompletions, m.Failures, m.RowsByState, m.OldestEligible} {
		f(c)
	}
	return m
}
