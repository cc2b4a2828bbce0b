// Package inbox applies each message's effect once, in the consumer's own
// PostgreSQL database, however often JetStream delivers it.
//
// outbox-relay delivers at least once: a relay crash, a lost ack or a
// redrive can publish a row again, and JetStream drops the repeat only inside
// the stream's duplicate window (Nats-Msg-Id). A consumer crash between its
// work and its ack makes JetStream redeliver too. The inbox closes the gap on
// the receiving side: in one transaction it records (consumer, Nats-Msg-Id,
// sha256 of the payload, as Payload reads it in any of the relay's message
// formats) in an inbox table with a unique key, runs the handler with that
// same transaction, and commits; only then does it ack.
//
//	in, _ := inbox.New(pool, inbox.Config{Consumer: "billing"})
//	cons.Consume(in.Wrap(ctx, func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
//		_, err := tx.Exec(ctx, `INSERT INTO invoices ...`)
//		return err
//	}))
//
// What each delivery does:
//
//   - first delivery of a message ID: the handler runs; its writes and the
//     inbox row commit together, then the message is acked (DoubleAck, which
//     waits for the server). A crash before the commit leaves nothing; a
//     crash after it leaves the inbox row, and the redelivery is a duplicate.
//   - a repeat with the same payload hash: nothing is written, the message is
//     acked.
//   - a repeat with a different payload hash: a producer reused a work_id for
//     another intention, or the message is forged. It is never applied: Term
//     with a reason, an error log, Config.OnReject and Stats.Rejected.
//   - no Nats-Msg-Id header: rejected the same way; without an identity
//     nothing can be deduplicated. So is a structured CloudEvent whose
//     envelope cannot be read (malformed_event).
//   - the handler returns an error: rollback, and NakWithDelay with a delay
//     doubling from the delivery count (Config.BackoffMin..BackoffMax), up to
//     Config.MaxDeliveries deliveries, then Term with the error logged. An
//     error wrapping ErrRejected is terminated at once.
//   - a database failure (begin, insert, commit): rollback and
//     NakWithDelay, never Term, since it says nothing about the message. A
//     commit whose outcome is unknown is safe to redeliver: the inbox row
//     decides.
//
// Two instances racing on one message (a redelivery after AckWait while the
// first is still working) are serialised by the inbox row's unique key: the
// second insert waits for the first transaction and then sees a duplicate,
// or, if the first rolled back, applies the message itself.
//
// Order and deadlines. Config.Order chooses what a message carrying an
// aggregate (Outbox-Aggregate-Type, Outbox-Aggregate-Id, Outbox-Sequence)
// means to this consumer: InSequence (a history: sequence n is applied only
// after n-1, an early one waits by being redelivered, a gap is reported after
// Config.GapAfter) or LatestWins (a projection: a newer sequence is applied,
// an older one is recorded as superseded and acked). Config.EnforceDeadline
// refuses a message whose Outbox-Expires-At has passed on the database's
// clock. Both decide in the handler's transaction, against a per-aggregate
// position row locked there, so what is decided and what is applied commit
// together; see Order.
//
// The guarantee is effectively-once for the effects written through the
// handler's transaction. A call to another system from the handler is
// outside it and may repeat; pass the message ID to that system as its
// idempotency key.
package inbox

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/retry"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Handler applies one message's effect with tx, the transaction that also
// records the message in the inbox. It must not commit or roll back tx. An
// error rolls everything back and the message is redelivered; an error
// wrapping ErrRejected terminates it instead.
type Handler func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error

// ErrRejected, wrapped in a handler's error, says the message can never be
// applied (invalid, stale): the inbox rolls back and terminates it at once
// instead of redelivering it.
var ErrRejected = errors.New("inbox: message rejected")

