package store

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
)

// The backfill statements (G9). A logical slot streams only transactions
// that commit after its consistent point; rows committed earlier (first
// start, or while the slot was dropped or invalidated) would be lost without
// them. The slot's exported snapshot sees exactly those rows, so handing the
// 'ready' rows it sees to the poller covers the gap without handing over any
// row the slot will stream.

// SlotState is the relay's record of a slot it created.
type SlotState struct {
	Slot             string
	BackfillPending  bool
	BackfilledRows   int64
	BackfillMode     string
	CreatedCount     int
	InvalidatedCount int

	// The identity of the slot the relay created (migration 0016): the
	// cluster it was created on (0: not recorded, a record from before
	// 0016), its consistent point (0: not recorded) and the highest
	// position the relay may have confirmed to it. System is this
	// cluster's identifier, read with the record.
	SystemIdentifier int64
	SlotLSN          LSN
	ConfirmBound     LSN
	System           int64
}

// SlotsTable is the quoted name of the table's slot record.
func (s *Store) SlotsTable() string { return s.table.Derived("slots", true) }

// SlotState reads the record of slot; a slot the relay never created has
// none (zero value, found false).
func (s *Store) SlotState(ctx context.Context, slot string) (st SlotState, found bool, err error) {
	var rows, sysid *int64
	var mode, slotLSN, bound *string
	err = s.pool.QueryRow(ctx, `SELECT backfill_pending, backfilled_rows, backfill_mode, created_count, invalidated_count,
			system_identifier, slot_lsn::text, confirm_bound::text, `+systemSQL+`
		FROM `+s.SlotsTable()+` WHERE slot_name = $1`, slot).
		Scan(&st.BackfillPending, &rows, &mode, &st.CreatedCount, &st.InvalidatedCount, &sysid, &slotLSN, &bound, &st.System)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotState{Slot: slot}, false, nil
	}
	if err != nil {
		return st, false, fmt.Errorf("read state of slot %s: %w", slot, err)
	}
	st.Slot = slot
	if rows != nil {
		st.BackfilledRows = *rows
	}
	if mode != nil {
		st.BackfillMode = *mode
	}
	if sysid != nil {
		st.SystemIdentifier = *sysid
	}
	for _, l := range []struct {
		dst *LSN
		src *string
	}{{&st.SlotLSN, slotLSN}, {&st.ConfirmBound, bound}} {
		if l.src == nil {
			continue
		}
		if *l.dst, err = parseLSN(*l.src); err != nil {
			return st, false, fmt.Errorf("read state of slot %s: %w", slot, err)
		}
	}
	return st, true, nil
}

// ErrSlotReplaced says the record no longer names the slot the session
// streams: another instance marked a new slot's backfill or created one.
var ErrSlotReplaced = errors.New("the slot record names another slot now")

// AdoptSlot records the identity of a slot the relay found recorded
// without one (a record from before migration 0016): this cluster, lsn as
// its consistent point and the bound of what was confirmed. It changes
// nothing once another session recorded an identity.
func (s *Store) AdoptSlot(ctx context.Context, slot string, lsn LSN) error {
	_, err := s.pool.Exec(ctx, `UPDATE `+s.SlotsTable()+` SET system_identifier = `+systemSQL+`, slot_lsn = $2::pg_lsn,
			confirm_bound = greatest(confirm_bound, $2::pg_lsn)
		WHERE slot_name = $1 AND NOT backfill_pending AND (system_identifier IS NULL OR slot_lsn IS NULL)`, slot, lsn.String())
	if err != nil {
		return fmt.Errorf("record the identity of slot %s: %w", slot, err)
	}
	return nil
}

