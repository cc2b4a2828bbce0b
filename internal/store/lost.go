package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// LostRange is what RequeueLost handed back to the poller: how many rows,
// and the lowest and highest stream sequence they were acknowledged at.
type LostRange struct {
	Rows     int
	From, To uint64
	// IDs are the rows' work IDs.
	IDs []string
}

// RequeueLost hands back to the poller the rows recorded as published
// into stream at a sequence past last, the stream's last sequence now
// (G19): the broker acknowledged them and then lost them (its store came
// back shorter). They become scheduled (the poller's), due at once, their attempts kept and
// last_error saying what was lost, and their lookup_seq at most last: a
// copy published since the loss (the CDC path's replay starts after the
// check at a session start) is stored after it, and the poller looks it up
// from there before it publishes the row again (G18). Rows of another stream, and rows below
// the stream's first sequence (removed by its own limits) are left alone;
// so are rows published before created, the stream's creation time: a
// stream deleted and created again under the same name starts its
// sequences over, and its old rows' messages were never lost by the broker.
// The state filter is re-checked under the row lock, so of two instances
// running this at once, each row is handed back by one only.
//
// Only published rows carry a stream sequence, so this does something
// under --on-publish mark only.
//
// A non-zero createdSince reads only the rows created since then, through
// the index on created_at: the check at a process's start, which has no
// acknowledgement of its own to compare the stream with, would otherwise
// read every published row of the table at every start (G16). A zero
// createdSince reads them all: the check after this process saw the
// stream end below what it acknowledged, a loss known to have happened.
//
// A non-zero recordedBefore, the database's clock read before the
// stream's state was, leaves out the rows recorded published after it: their
// acknowledgement may have come after the state was read (the poller
// publishing the rows a session start handed it), so their sequence past
// the end read says nothing of a loss. A row's message is stored before its
// acknowledgement, and that before the row is recorded: a row recorded
// before the bound had its message in the stream when the state was read,
// unless the broker lost it.
func (s *Store) RequeueLost(ctx context.Context, stream string, last uint64, created, createdSince, recordedBefore time.Time) (LostRange, error) {
	var r LostRange
	var from, to *int64
	args := []any{stream, int64(last), created}
	recent := ""
	if !createdSince.IsZero() {
		args = append(args, createdSince)
		recent = fmt.Sprintf(" AND o.created_at >= $%d", len(args))
	}
	if !recordedBefore.IsZero() {
		args = append(args, recordedBefore)
		recent += fmt.Sprintf(" AND o.published_at < $%d", len(args))
	}
	err := s.pool.QueryRow(ctx, `WITH lost AS (
		UPDATE `+s.table.String()+` AS o SET state = 'scheduled', available_at = clock_timestamp(), published_at = NULL,
			lookup_seq = least(o.lookup_seq, $2::bigint),
			last_error = `+ClassLost.SQLNote(`format('broker acknowledged seq %s in stream %s but the stream ends at %s', o.stream_seq, o.stream_name, $2::bigint)`)+`
		WHERE o.state = 'published' AND o.stream_name = $1 AND o.stream_seq > $2::bigint
			AND o.published_at >= $3`+recent+`
		RETURNING o.stream_seq, o.work_id)
	SELECT count(*), min(stream_seq), max(stream_seq), coalesce(array_agg(work_id), '{}') FROM lost`, args...).Scan(&r.Rows, &from, &to, &r.IDs)
	if err != nil {
		return LostRange{}, fmt.Errorf("hand rows the broker lost back to the poller (stream %s past seq %d): %w", stream, last, err)
	}
	if from != nil {
		r.From, r.To = uint64(*from), uint64(*to)
	}
	return r, nil
}

// Recorded is a row recorded as published into a stream at a sequence.
type Recorded struct {
	WorkID string
	Seq    uint64
}

// recordedWhere is the rows recorded published into stream $1, published
// since $2 (the stream's creation), and created since $3 unless
// createdSince is zero (then $3 is not used): the index on created_at, a
// session start's bound (G16). Two texts, not an OR, so that each has a
// plan of its own.
func recordedWhere(createdSince time.Time) string {
	w := `state = 'published' AND stream_name = $1 AND published_at >= $2`
	if !createdSince.IsZero() {
		return w + ` AND created_at >= $3`
	}
	return w + ` AND $3::timestamptz IS NULL`
}

func sinceArg(createdSince time.Time) any {
	if createdSince.IsZero() {
		return nil
	}
	return createdSince
}

