package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// The watermark of --on-publish none (G17). The CDC path writes nothing for
// a row it publishes; instead the relay records, about once a second, a
// snapshot of the database together with the WAL insert position read after
// that snapshot was taken, once the slot's confirmed position has passed
// that position:
//
//   - A transaction the snapshot sees as finished had written its commit
//     record before the snapshot was taken (PostgreSQL writes the commit
//     record before it removes the transaction from the running set that
//     snapshots read), so its commit ends at or before the position read
//     after it.
//   - The slot's confirmed position is only ever moved past a transaction
//     once every row of it is settled: acked by the broker, or written into
//     another state (checkpoint), and an idle walsender's position only when
//     nothing is in flight. So every transaction committed before the
//     position was streamed and settled, or committed before the slot
//     existed and was handed to the poller by the backfill, which moves
//     such rows out of 'ready'.
//   - Hence a 'ready' row whose xact_id the snapshot sees as finished was
//     published by the CDC path. A row of an aborted transaction is never
//     read; a row of a transaction still running when the snapshot was
//     taken is not covered by it, only by a later one.
//
// docs/design.md, "The watermark", states the same against long and aborted
// transactions, subtransactions, wraparound and freezing, and two
// instances.

// Watermark is one recorded watermark: the snapshot and the position the
// slot had confirmed past when it was recorded.
type Watermark struct {
	Slot       string
	Snapshot   string // pg_snapshot text: xmin:xmax:xip,...
	LSN        LSN
	RecordedAt time.Time
}

// WatermarkCandidate is a snapshot and the WAL insert position read after
// it, waiting for the slot to confirm past the position.
type WatermarkCandidate struct {
	Snapshot string
	LSN      LSN
}

// LSN is a WAL position. The store keeps its own type, not pglogrepl's: the
// public outbox package builds on the store and depends on nothing beyond
// pgx and the standard library.
type LSN uint64

// String renders l as PostgreSQL does (pg_lsn): two hex words.
func (l LSN) String() string { return fmt.Sprintf("%X/%X", uint64(l)>>32, uint32(l)) }

// parseLSN reads a pg_lsn's text.
func parseLSN(s string) (LSN, error) {
	hi, lo, ok := strings.Cut(s, "/")
	if ok {
		h, err1 := strconv.ParseUint(hi, 16, 32)
		l, err2 := strconv.ParseUint(lo, 16, 32)
		if err1 == nil && err2 == nil {
			return LSN(h<<32 | l), nil
		}
	}
	return 0, fmt.Errorf("not a WAL position: %q", s)
}

// watermarkSQL is the newest recorded watermark of the table's slots, as a
// scalar subquery (run once per statement). A later snapshot sees every
// transaction an earlier one saw as finished, so the newest covers
// everything any older one covers.
func (s *Store) watermarkSQL() string {
	return `(SELECT w.watermark_snapshot FROM ` + s.SlotsTable() + ` AS w
		WHERE w.watermark_lsn IS NOT NULL ORDER BY w.watermark_lsn DESC LIMIT 1)`
}

// coveredSQL is a condition on the outbox row aliased alias: its inserting
// transaction is covered by the newest watermark. For a 'ready' row it
// means the CDC path published it (--on-publish none). A row without an
// xact_id (inserted before migration 0013) is never covered; the CDC path
// marks those.
func (s *Store) coveredSQL(alias string) string {
	return `coalesce(` + alias + `.xact_id IS NOT NULL AND pg_visible_in_snapshot(` + alias + `.xact_id, ` + s.watermarkSQL() + `), false)`
}

// publishedSQL is a condition on the outbox row aliased alias: the broker
// acknowledged it: state 'published', or 'ready' and covered by the
// watermark (--on-publish none).
func (s *Store) publishedSQL(alias string) string {
	return `(` + alias + `.state = '` + StatePublished + `' OR (` + alias + `.state = '` + StateReady + `' AND ` + s.coveredSQL(alias) + `))`
}

// AdvanceWatermark records cand as the slot's watermark when the slot has
// confirmed past its position (and it is newer than the one recorded), and
// takes the next candidate, in one statement. The snapshot is the
// statement's (pg_current_snapshot() returns the snapshot the statement
// runs under, taken before it runs); the position is read while it runs,
// so after the snapshot. A zero cand only takes a candidate. recorded says
// whether cand became the watermark; next is always set.
func (s *Store) AdvanceWatermark(ctx context.Context, slot string, cand WatermarkCandidate) (recorded bool, next WatermarkCandidate, err error) {
	var snap *string
	var lsn *string
	if cand.Snapshot != "" {
		snap = &cand.Snapshot
		l := cand.LSN.String()
		lsn = &l
	}
	var nextLSN string
	err = s.pool.QueryRow(ctx, `WITH rec AS (
			UPDATE `+s.SlotsTable()+` AS t SET watermark_snapshot = $2::pg_snapshot, watermark_lsn = $3::pg_lsn, watermark_at = clock_timestamp()
			WHERE t.slot_name = $1 AND $2::pg_snapshot IS NOT NULL
			  AND (t.watermark_lsn IS NULL OR t.watermark_lsn < $3::pg_lsn)
			  AND (SELECT r.confirmed_flush_lsn FROM pg_catalog.pg_replication_slots AS r WHERE r.slot_name = $1) >= $3::pg_lsn
			RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM rec), pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text`,
		slot, snap, lsn).Scan(&recorded, &next.Snapshot, &nextLSN)
	if err != nil {
		return false, cand, fmt.Errorf("record watermark of slot %s at %s: %w", slot, cand.LSN, err)
	}
	if next.LSN, err = parseLSN(nextLSN); err != nil {
		return false, cand, fmt.Errorf("record watermark of slot %s: parse position %q: %w", slot, nextLSN, err)
	}
	return recorded, next, nil
}

// LatestWatermark reads the newest recorded watermark of the table's slots;
// found is false when none was ever recorded.
func (s *Store) LatestWatermark(ctx context.Context) (w Watermark, found bool, err error) {
	rows, err := s.pool.Query(ctx, `SELECT slot_name, watermark_snapshot::text, watermark_lsn::text, watermark_at FROM `+s.SlotsTable()+`
		WHERE watermark_lsn IS NOT NULL ORDER BY watermark_lsn DESC LIMIT 1`)
	if err != nil {
		return w, false, fmt.Errorf("read watermark of %s: %w", s.table.Qualified(), err)
	}
	defer rows.Close()
	if !rows.Next() {
		return w, false, rows.Err()
	}
	var lsn string
	if err := rows.Scan(&w.Slot, &w.Snapshot, &lsn, &w.RecordedAt); err != nil {
		return w, false, fmt.Errorf("read watermark of %s: %w", s.table.Qualified(), err)
	}
	if w.LSN, err = parseLSN(lsn); err != nil {
		return w, false, fmt.Errorf("read watermark of %s: parse position %q: %w", s.table.Qualified(), lsn, err)
	}
	return w, true, nil
}