// RaiseConfirmBound records, before the relay confirms pos to the slot
// whose consistent point is slotLSN, that it may have confirmed up to pos
// (confirm_bound, migration 0016). A slot found later with a confirmed
// position past the bound was moved by someone else. ErrSlotReplaced: the
// record names another slot now, and the session must not confirm.
//
// at, when set, is recorded with it as the stream position of pos
// (RecordPosition).
func (s *Store) RaiseConfirmBound(ctx context.Context, slot string, slotLSN, pos LSN, at *StreamPos) error {
	var seq *int64
	var stream *string
	var created *time.Time
	if at != nil {
		v := int64(at.Seq)
		seq, stream, created = &v, &at.Stream, &at.Created
	}
	tag, err := s.pool.Exec(ctx, `UPDATE `+s.SlotsTable()+` SET confirm_bound = greatest(confirm_bound, $3::pg_lsn), `+positionSetSQL+`
		WHERE slot_name = $1 AND slot_lsn = $2::pg_lsn AND NOT backfill_pending AND system_identifier = `+systemSQL,
		slot, slotLSN.String(), pos.String(), seq, stream, created)
	if err != nil {
		return fmt.Errorf("record the confirmation bound %s of slot %s: %w", pos, slot, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("record the confirmation bound %s of slot %s: %w", pos, slot, ErrSlotReplaced)
	}
	return nil
}

// StreamPos is where in a stream the messages of interest were stored
// after: past Seq in Stream, the stream created at Created (a stream
// created again under the same name starts its sequences over).
type StreamPos struct {
	Stream  string
	Created time.Time
	Seq     uint64
}

// positionSetSQL records $4 (seq), $5 (stream) and $6 (created) as the
// position of $3 (an LSN), keeping the pair before it as the previous one
// when it is of the same stream (and dropping it when not); with $4 NULL it
// changes nothing. Every SET expression reads the row as it was.
const positionSetSQL = `
		position_prev_lsn = CASE WHEN $4::bigint IS NULL THEN position_prev_lsn
			WHEN position_stream = $5::text AND position_created = $6::timestamptz AND position_lsn <> $3::pg_lsn THEN position_lsn
			WHEN position_stream = $5::text AND position_created = $6::timestamptz THEN position_prev_lsn END,
		position_prev_seq = CASE WHEN $4::bigint IS NULL THEN position_prev_seq
			WHEN position_stream = $5::text AND position_created = $6::timestamptz AND position_lsn <> $3::pg_lsn THEN position_seq
			WHEN position_stream = $5::text AND position_created = $6::timestamptz THEN position_prev_seq END,
		position_lsn = CASE WHEN $4::bigint IS NULL THEN position_lsn ELSE $3::pg_lsn END,
		position_seq = coalesce($4::bigint, position_seq),
		position_stream = coalesce($5::text, position_stream),
		position_created = coalesce($6::timestamptz, position_created)`

// RecordPosition records at as the stream position of pos for the slot
// whose consistent point is slotLSN: every message of a transaction that
// commits at or past pos is stored past at.Seq. A session whose slot
// starts at or past pos reads the stream back from there (G18). A clean
// stop records its final position this way: its next start reads back
// nothing of its own.
func (s *Store) RecordPosition(ctx context.Context, slot string, slotLSN, pos LSN, at StreamPos) error {
	seq := int64(at.Seq)
	tag, err := s.pool.Exec(ctx, `UPDATE `+s.SlotsTable()+` SET `+positionSetSQL+`
		WHERE slot_name = $1 AND slot_lsn = $2::pg_lsn AND NOT backfill_pending AND system_identifier = `+systemSQL,
		slot, slotLSN.String(), pos.String(), &seq, &at.Stream, &at.Created)
	if err != nil {
		return fmt.Errorf("record the stream position of %s for slot %s: %w", pos, slot, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("record the stream position of %s for slot %s: %w", pos, slot, ErrSlotReplaced)
	}
	return nil
}

// Position is a recorded pair: every message of a transaction committing
// at or past LSN is stored past Seq.
type Position struct {
	LSN LSN
	Seq uint64
}

// PositionRecord is what the slot record says of the stream positions:
// the newest pair and the one before it, of one stream.
type PositionRecord struct {
	Stream     string
	Created    time.Time
	Last, Prev *Position
}

// StartAt returns the recorded position a session starting at confirmed
// reads the stream back from, for stream created at created: the newest
// pair at or before confirmed. ok is false, with why, when there is none:
// nothing recorded, another stream (or the stream created again), or a
// slot that starts before every pair (its confirmations were lost: a
// PostgreSQL crash that took back what the slot had not written to disk).
func (r PositionRecord) StartAt(confirmed LSN, stream string, created time.Time) (seq uint64, ok bool, why string) {
	switch {
	case r.Last == nil:
		return 0, false, "no stream position recorded (the first start, or the first since an upgrade)"
	case r.Stream != stream:
		return 0, false, fmt.Sprintf("the position recorded is of stream %s, not %s", r.Stream, stream)
	case !r.Created.Equal(created.Truncate(time.Microsecond)):
		return 0, false, fmt.Sprintf("stream %s was created again since the position was recorded (at %s, now %s)", stream,
			r.Created.UTC().Format(time.RFC3339Nano), created.UTC().Format(time.RFC3339Nano))
	}
	best := (*Position)(nil)
	for _, p := range []*Position{r.Last, r.Prev} {
		if p != nil && p.LSN <= confirmed && (best == nil || p.LSN > best.LSN) {
			best = p
		}
	}
	if best == nil {
		return 0, false, fmt.Sprintf("the slot starts at %s, before the positions recorded (%s): its confirmations were taken back", confirmed, r.Last.LSN)
	}
	return best.Seq, true, ""
}

// ReadPosition reads the stream positions recorded for slot.
func (s *Store) ReadPosition(ctx context.Context, slot string) (PositionRecord, error) {
	var rec PositionRecord
	var lsn, prevLSN, stream *string
	var seq, prevSeq *int64
	var created *time.Time
	err := s.pool.QueryRow(ctx, `SELECT position_lsn::text, position_seq, position_prev_lsn::text, position_prev_seq, position_stream, position_created
		FROM `+s.SlotsTable()+` WHERE slot_name = $1 AND system_identifier = `+systemSQL, slot).
		Scan(&lsn, &seq, &prevLSN, &prevSeq, &stream, &created)
	if errors.Is(err, pgx.ErrNoRows) {
		return rec, nil
	}
	if err != nil {
		return rec, fmt.Errorf("read the stream position recorded for slot %s: %w", slot, err)
	}
	if stream == nil || created == nil {
		return rec, nil
	}
	rec.Stream, rec.Created = *stream, *created
	pair := func(l *string, q *int64) (*Position, error) {
		if l == nil || q == nil || *q < 0 {
			return nil, nil
		}
		v, err := parseLSN(*l)
		if err != nil {
			return nil, fmt.Errorf("read the stream position recorded for slot %s: %w", slot, err)
		}
		return &Position{LSN: v, Seq: uint64(*q)}, nil
	}
	if rec.Last, err = pair(lsn, seq); err != nil {
		return PositionRecord{}, err
	}
	if rec.Prev, err = pair(prevLSN, prevSeq); err != nil {
		return PositionRecord{}, err
	}
	return rec, nil
}

// MarkBackfillPending records, durably and before the slot is created, that
// the rows committed before it still have to be handed over. It forgets the
// identity of the slot it replaces: from its commit no session of that
// slot records a watermark or confirms past its bound.
func (s *Store) MarkBackfillPending(ctx context.Context, slot string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.SlotsTable()+` AS t (slot_name, backfill_pending, pending_since, created_count, system_identifier)
		VALUES ($1, true, clock_timestamp(), 1, `+systemSQL+`)
		ON CONFLICT (slot_name) DO UPDATE SET backfill_pending = true,
			pending_since = CASE WHEN t.backfill_pending THEN t.pending_since ELSE clock_timestamp() END,
			created_count = t.created_count + 1, system_identifier = excluded.system_identifier, slot_lsn = NULL, confirm_bound = NULL,
			position_lsn = NULL, position_seq = NULL, position_prev_lsn = NULL, position_prev_seq = NULL, position_stream = NULL, position_created = NULL`, slot)
	if err != nil {
		return fmt.Errorf("mark backfill pending for slot %s: %w", slot, err)
	}
	return nil
}

// RecordInvalidation counts an invalidated slot the relay is about to drop
// and re-create, so status can show it long after the log line scrolled by.
func (s *Store) RecordInvalidation(ctx context.Context, slot string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.SlotsTable()+` AS t (slot_name, invalidated_count, last_invalidated_at)
		VALUES ($1, 1, clock_timestamp())
		ON CONFLICT (slot_name) DO UPDATE SET invalidated_count = t.invalidated_count + 1,
			last_invalidated_at = clock_timestamp()`, slot)
	if err != nil {
		return fmt.Errorf("record invalidation of slot %s: %w", slot, err)
	}
	return nil
}

