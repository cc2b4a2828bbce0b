package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Order is a consumer's rule for messages of one aggregate. The relay (run
// --ordering aggregate) publishes an aggregate's rows in their sequence, but
// that order does not survive to the effects: concurrent consumer instances
// overtake each other, a failed handler is redelivered after later messages,
// and a row re-published after a broker fault lands after later ones. Which
// rule repairs that depends on what the consumer promises, so the consumer
// chooses:
//
//   - InSequence, for a history that needs every event in order (a ledger,
//     an audit trail, a state machine that must see each transition).
//     Sequence n of an aggregate is applied only after n-1 (1 first); an
//     early message is nak'd with a delay and comes back until its turn,
//     never terminated. A gap (n-1 never arrives: its row was cancelled,
//     failed or expired at the relay, or this consumer rejected it) holds
//     every later sequence of that aggregate; after GapAfter it is reported,
//     and an operator resolves it (a redrive at the relay, or Skip).
//   - LatestWins, for a projection of current state (a read model, a cache,
//     a search index). A sequence above the last applied one is applied,
//     gaps and all; one at or below it is recorded as superseded and acked,
//     not applied.
//
// Both keep a position per (consumer, aggregate) in the positions table and
// lock it in the handler's transaction, so the decision and the effect
// commit together and concurrent instances take an aggregate's messages one
// at a time. Other aggregates never wait. Messages without the aggregate
// headers are applied as they come under either rule.
type Order uint8

const (
	// Unordered ignores the aggregate headers.
	Unordered Order = iota
	// InSequence applies an aggregate's sequences 1, 2, 3, ... in order, each
	// once, waiting for a missing one.
	InSequence
	// LatestWins applies a sequence only if it is newer than the last one
	// applied for its aggregate.
	LatestWins
)

func (o Order) String() string {
	switch o {
	case Unordered:
		return "unordered"
	case InSequence:
		return "in-sequence"
	case LatestWins:
		return "latest-wins"
	}
	return fmt.Sprintf("Order(%d)", uint8(o))
}

// Dispositions of an inbox row: what was decided about the message. Only
// 'applied' ran the handler.
const (
	dispositionApplied    = "applied"
	dispositionSuperseded = "superseded"
	dispositionExpired    = "expired"
)

// ErrExpired is the error of an Expired outcome. It wraps ErrRejected.
var ErrExpired = fmt.Errorf("%w: deadline passed", ErrRejected)

// Aggregate is the business object a message belongs to and its position in
// that object's sequence (headers Outbox-Aggregate-Type, Outbox-Aggregate-Id
// and Outbox-Sequence).
type Aggregate struct {
	Type, ID string
	Seq      int64
}

func (a Aggregate) String() string { return a.Type + "/" + a.ID }

// AggregateOf reads msg's aggregate headers. ok is false when it carries
// none (a row without an aggregate). A partial set, or a sequence that is
// not a positive integer, is an error wrapping ErrRejected: such a message
// cannot be placed in any order, and guessing would apply it out of it.
func AggregateOf(msg jetstream.Msg) (a Aggregate, ok bool, err error) {
	h := msg.Headers()
	a.Type, a.ID = h.Get(wire.HeaderAggregateType), h.Get(wire.HeaderAggregateID)
	seq := h.Get(wire.HeaderSequence)
	if a.Type == "" && a.ID == "" && seq == "" {
		return Aggregate{}, false, nil
	}
	var missing []string
	for _, c := range []struct{ name, v string }{{wire.HeaderAggregateType, a.Type}, {wire.HeaderAggregateID, a.ID}, {wire.HeaderSequence, seq}} {
		if c.v == "" {
			missing = append(missing, c.name)
		}
	}
	if len(missing) > 0 {
		return Aggregate{}, false, fmt.Errorf("%w: aggregate headers incomplete, %s missing (type %q, id %q, sequence %q): the relay sets all three or none",
			ErrRejected, strings.Join(missing, " and "), a.Type, a.ID, seq)
	}
	if a.Seq, err = strconv.ParseInt(seq, 10, 64); err != nil || a.Seq < 1 {
		return Aggregate{}, false, fmt.Errorf("%w: %s header %q of %s is not a positive integer", ErrRejected, wire.HeaderSequence, seq, a)
	}
	return a, true, nil
}