// Config configures an Inbox.
type Config struct {
	// Consumer names this consumer in the inbox key; use the durable
	// consumer's name. Consumers with different names apply the same message
	// independently. Required.
	Consumer string
	// Table is the inbox table, "name" or "schema.name" (default "inbox"),
	// created by Migrate with the same name.
	Table string
	// MaxDeliveries: a handler error on this delivery or a later one
	// terminates the message (default 10). Give the JetStream consumer a
	// higher MaxDeliver (or -1), or JetStream stops first without telling.
	MaxDeliveries int
	// BackoffMin and BackoffMax bound the redelivery delay after a failure:
	// BackoffMin doubled for every earlier delivery, with jitter (defaults 1s
	// and 5m).
	BackoffMin, BackoffMax time.Duration
	// AckTimeout bounds the wait for the server's ack reply (default 5s).
	AckTimeout time.Duration
	// TxOptions are used to begin each message's transaction. The default,
	// READ COMMITTED, lets a racing second delivery see the first one's
	// committed inbox row; under REPEATABLE READ or SERIALIZABLE it gets a
	// serialization failure instead and is redelivered.
	TxOptions pgx.TxOptions
	// Logger receives rejections and gaps (error), retries, expiries and
	// skips (warn), and duplicates, waits and superseded messages (debug).
	// Records carry component=inbox and consumer, and for a message its
	// msg_id, subject, stream_seq and delivered count. Nil: nothing is
	// logged (Stats, OnReject and OnGap still report).
	Logger *slog.Logger
	// OnReject, when set, is called for every message the inbox terminates,
	// expired ones included.
	OnReject func(Rejection)

	// Order is the rule for messages that carry an aggregate: Unordered (the
	// default: the headers are ignored), InSequence or LatestWins. Messages
	// without the aggregate headers are applied unordered under any rule.
	// Requires the positions table (Migrate).
	Order Order
	// GapAfter: under InSequence, once a later sequence of an aggregate has
	// waited this long for a missing one (by the database's clock), the gap
	// is reported, once per gap: an error log, Stats.Gaps and OnGap
	// (default 1m). The later sequences keep waiting.
	GapAfter time.Duration
	// OnGap, when set, is called for every gap reported.
	OnGap func(Gap)
	// EnforceDeadline refuses a message whose Outbox-Expires-At is not in
	// the future on the database's clock when its turn comes: recorded in
	// the inbox as expired, terminated, never applied.
	EnforceDeadline bool
}

// Rejection describes a terminated message.
type Rejection struct {
	MsgID     string
	Subject   string
	StreamSeq uint64
	// Reason is short and stable, for metrics: "no_msg_id",
	// "payload_mismatch", "rejected" (the handler said so, e.g. ErrStale),
	// "max_deliveries", "malformed_aggregate", "malformed_expires_at",
	// "malformed_event" (an application/cloudevents+json message whose
	// envelope Payload cannot read) or "expired".
	Reason string
	Err    error
}

// Outcome is what Process did with a message.
type Outcome uint8

const (
	// Applied: the handler ran and its transaction committed.
	Applied Outcome = iota + 1
	// Duplicate: the message was applied before; acked, nothing written.
	Duplicate
	// Retrying: rolled back and nak'd with a delay.
	Retrying
	// Rejected: terminated and never applied.
	Rejected
	// Waiting: InSequence only. An earlier sequence of the message's
	// aggregate is not applied yet; nothing was applied and the message was
	// nak'd with a delay, to come back until its turn.
	Waiting
	// Superseded: the aggregate is already at this sequence or past it
	// (LatestWins: a newer version was applied; InSequence: a repeat the
	// inbox no longer knows, or a sequence an operator skipped). Recorded in
	// the inbox with disposition 'superseded', acked, not applied.
	Superseded
	// Expired: EnforceDeadline found its deadline passed. Recorded with
	// disposition 'expired', terminated, not applied.
	Expired
)

func (o Outcome) String() string {
	switch o {
	case Applied:
		return "applied"
	case Duplicate:
		return "duplicate"
	case Retrying:
		return "retrying"
	case Rejected:
		return "rejected"
	case Waiting:
		return "waiting"
	case Superseded:
		return "superseded"
	case Expired:
		return "expired"
	}
	return fmt.Sprintf("Outcome(%d)", uint8(o))
}

