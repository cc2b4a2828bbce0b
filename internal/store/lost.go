package store

import (
	"context"
	"fmt"
	"time"
)

// LostRange is what RequeueLost handed back to the poller: how many rows,
// and the lowest and highest stream sequence they were acknowledged at.
type LostRange struct {
	Rows     int
	From, To uint64
}

// LostNotePrefix begins the last_error of a row RequeueLost handed back:
// the poller looks such a row up in the stream before it publishes it.
const LostNotePrefix = "lost:"

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
func (s *Store) RequeueLost(ctx context.Context, stream string, last uint64, created, createdSince time.Time) (LostRange, error) {
	var r LostRange
	var from, to *int64
	args := []any{stream, int64(last), created}
	recent := ""
	if !createdSince.IsZero() {
		recent = " AND o.created_at >= $4"
		args = append(args, createdSince)
	}
	err := s.pool.QueryRow(ctx, `WITH lost AS (
		UPDATE `+s.table.String()+` AS o SET state = 'scheduled', available_at = clock_timestamp(), published_at = NULL,
			lookup_seq = least(o.lookup_seq, $2::bigint),
			last_error = format('lost: broker acknowledged seq %s in stream %s but the stream ends at %s', o.stream_seq, o.stream_name, $2::bigint)
		WHERE o.state = 'published' AND o.stream_name = $1 AND o.stream_seq > $2::bigint
			AND o.published_at >= $3`+recent+`
		RETURNING o.stream_seq)
	SELECT count(*), min(stream_seq), max(stream_seq) FROM lost`, args...).Scan(&r.Rows, &from, &to)
	if err != nil {
		return LostRange{}, fmt.Errorf("hand rows the broker lost back to the poller (stream %s past seq %d): %w", stream, last, err)
	}
	if from != nil {
		r.From, r.To = uint64(*from), uint64(*to)
	}
	return r, nil
}