// ExpiresAt reads msg's Outbox-Expires-At header (RFC 3339). ok is false
// when it carries none. An unreadable value is an error wrapping
// ErrRejected: a deadline that cannot be read cannot be kept.
func ExpiresAt(msg jetstream.Msg) (t time.Time, ok bool, err error) {
	v := msg.Headers().Get(wire.HeaderExpiresAt)
	if v == "" {
		return time.Time{}, false, nil
	}
	if t, err = time.Parse(time.RFC3339Nano, v); err != nil {
		return time.Time{}, false, fmt.Errorf("%w: %s header %q is not an RFC 3339 time", ErrRejected, wire.HeaderExpiresAt, v)
	}
	return t, true, nil
}

// Gap is a missing sequence that InSequence reports.
type Gap struct {
	Type, ID string // the aggregate
	// Applied is the last sequence applied; Applied+1 is the one missing.
	Applied int64
	// Waiting is the sequence of the message that found the gap overdue,
	// one of those held behind it; MsgID is its message ID.
	Waiting int64
	MsgID   string
	// Since is when a later sequence first waited at this position
	// (database clock), and Age how long ago that was.
	Since time.Time
	Age   time.Duration
}

// position is an aggregate's row in the positions table, locked.
type position struct {
	applied int64
	// waitingSince: a later sequence first waited here; nil while none did.
	waitingSince *time.Time
	age          time.Duration
	reported     bool
}

func (in *Inbox) prepareOrder() {
	inbox, positions := in.t.inbox(), in.t.positions()
	key := ` WHERE consumer = $1 AND aggregate_type = $2 AND aggregate_id = $3`
	in.dispositionSQL = `UPDATE ` + inbox + ` SET disposition = $3 WHERE consumer = $1 AND message_id = $2`
	in.deadlineSQL = `SELECT clock_timestamp() >= $1::timestamptz`
	in.posLockSQL = `SELECT applied_seq, waiting_since, coalesce(extract(epoch FROM clock_timestamp() - waiting_since), 0)::float8,
			gap_reported_at IS NOT NULL
		FROM ` + positions + key + ` FOR UPDATE`
	in.posInsertSQL = `INSERT INTO ` + positions + ` (consumer, aggregate_type, aggregate_id) VALUES ($1, $2, $3)
		ON CONFLICT (consumer, aggregate_type, aggregate_id) DO NOTHING`
	in.posAdvanceSQL = `UPDATE ` + positions + ` SET applied_seq = $4, updated_at = clock_timestamp(), waiting_since = NULL, gap_reported_at = NULL` + key
	in.posWaitSQL = `UPDATE ` + positions + ` SET waiting_since = clock_timestamp()` + key
	in.posGapSQL = `UPDATE ` + positions + ` SET gap_reported_at = clock_timestamp()` + key
	in.posReadSQL = `SELECT applied_seq FROM ` + positions + key
	in.skipSQL = `INSERT INTO ` + positions + ` AS p (consumer, aggregate_type, aggregate_id, applied_seq,
			skipped_after, skipped_through, skip_reason, skipped_at)
		VALUES ($1, $2, $3, $4, 0, $4, $5, clock_timestamp())
		ON CONFLICT (consumer, aggregate_type, aggregate_id) DO UPDATE SET
			applied_seq = EXCLUDED.applied_seq, updated_at = clock_timestamp(),
			waiting_since = NULL, gap_reported_at = NULL,
			skipped_after = p.applied_seq, skipped_through = EXCLUDED.applied_seq,
			skip_reason = EXCLUDED.skip_reason, skipped_at = EXCLUDED.skipped_at
		WHERE p.applied_seq < EXCLUDED.applied_seq
		RETURNING skipped_after`
}