// Stats counts outcomes since New.
type Stats struct {
	Applied, Duplicates, Retried, Rejected uint64
	// AckFailed counts acks that failed after a commit; JetStream redelivers
	// those after AckWait and the inbox drops them as duplicates.
	AckFailed uint64
	// Waited counts deliveries nak'd because an earlier sequence was not
	// applied yet (InSequence); Gaps counts the gaps reported.
	Waited, Gaps uint64
	// Superseded counts messages recorded as superseded (Outcome
	// Superseded), Expired those refused for their deadline. Neither is in
	// Rejected.
	Superseded, Expired uint64
}

// Inbox applies messages once for one consumer.
type Inbox struct {
	pool *pgxpool.Pool
	cfg  Config
	log  *slog.Logger
	t    tableName

	insertSQL, storedSQL, fenceSQL, fenceReadSQL, pruneSQL string

	// extended: Order or EnforceDeadline is set, so the inbox row records
	// the aggregate, the deadline and the disposition, which needs the
	// columns Migrate added with them. Without it the statements are those
	// of older inbox tables, which keep working unmigrated.
	extended bool

	// Statements of the ordering rules and deadlines (order.go).
	dispositionSQL, deadlineSQL, posLockSQL, posInsertSQL, posAdvanceSQL string
	posWaitSQL, posGapSQL, skipSQL, posReadSQL                           string

	applied, duplicates, retried, rejected, ackFailed atomic.Uint64
	waited, gaps, superseded, expired                 atomic.Uint64

	// afterCommit is a test hook between the commit and the ack, where a
	// crash leaves a committed effect with an unacked message.
	afterCommit func()
}

// New returns an Inbox working on pool's database. The tables must exist
// (Migrate).
func New(pool *pgxpool.Pool, cfg Config) (*Inbox, error) {
	if pool == nil {
		return nil, errors.New("inbox.New: nil pool")
	}
	if cfg.Consumer == "" {
		return nil, errors.New("inbox.New: Config.Consumer is empty; name the consumer (its durable name), since it is part of the inbox key")
	}
	if cfg.Table == "" {
		cfg.Table = "inbox"
	}
	t, err := parseTable(cfg.Table)
	if err != nil {
		return nil, fmt.Errorf("inbox.New: %w", err)
	}
	if cfg.MaxDeliveries <= 0 {
		cfg.MaxDeliveries = 10
	}
	if cfg.BackoffMin <= 0 {
		cfg.BackoffMin = time.Second
	}
	if cfg.BackoffMax <= 0 {
		cfg.BackoffMax = 5 * time.Minute
	}
	if cfg.BackoffMax < cfg.BackoffMin {
		return nil, fmt.Errorf("inbox.New: BackoffMax %v is below BackoffMin %v", cfg.BackoffMax, cfg.BackoffMin)
	}
	if cfg.AckTimeout <= 0 {
		cfg.AckTimeout = 5 * time.Second
	}
	switch cfg.Order {
	case Unordered, InSequence, LatestWins:
	default:
		return nil, fmt.Errorf("inbox.New: Config.Order %v is not Unordered, InSequence or LatestWins", cfg.Order)
	}
	if cfg.GapAfter <= 0 {
		cfg.GapAfter = time.Minute
	}
	in := &Inbox{pool: pool, cfg: cfg, t: t}
	if cfg.Logger != nil {
		in.log = cfg.Logger
	} else {
		in.log = slog.New(slog.DiscardHandler)
	}
	in.log = in.log.With(slog.String("component", "inbox"), slog.String("consumer", cfg.Consumer))
	inbox, fences := t.inbox(), t.fences()
	in.insertSQL = `INSERT INTO ` + inbox + ` (consumer, message_id, payload_sha256, subject, stream_seq)
		VALUES ($1, $2, $3, $4, $5) ON CONFLICT (consumer, message_id) DO NOTHING`
	in.storedSQL = `SELECT payload_sha256 FROM ` + inbox + ` WHERE consumer = $1 AND message_id = $2`
	in.fenceSQL = `INSERT INTO ` + fences + ` AS f (resource, generation) VALUES ($1, $2)
		ON CONFLICT (resource) DO UPDATE SET generation = EXCLUDED.generation, updated_at = clock_timestamp()
		WHERE f.generation <= EXCLUDED.generation
		RETURNING generation`
	in.fenceReadSQL = `SELECT generation FROM ` + fences + ` WHERE resource = $1`
	in.pruneSQL = `DELETE FROM ` + inbox + ` WHERE (consumer, message_id) IN (
		SELECT consumer, message_id FROM ` + inbox + `
		WHERE consumer = $1 AND received_at < clock_timestamp() - make_interval(secs => $2)
		LIMIT $3)`
	in.extended = cfg.Order != Unordered || cfg.EnforceDeadline
	if in.extended {
		in.insertSQL = `INSERT INTO ` + inbox + ` (consumer, message_id, payload_sha256, subject, stream_seq,
			aggregate_type, aggregate_id, aggregate_seq, expires_at)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (consumer, message_id) DO NOTHING`
		in.storedSQL = `SELECT payload_sha256, disposition FROM ` + inbox + ` WHERE consumer = $1 AND message_id = $2`
	}
	in.prepareOrder()
	return in, nil
}