// TopRecorded is where a stream that lost its tail and took new messages
// since (its sequences reused, so that nothing is recorded past its end)
// shows it in the table, at or below hi: the rows recorded at the highest
// sequence (the caller compares them with the message there), and the
// highest sequence at which two rows are recorded (0: none), the lost
// one and the one stored there since. Only sequences above lo are looked
// at, so that what is grouped stays bounded however busy the table.
func (s *Store) TopRecorded(ctx context.Context, stream string, lo, hi uint64, created, createdSince time.Time) (top []Recorded, twice uint64, err error) {
	rows, err := s.pool.Query(ctx, `WITH w AS MATERIALIZED (
			SELECT work_id, stream_seq FROM `+s.table.String()+` WHERE `+recordedWhere(createdSince)+` AND stream_seq <= $4::bigint AND stream_seq > $5::bigint)
		SELECT work_id, stream_seq, coalesce((SELECT max(stream_seq) FROM (SELECT stream_seq FROM w GROUP BY stream_seq HAVING count(*) > 1) d), 0)
		FROM w WHERE stream_seq = (SELECT max(stream_seq) FROM w)`,
		stream, created, sinceArg(createdSince), int64(hi), int64(lo))
	if err != nil {
		return nil, 0, fmt.Errorf("read the rows recorded last in stream %s up to seq %d: %w", stream, hi, err)
	}
	defer rows.Close()
	for rows.Next() {
		var r Recorded
		var seq, dup int64
		if err := rows.Scan(&r.WorkID, &seq, &dup); err != nil {
			return nil, 0, fmt.Errorf("read the rows recorded last in stream %s: %w", stream, err)
		}
		r.Seq, twice = uint64(seq), uint64(dup)
		top = append(top, r)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read the rows recorded last in stream %s: %w", stream, err)
	}
	return top, twice, nil
}

// RecordedBetween returns the rows recorded at a sequence in (lo, hi], at
// most limit, the highest first.
func (s *Store) RecordedBetween(ctx context.Context, stream string, lo, hi uint64, created, createdSince time.Time, limit int) ([]Recorded, error) {
	rows, err := s.pool.Query(ctx, `SELECT work_id, stream_seq FROM `+s.table.String()+` WHERE `+recordedWhere(createdSince)+`
			AND stream_seq > $4::bigint AND stream_seq <= $5::bigint ORDER BY stream_seq DESC LIMIT $6`,
		stream, created, sinceArg(createdSince), int64(lo), int64(hi), limit)
	if err != nil {
		return nil, fmt.Errorf("read the rows recorded in stream %s at seq %d to %d: %w", stream, lo+1, hi, err)
	}
	return collectRecorded(rows, fmt.Sprintf("read the rows recorded in stream %s at seq %d to %d", stream, lo+1, hi))
}

func collectRecorded(rows pgx.Rows, what string) ([]Recorded, error) {
	var out []Recorded
	for rows.Next() {
		var r Recorded
		var seq int64
		if err := rows.Scan(&r.WorkID, &seq); err != nil {
			rows.Close()
			return nil, fmt.Errorf("%s: %w", what, err)
		}
		r.Seq = uint64(seq)
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return out, nil
}

// RequeueLostRows is RequeueLost for rows found lost by their message: the
// stream holds another message at the sequence each is recorded at (it
// lost its tail and took new messages at those sequences since). Each is
// handed back only while it is still recorded published at that sequence
// (a row republished meanwhile points elsewhere), and looked up by the
// poller from lookupFrom, a sequence at or below where the stream came
// back, before it is sent again.
func (s *Store) RequeueLostRows(ctx context.Context, stream string, lost []Recorded, lookupFrom uint64) (LostRange, error) {
	ids := make([]string, len(lost))
	seqs := make([]int64, len(lost))
	for i, r := range lost {
		ids[i], seqs[i] = r.WorkID, int64(r.Seq)
	}
	var r LostRange
	var from, to *int64
	err := s.pool.QueryRow(ctx, `WITH lost AS (
		UPDATE `+s.table.String()+` AS o SET state = 'scheduled', available_at = clock_timestamp(), published_at = NULL,
			lookup_seq = least(o.lookup_seq, $4::bigint),
			last_error = `+ClassLost.SQLNote(`format('broker acknowledged seq %s in stream %s but holds another message there now', o.stream_seq, o.stream_name)`)+`
		FROM unnest($2::text[], $3::bigint[]) AS l(work_id, seq)
		WHERE o.work_id = l.work_id AND o.state = 'published' AND o.stream_name = $1 AND o.stream_seq = l.seq
		RETURNING o.stream_seq, o.work_id)
	SELECT count(*), min(stream_seq), max(stream_seq), coalesce(array_agg(work_id), '{}') FROM lost`, stream, ids, seqs, int64(lookupFrom)).Scan(&r.Rows, &from, &to, &r.IDs)
	if err != nil {
		return LostRange{}, fmt.Errorf("hand %d rows the broker lost back to the poller (stream %s): %w", len(lost), stream, err)
	}
	if from != nil {
		r.From, r.To = uint64(*from), uint64(*to)
	}
	return r, nil
}

// lostPendingLimit bounds LostPending's answer: the rows of one loss of the
// broker's unsynced tail, with room to spare.
const lostPendingLimit = 1_000_000

// LostPending returns the work IDs of the rows handed back as lost that the
// poller has not published yet (scheduled or running, through the poll
// index): a session start's replay leaves them to the poller, so that one
// path, not two, publishes each (G19).
func (s *Store) LostPending(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT work_id FROM `+s.table.String()+`
		WHERE poll_at IS NOT NULL AND `+ClassLost.Like("last_error")+` LIMIT `+fmt.Sprint(lostPendingLimit))
	if err != nil {
		return nil, fmt.Errorf("read the rows handed back as lost: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("read the rows handed back as lost: %w", err)
	}
	return ids, nil
}

// Clock reads the database's clock (clock_timestamp()): the bound of
// RequeueLost's recordedBefore, on the clock that dates the rows.
func (s *Store) Clock(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&t); err != nil {
		return time.Time{}, fmt.Errorf("read the database's clock: %w", err)
	}
	return t, nil
}