// lockPosition locks a's position row for the rest of tx, creating it at 0
// for an aggregate this consumer has not seen.
func (in *Inbox) lockPosition(ctx context.Context, tx pgx.Tx, a Aggregate) (position, error) {
	var p position
	for attempt := 0; ; attempt++ {
		var age float64
		err := tx.QueryRow(ctx, in.posLockSQL, in.cfg.Consumer, a.Type, a.ID).Scan(&p.applied, &p.waitingSince, &age, &p.reported)
		if err == nil {
			p.age = time.Duration(age * float64(time.Second))
			return p, nil
		}
		if !errors.Is(err, pgx.ErrNoRows) || attempt > 0 {
			return p, fmt.Errorf("read %s: %w (are the tables migrated? inbox.Migrate or outbox-relay migrate --inbox)", in.t.positionsName(), err)
		}
		// Two first messages of one aggregate insert at once: the second
		// waits for the first's commit and inserts nothing, then both lock
		// the one row.
		if _, err := tx.Exec(ctx, in.posInsertSQL, in.cfg.Consumer, a.Type, a.ID); err != nil {
			return p, fmt.Errorf("create in %s: %w (are the tables migrated? inbox.Migrate or outbox-relay migrate --inbox)", in.t.positionsName(), err)
		}
	}
}

// wait handles an InSequence message that came before its turn: nothing is
// applied, the message is nak'd to come back, and the position remembers
// since when something waits, so that a gap is reported once, after
// GapAfter, whichever instance holds a waiting message then.
func (in *Inbox) wait(ctx context.Context, tx pgx.Tx, d delivery, a Aggregate, p position) (Outcome, error) {
	var stmt string
	report := false
	switch {
	case p.waitingSince == nil:
		stmt = in.posWaitSQL
	case !p.reported && p.age >= in.cfg.GapAfter:
		stmt, report = in.posGapSQL, true
	}
	if stmt != "" {
		if _, err := tx.Exec(ctx, stmt, in.cfg.Consumer, a.Type, a.ID); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: note that sequence %d of %s waits: %w", a.Seq, a, err))
		}
		if err := tx.Commit(ctx); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: note that sequence %d of %s waits: commit: %w", a.Seq, a, err))
		}
	} else {
		_ = tx.Rollback(context.Background())
	}
	in.waited.Add(1)
	delay := in.delay(d)
	attrs := []slog.Attr{slog.String("aggregate", a.String()), slog.Int64("sequence", a.Seq), slog.Int64("applied", p.applied), slog.Duration("redeliver_in", delay)}
	if err := d.msg.NakWithDelay(delay); err != nil {
		attrs = append(attrs, slog.Any("nak_error", err))
	}
	in.logDelivery(d, slog.LevelDebug, "waiting: an earlier sequence of the aggregate is not applied yet", attrs...)
	if report {
		g := Gap{Type: a.Type, ID: a.ID, Applied: p.applied, Waiting: a.Seq, MsgID: d.id, Age: p.age}
		if p.waitingSince != nil {
			g.Since = *p.waitingSince
		}
		in.gaps.Add(1)
		in.logDelivery(d, slog.LevelError,
			fmt.Sprintf("gap: sequence %d of %s has not arrived and later ones have waited %v; they wait on. If it will never come (cancelled, failed or expired at the relay), redrive it there or skip it here (Inbox.Skip)",
				g.Applied+1, a, g.Age.Round(time.Second)),
			slog.String("aggregate", a.String()), slog.Int64("missing", g.Applied+1), slog.Int64("waiting", g.Waiting),
			slog.Time("waiting_since", g.Since), slog.Duration("waited", g.Age))
		if in.cfg.OnGap != nil {
			in.cfg.OnGap(g)
		}
	}
	return Waiting, nil
}

// supersede records a message whose aggregate is already at or past its
// sequence, and acks it: applying it would move a projection back, or apply
// a history's event twice.
func (in *Inbox) supersede(ctx context.Context, tx pgx.Tx, d delivery, a Aggregate, p position) (Outcome, error) {
	if _, err := tx.Exec(ctx, in.dispositionSQL, in.cfg.Consumer, d.id, dispositionSuperseded); err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: record %q as superseded: %w", d.id, err))
	}
	if err := tx.Commit(ctx); err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: commit %q as superseded (outcome unknown; a redelivery finds out): %w", d.id, err))
	}
	in.superseded.Add(1)
	in.logDelivery(d, slog.LevelDebug, "superseded: the aggregate is already at this sequence or past it; recorded, acked, not applied",
		slog.String("aggregate", a.String()), slog.Int64("sequence", a.Seq), slog.Int64("applied", p.applied))
	in.ack(d)
	return Superseded, nil
}