// Stats returns the counts since New.
func (in *Inbox) Stats() Stats {
	return Stats{Applied: in.applied.Load(), Duplicates: in.duplicates.Load(), Retried: in.retried.Load(),
		Rejected: in.rejected.Load(), AckFailed: in.ackFailed.Load(),
		Waited: in.waited.Load(), Gaps: in.gaps.Load(), Superseded: in.superseded.Load(), Expired: in.expired.Load()}
}

// Wrap returns a jetstream.MessageHandler for Consume (or for messages from
// Fetch) that runs Process with ctx. Process logs what happens; its result is
// dropped here.
func (in *Inbox) Wrap(ctx context.Context, h Handler) jetstream.MessageHandler {
	return func(msg jetstream.Msg) { _, _ = in.Process(ctx, msg, h) }
}

// delivery is what the inbox knows about one delivery.
type delivery struct {
	// ctx is Process's, handed to the log handler (trace IDs and the like).
	ctx       context.Context
	msg       jetstream.Msg
	id        string
	seq       uint64
	delivered uint64
}

// log writes one record about the delivery at level, with its identity
// first and then attrs.
func (in *Inbox) logDelivery(d delivery, level slog.Level, msg string, attrs ...slog.Attr) {
	if !in.log.Enabled(d.ctx, level) {
		return
	}
	all := make([]slog.Attr, 0, 4+len(attrs))
	all = append(all, slog.String("msg_id", d.id), slog.String("subject", d.msg.Subject()),
		slog.Uint64("stream_seq", d.seq), slog.Uint64("delivered", d.delivered))
	in.log.LogAttrs(d.ctx, level, msg, append(all, attrs...)...)
}