// Exported snapshot names are hex words joined by dashes, e.g.
// 00000003-0000001B-1. SET TRANSACTION SNAPSHOT takes no parameters, so the
// name is checked before it is spliced in as a literal.
var snapshotName = regexp.MustCompile(`^[0-9A-Fa-f]+(-[0-9A-Fa-f]+)+$`)

// ErrBackfillNotPending says the marker was already cleared, by another
// instance that handed the rows over.
var ErrBackfillNotPending = errors.New("backfill is not pending")

// BackfillFromSnapshot hands every 'ready' row visible in the slot's exported
// snapshot to the poller and clears the marker, in one repeatable-read
// transaction that runs in that snapshot. Rows committed after the consistent
// point are invisible to it and stay 'ready' for the stream. It must run
// before the replication connection sends its next command, which ends the
// snapshot.
func (s *Store) BackfillFromSnapshot(ctx context.Context, slot, snapshot, consistentLSN string) (int64, error) {
	if !snapshotName.MatchString(snapshot) {
		return 0, fmt.Errorf("backfill slot %s: unexpected snapshot name %q", slot, snapshot)
	}
	tx, err := s.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		return 0, fmt.Errorf("backfill slot %s: begin: %w", slot, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rollback after commit is a no-op
	if _, err := tx.Exec(ctx, `SET TRANSACTION SNAPSHOT '`+snapshot+`'`); err != nil {
		return 0, fmt.Errorf("backfill slot %s: import snapshot %s: %w", slot, snapshot, err)
	}
	n, err := s.backfillTx(ctx, tx, slot, "snapshot", consistentLSN)
	if err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("backfill slot %s: commit: %w", slot, err)
	}
	return n, nil
}

