package bench

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/jackc/pglogrepl"
)

// WAL per message (issue 23, section 3). Every case that inserts rows reads
// the server's WAL insert position before its first insert and after its
// last row is published (settled by the case's policy), and divides the
// difference by the rows. For ceiling-pg that is the producers' inserts
// alone; for a CDC or poller case it is the inserts plus everything the
// relay made the database write (marks, deletes, claims, watermarks), so
// the difference of the two, per message, is the relay's own share.
//
// The position is server-wide: autovacuum, the checkpointer and other
// databases write into the same range. One case runs at a time, and each
// measured case starts right after a forced CHECKPOINT, so every case pays
// the same full-page images (the first change of each page after a
// checkpoint is logged whole) and a timed checkpoint does not fall inside
// one case and not another; checkpoints_during counts any that still did.

// walMark is the server's WAL state at one moment.
type walMark struct {
	lsn         pglogrepl.LSN
	checkpoints int64 // timed + requested, since the statistics were reset
}

// checkpointsSQL counts completed checkpoints: pg_stat_bgwriter up to
// PostgreSQL 16, pg_stat_checkpointer from 17.
func (s *servers) checkpointsSQL() string {
	if s.pg.Version() >= 17 {
		return `(SELECT num_timed + num_requested FROM pg_stat_checkpointer)`
	}
	return `(SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter)`
}

// walNow reads the WAL insert position (not the write position, which lags
// it by what sits in the WAL buffers) and the checkpoint count.
func (s *servers) walNow(ctx context.Context) (walMark, error) {
	var lsn string
	var m walMark
	if err := s.admin.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text, `+s.checkpointsSQL()).Scan(&lsn, &m.checkpoints); err != nil {
		return m, fmt.Errorf("read the WAL insert position: %w", err)
	}
	var err error
	if m.lsn, err = pglogrepl.ParseLSN(lsn); err != nil {
		return m, fmt.Errorf("parse WAL position %q: %w", lsn, err)
	}
	return m, nil
}

// checkpoint forces a checkpoint before a measured case (see above), and
// waits until the checkpointer has counted it: it reports its statistics
// after it lets CHECKPOINT return (seen: a case counted the forced
// checkpoint as one inside it).
func (s *servers) checkpoint(ctx context.Context) error {
	var n0, n int64
	if err := s.admin.QueryRow(ctx, `SELECT `+s.checkpointsSQL()).Scan(&n0); err != nil {
		return fmt.Errorf("count checkpoints: %w", err)
	}
	if _, err := s.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		return fmt.Errorf("checkpoint before the case: %w", err)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		// A snapshot of the statistics is kept for the transaction; each
		// statement here is its own.
		if err := s.admin.QueryRow(ctx, `SELECT `+s.checkpointsSQL()).Scan(&n); err != nil {
			return fmt.Errorf("count checkpoints: %w", err)
		}
		if n > n0 {
			return nil
		}
	}
	return fmt.Errorf("the forced checkpoint was not counted within 5s (%d checkpoints before, %d after)", n0, n)
}

// recordWAL stores the WAL written between from and to in r: bytes in
// all and per message, checkpoints that fell inside, and the share of
// full-page images (pg_waldump over the range, best effort: it is read once
// the WAL writer has written the range out).
func (b *bench) recordWAL(ctx context.Context, r *Result, from walMark, msgs int) error {
	to, err := b.s.walNow(ctx)
	if err != nil {
		return err
	}
	if r.Extra == nil {
		r.Extra = map[string]float64{}
	}
	bytes := float64(to.lsn - from.lsn)
	r.Extra["wal_bytes"] = bytes
	r.Extra["checkpoints_during"] = float64(to.checkpoints - from.checkpoints)
	r.WALBytesPerMsg = bytes / float64(msgs)
	// pg_waldump reads the files: wait (briefly) for the write position.
	deadline := time.Now().Add(2 * time.Second)
	for {
		var written bool
		if err := b.s.admin.QueryRow(ctx, `SELECT pg_current_wal_lsn() >= $1::pg_lsn`, to.lsn.String()).Scan(&written); err != nil {
			return fmt.Errorf("read the WAL write position: %w", err)
		}
		if written {
			break
		}
		if time.Now().After(deadline) {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	if fpi, _, err := b.walStats(ctx, from.lsn, to.lsn); err == nil {
		r.Extra["wal_fpi_share"] = fpi
	} else {
		b.cfg.logf("WAL %s-%s: no full-page image share: %v", from.lsn, to.lsn, err)
	}
	return nil
}

// WALShare is the relay's own share of a case's WAL: the case's WAL per
// message less the producers' alone (ceiling-pg: the same rows of the same
// size into the same table, no slot, no relay), in bytes per message and
// as a fraction of the producers' WAL per message. NaN when either is
// unknown.
func WALShare(caseBytes float64, caseMsgs int, producerBytes float64, producerMsgs int) (bytesPerMsg, overInserts float64) {
	if caseMsgs <= 0 || producerMsgs <= 0 || producerBytes <= 0 {
		return math.NaN(), math.NaN()
	}
	prod := producerBytes / float64(producerMsgs)
	bytesPerMsg = caseBytes/float64(caseMsgs) - prod
	return bytesPerMsg, bytesPerMsg / prod
}

// addWALShares sets, on every CDC and poller case, the relay's WAL share
// and its PostgreSQL CPU per message (PathPGMicros) against the ceiling-pg
// of the same round. The naive polling publisher is
// left out: its table is not the outbox table, so ceiling-pg's rows are not
// its rows.
func addWALShares(rs []Result) {
	prod := map[int]Result{}
	for _, r := range rs {
		if r.Case == CeilingPG && r.Extra["wal_bytes"] > 0 {
			prod[r.Round] = r
		}
	}
	for i := range rs {
		r := &rs[i]
		k := caseKind(r.Case)
		p, ok := prod[r.Round]
		if (k != "cdc" && k != "poller") || !ok || r.Extra["wal_bytes"] <= 0 {
			continue
		}
		per, over := WALShare(r.Extra["wal_bytes"], r.Rows, p.Extra["wal_bytes"], p.Rows)
		if math.IsNaN(per) {
			continue
		}
		r.Extra["producer_wal_bytes_per_msg"] = p.WALBytesPerMsg
		r.Extra["relay_wal_bytes_per_msg"] = per
		r.Extra["relay_wal_over_inserts"] = over
		if r.PGCPU > 0 && p.PGCPU > 0 {
			r.Extra["path_pg_us_per_msg"] = PathPGMicros(*r, p)
		}
	}
}

// PathPGMicros is PostgreSQL's CPU per message for the path of case r, the
// walsender left out (it has its own column): in a backlog case the server
// is measured from the publisher's start, after the inserts, so all of it;
// in a live case the producers' backends run in the same interval, so
// their cost per row in ceiling-pg of the same round is taken out (an
// estimate: ceiling-pg inserts as fast as it can, a paced live case does
// not).
func PathPGMicros(r, ceiling Result) float64 {
	us := (r.PGCPU - r.WalsenderCPU) / float64(r.Rows) * 1e6
	if r.Case == CDCLive || r.Case == PollerLive || r.Case == PollLive {
		us -= ceiling.PGCPU / float64(ceiling.Rows) * 1e6
	}
	return us
}