// Process applies msg with h once, then acks, naks or terminates msg as the
// package documentation describes, and says which. The error is the cause of
// a retry or rejection (nil for Applied, Duplicate, Waiting and Superseded,
// and for a failed ack after a commit, which is logged and counted only).
func (in *Inbox) Process(ctx context.Context, msg jetstream.Msg, h Handler) (Outcome, error) {
	d := delivery{ctx: ctx, msg: msg, id: msg.Headers().Get(wire.HeaderMsgID), delivered: 1}
	if md, err := msg.Metadata(); err == nil {
		d.seq, d.delivered = md.Sequence.Stream, md.NumDelivered
	}
	if d.id == "" {
		return in.reject(d, "no_msg_id", fmt.Errorf("message on %s (stream seq %d) has no %s header: without an identity it cannot be deduplicated; publish it through the outbox or set the header",
			msg.Subject(), d.seq, wire.HeaderMsgID))
	}
	var (
		agg      Aggregate
		ordered  bool
		deadline time.Time
		expiring bool
		err      error
	)
	if in.cfg.Order != Unordered {
		if agg, ordered, err = AggregateOf(msg); err != nil {
			return in.reject(d, "malformed_aggregate", fmt.Errorf("message %q: %w", d.id, err))
		}
	}
	if in.cfg.EnforceDeadline {
		if deadline, expiring, err = ExpiresAt(msg); err != nil {
			return in.reject(d, "malformed_expires_at", fmt.Errorf("message %q: %w", d.id, err))
		}
	}
	// The payload, not the data: in structured CloudEvents mode the data is
	// an envelope, and the same row delivered in another format is the
	// same message.
	payload, err := Payload(msg)
	if err != nil {
		return in.reject(d, "malformed_event", fmt.Errorf("message %q: %w", d.id, err))
	}
	sum := sha256.Sum256(payload)

	tx, err := in.pool.BeginTx(ctx, in.cfg.TxOptions)
	if err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: begin transaction for %q: %w", d.id, err))
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // no-op after commit
	var pos position
	if ordered {
		// Locked before the inbox row and held to the commit: every
		// delivery of this aggregate, on any instance, decides and applies
		// one at a time, so n+1 cannot pass n by racing it.
		if pos, err = in.lockPosition(ctx, tx, agg); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: lock position of %s for %q: %w", agg, d.id, err))
		}
		if in.cfg.Order == InSequence && agg.Seq > pos.applied+1 {
			return in.wait(ctx, tx, d, agg, pos)
		}
	}
	args := []any{in.cfg.Consumer, d.id, sum[:], msg.Subject(), int64(d.seq)}
	if in.extended {
		// NULLs unless the rule or the deadline is in force for this message:
		// the row records what was decided on, no more.
		var aggType, aggID *string
		var aggSeq *int64
		var expires *time.Time
		if ordered {
			aggType, aggID, aggSeq = &agg.Type, &agg.ID, &agg.Seq
		}
		if expiring {
			expires = &deadline
		}
		args = append(args, aggType, aggID, aggSeq, expires)
	}
	tag, err := tx.Exec(ctx, in.insertSQL, args...)
	if err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: record %q in %s: %w", d.id, in.t, err))
	}
	if tag.RowsAffected() == 0 {
		return in.repeat(ctx, tx, d, sum[:])
	}
	if ordered && agg.Seq <= pos.applied {
		return in.supersede(ctx, tx, d, agg, pos)
	}
	if expiring {
		var passed bool
		// The database's clock, in this transaction, right before the
		// effect: the consumer's clock may be off, and the relay decided
		// its side of the deadline on the database's clock too.
		if err := tx.QueryRow(ctx, in.deadlineSQL, deadline).Scan(&passed); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: check deadline %s of %q: %w", deadline.Format(time.RFC3339Nano), d.id, err))
		}
		if passed {
			return in.expire(ctx, tx, d, agg, ordered, deadline)
		}
	}
	if err := h(ctx, tx, msg); err != nil {
		_ = tx.Rollback(context.Background())
		if errors.Is(err, ErrRejected) {
			return in.reject(d, "rejected", fmt.Errorf("handler rejected %q: %w", d.id, err))
		}
		// Under InSequence the delivery count includes the waits, so it says
		// little about how often the handler failed; and terminating the
		// message would only turn it into a gap that holds the aggregate
		// anyway. It is retried, with backoff, until it applies or an
		// operator skips it.
		if d.delivered >= uint64(in.cfg.MaxDeliveries) && !(ordered && in.cfg.Order == InSequence) {
			return in.reject(d, "max_deliveries", fmt.Errorf("handler failed on %q at delivery %d of at most %d, giving up: %w", d.id, d.delivered, in.cfg.MaxDeliveries, err))
		}
		return in.retry(d, true, fmt.Errorf("handler failed on %q: %w", d.id, err))
	}
	if ordered {
		if _, err := tx.Exec(ctx, in.posAdvanceSQL, in.cfg.Consumer, agg.Type, agg.ID, agg.Seq); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: advance position of %s to %d for %q: %w", agg, agg.Seq, d.id, err))
		}
	}
	if err := tx.Commit(ctx); err != nil {
		// Committed or not, a redelivery is safe: the inbox row decides.
		return in.retry(d, false, fmt.Errorf("inbox: commit %q (outcome unknown; a redelivery finds out): %w", d.id, err))
	}
	if in.afterCommit != nil {
		in.afterCommit()
	}
	in.applied.Add(1)
	in.ack(d)
	return Applied, nil
}