// BackfillAllReady is the fallback when the snapshot is gone: the slot exists
// and its marker is still set. It hands over every 'ready' row, including
// rows the slot will also stream (the broker drops the second copy by
// Nats-Msg-Id), and clears the marker. It does nothing, and reports false,
// when no backfill is pending.
func (s *Store) BackfillAllReady(ctx context.Context, slot string) (n int64, pending bool, err error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return 0, false, fmt.Errorf("backfill slot %s: begin: %w", slot, err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rollback after commit is a no-op
	if err := tx.QueryRow(ctx, `SELECT backfill_pending FROM `+s.SlotsTable()+` WHERE slot_name = $1 FOR UPDATE`, slot).
		Scan(&pending); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, fmt.Errorf("backfill slot %s: read marker: %w", slot, err)
	}
	if !pending {
		return 0, false, nil
	}
	if n, err = s.backfillTx(ctx, tx, slot, "all-ready", ""); err != nil {
		return 0, true, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, true, fmt.Errorf("backfill slot %s: commit: %w", slot, err)
	}
	return n, true, nil
}

// backfillTx moves the 'ready' rows the transaction sees to 'scheduled',
// keeping available_at (a delayed row stays delayed), clears the marker and
// records the slot's identity: its consistent point (for the all-ready
// fallback, which has none, the slot's confirmed position now: no session
// streamed it while the marker was set) on this cluster.
// A 'ready' row the newest watermark covers was published (--on-publish
// none, G17) and stays as it is: after a slot loss only the rows the last
// watermark does not cover are handed over.
// attempts is left alone: a backfilled row has not failed.
func (s *Store) backfillTx(ctx context.Context, tx pgx.Tx, slot, mode, consistentLSN string) (int64, error) {
	var n int64
	err := tx.QueryRow(ctx, `WITH moved AS (
			UPDATE `+s.table.String()+` AS o SET state = 'scheduled' WHERE o.state = 'ready' AND NOT `+s.coveredSQL("o")+` RETURNING 1)
		SELECT count(*) FROM moved`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("backfill slot %s: hand ready rows of %s to the poller: %w", slot, s.table.Qualified(), err)
	}
	tag, err := tx.Exec(ctx, `UPDATE `+s.SlotsTable()+` AS t SET backfill_pending = false, backfilled_at = clock_timestamp(),
			backfilled_rows = $2, backfill_mode = $3, consistent_lsn = nullif($4, '')::pg_lsn,
			system_identifier = `+systemSQL+`,
			slot_lsn = coalesce(nullif($4, '')::pg_lsn, (SELECT r.confirmed_flush_lsn FROM pg_catalog.pg_replication_slots AS r WHERE r.slot_name = $1)),
			confirm_bound = coalesce(nullif($4, '')::pg_lsn, (SELECT r.confirmed_flush_lsn FROM pg_catalog.pg_replication_slots AS r WHERE r.slot_name = $1))
		WHERE t.slot_name = $1 AND t.backfill_pending`, slot, n, mode, consistentLSN)
	if err != nil {
		return 0, fmt.Errorf("backfill slot %s: clear marker: %w", slot, err)
	}
	if tag.RowsAffected() == 0 {
		return 0, fmt.Errorf("backfill slot %s: %w", slot, ErrBackfillNotPending)
	}
	return n, nil
}