// expire records a message whose deadline passed and terminates it. Under
// InSequence the position moves past it: the consumer itself decided this
// sequence, and holding the later ones behind a refusal would be a gap of
// its own making. Under LatestWins it does not, since the projection does
// not reflect that version.
func (in *Inbox) expire(ctx context.Context, tx pgx.Tx, d delivery, a Aggregate, ordered bool, deadline time.Time) (Outcome, error) {
	if _, err := tx.Exec(ctx, in.dispositionSQL, in.cfg.Consumer, d.id, dispositionExpired); err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: record %q as expired: %w", d.id, err))
	}
	if ordered && in.cfg.Order == InSequence {
		if _, err := tx.Exec(ctx, in.posAdvanceSQL, in.cfg.Consumer, a.Type, a.ID, a.Seq); err != nil {
			return in.retry(d, false, fmt.Errorf("inbox: move position of %s past expired %q: %w", a, d.id, err))
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return in.retry(d, false, fmt.Errorf("inbox: commit %q as expired (outcome unknown; a redelivery finds out): %w", d.id, err))
	}
	in.expired.Add(1)
	cause := fmt.Errorf("%w: message %q expired at %s (database clock); recorded, not applied", ErrExpired, d.id, deadline.UTC().Format(time.RFC3339Nano))
	attrs := []slog.Attr{slog.String("reason", dispositionExpired), slog.Time("expires_at", deadline), slog.Any("error", cause)}
	if err := d.msg.TermWithReason(dispositionExpired); err != nil && !errors.Is(err, jetstream.ErrMsgAlreadyAckd) {
		attrs = append(attrs, slog.Any("term_error", err))
	}
	in.logDelivery(d, slog.LevelWarn, "deadline passed: recorded as expired and terminated; not applied", attrs...)
	if in.cfg.OnReject != nil {
		in.cfg.OnReject(Rejection{MsgID: d.id, Subject: d.msg.Subject(), StreamSeq: d.seq, Reason: dispositionExpired, Err: cause})
	}
	return Expired, cause
}

// Skip moves this consumer's position of an aggregate forward to through,
// as if the sequences up to it were applied, and records reason, the time
// and the previous position in the positions row. It is how an operator
// resolves an InSequence gap that will never be filled: the later sequences
// apply at their next delivery, and a skipped sequence that arrives after
// all is recorded as superseded, not applied. Skip refuses to move a
// position back or to where it already is.
//
// Skip is for a sequence that must not happen. If it still should, redrive
// its row at the relay instead (outbox-relay redrive), and the gap closes
// by itself.
func (in *Inbox) Skip(ctx context.Context, aggregateType, aggregateID string, through int64, reason string) error {
	a := Aggregate{Type: aggregateType, ID: aggregateID, Seq: through}
	if aggregateType == "" || aggregateID == "" || through < 1 {
		return fmt.Errorf("inbox.Skip %s through %d: want an aggregate type, an id and a positive sequence", a, through)
	}
	if strings.TrimSpace(reason) == "" {
		return fmt.Errorf("inbox.Skip %s through %d: give a reason; it is recorded with the position", a, through)
	}
	var after int64
	err := in.pool.QueryRow(ctx, in.skipSQL, in.cfg.Consumer, aggregateType, aggregateID, through, reason).Scan(&after)
	if errors.Is(err, pgx.ErrNoRows) {
		var applied int64
		if err := in.pool.QueryRow(ctx, in.posReadSQL, in.cfg.Consumer, aggregateType, aggregateID).Scan(&applied); err != nil {
			return fmt.Errorf("inbox.Skip %s through %d: nothing moved, and reading the position failed: %w", a, through, err)
		}
		return fmt.Errorf("inbox.Skip %s through %d: consumer %q is already at %d; nothing to skip", a, through, in.cfg.Consumer, applied)
	}
	if err != nil {
		return fmt.Errorf("inbox.Skip %s through %d in %s: %w", a, through, in.t.positionsName(), err)
	}
	in.log.LogAttrs(ctx, slog.LevelWarn, "position skipped forward by an operator; the skipped sequences will not be applied",
		slog.String("aggregate", a.String()), slog.Int64("skipped_after", after), slog.Int64("skipped_through", through), slog.String("reason", reason))
	return nil
}