// repeat handles a message ID that is already in the inbox.
func (in *Inbox) repeat(ctx context.Context, tx pgx.Tx, d delivery, sum []byte) (Outcome, error) {
	var stored []byte
	disposition := dispositionApplied
	var err error
	if in.extended {
		err = tx.QueryRow(ctx, in.storedSQL, in.cfg.Consumer, d.id).Scan(&stored, &disposition)
	} else {
		err = tx.QueryRow(ctx, in.storedSQL, in.cfg.Consumer, d.id).Scan(&stored)
	}
	_ = tx.Rollback(context.Background())
	if errors.Is(err, pgx.ErrNoRows) {
		// Pruned between the insert and this read: try again soon.
		return in.retry(d, false, fmt.Errorf("inbox: entry for %q vanished while checking a repeat", d.id))
	}
	if err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: read entry of %q: %w", d.id, err))
	}
	if !bytes.Equal(stored, sum) {
		return in.reject(d, "payload_mismatch", fmt.Errorf("message %q arrived again with a different payload (sha256 %s, first applied %s): a producer reused a work_id for another intention, or the message is forged; not applied",
			d.id, hex.EncodeToString(sum[:8]), hex.EncodeToString(stored[:min(8, len(stored))])))
	}
	in.duplicates.Add(1)
	in.logDelivery(d, slog.LevelDebug, "duplicate: already recorded, acking", slog.String("disposition", disposition))
	in.ack(d)
	return Duplicate, nil
}

func (in *Inbox) ack(d delivery) {
	ctx, cancel := context.WithTimeout(context.Background(), in.cfg.AckTimeout)
	defer cancel()
	err := d.msg.DoubleAck(ctx)
	if err == nil || errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
		return
	}
	in.ackFailed.Add(1)
	in.logDelivery(d, slog.LevelWarn, "ack failed after commit; JetStream redelivers after AckWait and the inbox drops the repeat", slog.Any("error", err))
}

// retry rolls nothing back itself (the caller did) and naks with a delay.
// Only handler failures count toward MaxDeliveries; a database outage says
// nothing about the message.
func (in *Inbox) retry(d delivery, handler bool, cause error) (Outcome, error) {
	delay := in.delay(d)
	in.retried.Add(1)
	attrs := []slog.Attr{slog.Any("error", cause), slog.Duration("redeliver_in", delay)}
	if err := d.msg.NakWithDelay(delay); err != nil {
		attrs = append(attrs, slog.Any("nak_error", err))
	}
	if handler {
		in.logDelivery(d, slog.LevelWarn, "handler failed; rolled back, redelivering", attrs...)
	} else {
		in.logDelivery(d, slog.LevelWarn, "inbox database step failed; rolled back, redelivering", attrs...)
	}
	return Retrying, cause
}

// delay is how long a nak'd delivery stays away: doubling per earlier
// delivery, never at once, so messages failing (or waiting) together do not
// come back together.
func (in *Inbox) delay(d delivery) time.Duration {
	return retry.Equal(int(min(d.delivered, 64)), in.cfg.BackoffMin, in.cfg.BackoffMax, nil)
}

func (in *Inbox) reject(d delivery, reason string, cause error) (Outcome, error) {
	in.rejected.Add(1)
	attrs := []slog.Attr{slog.String("reason", reason), slog.Any("error", cause)}
	if err := d.msg.TermWithReason(reason); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
		attrs = append(attrs, slog.Any("term_error", err))
	}
	in.logDelivery(d, slog.LevelError, "message rejected and terminated; not applied", attrs...)
	if in.cfg.OnReject != nil {
		in.cfg.OnReject(Rejection{MsgID: d.id, Subject: d.msg.Subject(), StreamSeq: d.seq, Reason: reason, Err: cause})
	}
	return Rejected, cause
}
