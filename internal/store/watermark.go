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
// docs/design-watermark.md, "The watermark", states the same against long and aborted
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

// systemSQL and timelineSQL identify the cluster and its timeline, in SQL
// so that every reader (status, prune, the console, the metrics), not only
// the relay, applies the same rule. Both functions are PUBLIC. The timeline
// is the last checkpoint's, on the recorder's side as on the readers', so
// a recorded timeline is never ahead of what a reader of the same history
// sees.
const (
	systemSQL   = `(SELECT system_identifier FROM pg_catalog.pg_control_system())`
	timelineSQL = `(SELECT timeline_id FROM pg_catalog.pg_control_checkpoint())`
	// walPositionSQL is the newest WAL position this server has, on a
	// primary or a standby.
	walPositionSQL = `(CASE WHEN pg_catalog.pg_is_in_recovery() THEN pg_catalog.pg_last_wal_replay_lsn() ELSE pg_catalog.pg_current_wal_insert_lsn() END)`
)

// watermarkValidSQL is a condition on the <table>_slots row aliased alias:
// its watermark was recorded on this cluster (issue 30): a copy restored
// from another cluster (pg_dump | psql, whose transaction ids and WAL
// positions mean other transactions here) covers nothing. A physical
// standby shares its primary's system identifier and continues its
// history on a later timeline, so a watermark recorded on the primary
// stays valid after a promotion; one from a later timeline than this
// server's, or at a position this server has not reached, is not of its
// history.
func watermarkValidSQL(alias string) string {
	return alias + `.watermark_lsn IS NOT NULL AND ` + alias + `.watermark_system_identifier = ` + systemSQL +
		` AND ` + alias + `.watermark_timeline <= ` + timelineSQL + ` AND ` + alias + `.watermark_lsn <= ` + walPositionSQL
}

// watermarkSQL is the newest valid watermark of the table's slots, as a
// scalar subquery (run once per statement). A later snapshot sees every
// transaction an earlier one saw as finished, so the newest covers
// everything any older one covers.
func (s *Store) watermarkSQL() string {
	return `(SELECT w.watermark_snapshot FROM ` + s.SlotsTable() + ` AS w
		WHERE ` + watermarkValidSQL("w") + ` ORDER BY w.watermark_lsn DESC LIMIT 1)`
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
//
// slotLSN is the consistent point of the slot the session streams (its
// SlotState.SlotLSN): a candidate is bound to the slot it was taken
// against (issue 30, item 4). The guard reads whichever slot bears the name
// now, so it also requires that the record still names that slot and that
// no backfill is pending: an instance that stalled (frozen, half-open)
// while another one re-created the slot would otherwise record its old
// candidate against the new slot's confirmed position, before the new
// slot's backfill handed over the rows the old one had not confirmed, and
// the watermark would cover them. A watermark of another cluster is
// replaced, not compared with.
func (s *Store) AdvanceWatermark(ctx context.Context, slot string, slotLSN LSN, cand WatermarkCandidate) (recorded bool, next WatermarkCandidate, err error) {
	var snap *string
	var lsn *string
	if cand.Snapshot != "" {
		snap = &cand.Snapshot
		l := cand.LSN.String()
		lsn = &l
	}
	var nextLSN string
	err = s.pool.QueryRow(ctx, `WITH rec AS (
			UPDATE `+s.SlotsTable()+` AS t SET watermark_snapshot = $2::pg_snapshot, watermark_lsn = $3::pg_lsn, watermark_at = clock_timestamp(),
				watermark_system_identifier = `+systemSQL+`, watermark_timeline = `+timelineSQL+`
			WHERE t.slot_name = $1 AND $2::pg_snapshot IS NOT NULL
			  AND NOT t.backfill_pending AND t.slot_lsn = $4::pg_lsn AND t.system_identifier = `+systemSQL+`
			  AND (t.watermark_lsn IS NULL OR t.watermark_lsn < $3::pg_lsn OR NOT coalesce(`+watermarkValidSQL("t")+`, false))
			  AND (SELECT r.confirmed_flush_lsn FROM pg_catalog.pg_replication_slots AS r WHERE r.slot_name = $1) >= $3::pg_lsn
			RETURNING 1)
		SELECT EXISTS (SELECT 1 FROM rec), pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text`,
		slot, snap, lsn, slotLSN.String()).Scan(&recorded, &next.Snapshot, &nextLSN)
	if err != nil {
		return false, cand, fmt.Errorf("record watermark of slot %s at %s: %w", slot, cand.LSN, err)
	}
	if next.LSN, err = parseLSN(nextLSN); err != nil {
		return false, cand, fmt.Errorf("record watermark of slot %s: parse position %q: %w", slot, nextLSN, err)
	}
	return recorded, next, nil
}

// LatestWatermark reads the newest valid watermark of the table's slots;
// found is false when none was ever recorded.
func (s *Store) LatestWatermark(ctx context.Context) (w Watermark, found bool, err error) {
	rows, err := s.pool.Query(ctx, `SELECT w.slot_name, w.watermark_snapshot::text, w.watermark_lsn::text, w.watermark_at FROM `+s.SlotsTable()+` AS w
		WHERE `+watermarkValidSQL("w")+` ORDER BY w.watermark_lsn DESC LIMIT 1`)
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

// IgnoredWatermark is a watermark in <table>_slots that does not count
// here, and why.
type IgnoredWatermark struct {
	Slot   string
	LSN    string
	Reason string
}

// IgnoredWatermarks lists the recorded watermarks that watermarkSQL
// ignores, for the relay to say so at start.
func (s *Store) IgnoredWatermarks(ctx context.Context) ([]IgnoredWatermark, error) {
	rows, err := s.pool.Query(ctx, `SELECT w.slot_name, w.watermark_lsn::text, CASE
			WHEN w.watermark_system_identifier IS NULL THEN 'recorded before migration 0016 while its slot does not exist here (or is behind it): it cannot be told apart from a copy of another cluster'
			WHEN w.watermark_system_identifier <> `+systemSQL+` THEN format('recorded on another cluster (system identifier %s, this one is %s): a copy (pg_dump, a restore, pg_upgrade) whose transaction ids mean other transactions here', w.watermark_system_identifier, `+systemSQL+`)
			WHEN w.watermark_timeline > `+timelineSQL+` THEN format('recorded on timeline %s, later than this server''s %s: not of its history', w.watermark_timeline, `+timelineSQL+`)
			ELSE format('its position %s is past this server''s WAL (%s): not of its history', w.watermark_lsn, `+walPositionSQL+`) END
		FROM `+s.SlotsTable()+` AS w WHERE w.watermark_lsn IS NOT NULL AND NOT coalesce(`+watermarkValidSQL("w")+`, false) ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("read the watermarks of %s: %w", s.table.Qualified(), err)
	}
	defer rows.Close()
	var out []IgnoredWatermark
	for rows.Next() {
		var w IgnoredWatermark
		if err := rows.Scan(&w.Slot, &w.LSN, &w.Reason); err != nil {
			return nil, fmt.Errorf("read the watermarks of %s: %w", s.table.Qualified(), err)
		}
		out = append(out, w)
	}
	return out, rows.Err()
}
