package store

import (
	"context"
	"errors"
	"fmt"
	"regexp"

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
}

// SlotsTable is the quoted name of the table's slot record.
func (s *Store) SlotsTable() string { return s.table.derived("slots", true) }

// SlotState reads the record of slot; a slot the relay never created has
// none (zero value, found false).
func (s *Store) SlotState(ctx context.Context, slot string) (st SlotState, found bool, err error) {
	var rows *int64
	var mode *string
	err = s.pool.QueryRow(ctx, `SELECT backfill_pending, backfilled_rows, backfill_mode, created_count, invalidated_count
		FROM `+s.SlotsTable()+` WHERE slot_name = $1`, slot).
		Scan(&st.BackfillPending, &rows, &mode, &st.CreatedCount, &st.InvalidatedCount)
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
	return st, true, nil
}

// MarkBackfillPending records, durably and before the slot is created, that
// the rows committed before it still have to be handed over.
func (s *Store) MarkBackfillPending(ctx context.Context, slot string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO `+s.SlotsTable()+` AS t (slot_name, backfill_pending, pending_since, created_count)
		VALUES ($1, true, clock_timestamp(), 1)
		ON CONFLICT (slot_name) DO UPDATE SET backfill_pending = true,
			pending_since = CASE WHEN t.backfill_pending THEN t.pending_since ELSE clock_timestamp() END,
			created_count = t.created_count + 1`, slot)
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
// keeping available_at (a delayed row stays delayed), and clears the marker.
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
	tag, err := tx.Exec(ctx, `UPDATE `+s.SlotsTable()+` SET backfill_pending = false, backfilled_at = clock_timestamp(),
			backfilled_rows = $2, backfill_mode = $3, consistent_lsn = nullif($4, '')::pg_lsn
		WHERE slot_name = $1 AND backfill_pending`, slot, n, mode, consistentLSN)
	if err != nil {
		return 0, fmt.Errorf("backfill slot %s: clear marker: %w", slot, err)
	}
	if tag.RowsAffected() == 0 {
		return 0, fmt.Errorf("backfill slot %s: %w", slot, ErrBackfillNotPending)
	}
	return n, nil
}
