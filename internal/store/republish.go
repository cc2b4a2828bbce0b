package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// PublishedRow is a row the broker acknowledged (state 'published', or
// 'ready' and covered by the watermark under --on-publish none), as the
// republish command reads it to look its message up in the stream and
// publish it again when the broker lost it (G19).
type PublishedRow struct {
	Claimed        // what the message is built from (Attempts and ClaimGeneration as the row has them)
	State   string // published, or ready (covered by the watermark)
	// Stream and Seq: where the broker acknowledged it (state published;
	// empty for a ready row, of which nothing per row is kept).
	Stream string
	Seq    uint64
}

// PublishedRead is what PublishedSince read.
type PublishedRead struct {
	Rows []PublishedRow
	// Read is how many rows the walk read (published or not); when it is
	// the limit, rows created at or after Next were not read.
	Read int
	Next time.Time
}

// PublishedSince reads the published rows among the limit oldest rows
// created at or after since (or in the last sinceAgo, by the database's
// clock), in (created_at, work_id) order. The walk is bounded by the rows
// it reads, not by the rows it keeps: it reads at most limit rows through
// the index on created_at (G16), whatever share of them is still on its
// way, and says where it stopped, for the next run to go on from there.
// It writes nothing.
func (s *Store) PublishedSince(ctx context.Context, since time.Time, sinceAgo time.Duration, limit int) (PublishedRead, error) {
	var out PublishedRead
	from := `$1::timestamptz`
	var arg any = since
	if sinceAgo != 0 {
		from = `clock_timestamp() - $1::bigint * interval '1 microsecond'`
		arg = micros(sinceAgo)
	}
	tbl := s.table.String()
	rows, err := s.pool.Query(ctx, `WITH w AS (
			SELECT work_id, created_at FROM `+tbl+` WHERE created_at >= `+from+` ORDER BY created_at, work_id LIMIT $2)
		SELECT o.work_id, o.kind, coalesce(o.subject, ''), o.payload, o.headers::text, o.attempts, o.claim_generation,
			coalesce(o.aggregate_type, ''), coalesce(o.aggregate_id, ''), o.aggregate_seq, o.expires_at, o.created_at,
			o.state, coalesce(o.stream_name, ''), coalesce(o.stream_seq, 0), `+s.publishedSQL("o")+`
		FROM w JOIN `+tbl+` AS o ON o.work_id = w.work_id AND o.created_at = w.created_at
		ORDER BY w.created_at, w.work_id`, arg, limit)
	if err != nil {
		return out, fmt.Errorf("read the published rows created since %s in %s: %w", describeSince(since, sinceAgo), s.table.Qualified(), err)
	}
	defer rows.Close()
	for rows.Next() {
		var p PublishedRow
		var headers *string
		var aggSeq *int64
		var expires *time.Time
		var seq int64
		var published bool
		if err := rows.Scan(&p.WorkID, &p.Kind, &p.Subject, &p.Payload, &headers, &p.Attempts, &p.ClaimGeneration,
			&p.AggregateType, &p.AggregateID, &aggSeq, anyTimePtr{&expires}, anyTime{&p.CreatedAt},
			&p.State, &p.Stream, &seq, &published); err != nil {
			return out, fmt.Errorf("read the published rows created since %s in %s: %w", describeSince(since, sinceAgo), s.table.Qualified(), err)
		}
		out.Read++
		out.Next = p.CreatedAt
		if !published {
			continue
		}
		p.Binary = isBytea(rows.FieldDescriptions()[3])
		if headers != nil {
			p.Headers = []byte(*headers)
		}
		if aggSeq != nil {
			p.AggregateSeq = *aggSeq
		}
		if expires != nil {
			p.ExpiresAt = *expires
		}
		p.Seq = uint64(seq)
		out.Rows = append(out.Rows, p)
	}
	if err := rows.Err(); err != nil {
		return out, fmt.Errorf("read the published rows created since %s in %s: %w", describeSince(since, sinceAgo), s.table.Qualified(), err)
	}
	return out, nil
}

func describeSince(since time.Time, ago time.Duration) string {
	if ago != 0 {
		return ago.String() + " ago"
	}
	return since.UTC().Format(time.RFC3339Nano)
}

// RepublishedNote is the last_error of a published row whose message the
// broker lost and the republish command published again.
func RepublishedNote(lostSeq uint64, stream string, seq uint64) string {
	return ClassRepublished.Notef("the broker lost seq %d; published again in stream %s at sequence %d", lostSeq, stream, seq)
}

// Republished is a row published again by the republish command: its work
// ID, the sequence the broker had lost (the row's stream_seq, the fence)
// and where the broker stored it now.
type Republished struct {
	WorkID  string
	LostSeq uint64
	Stream  string
	Seq     uint64
}

// RecordRepublished points the rows in state 'published' that the
// republish command published again at the message now stored, so that
// the relay's own check (RequeueLost) does not hand them back to the
// poller for a sequence the stream no longer has. A row whose stream_seq
// changed meanwhile (the relay's check handed it back first) is left as
// it is. A 'ready' row (--on-publish none) keeps nothing per row and is
// not written. It returns the work IDs recorded.
func (s *Store) RecordRepublished(ctx context.Context, items []Republished) ([]string, error) {
	if len(items) == 0 {
		return nil, nil
	}
	ids := make([]string, len(items))
	lost := make([]int64, len(items))
	seqs := make([]int64, len(items))
	streams := make([]string, len(items))
	notes := make([]string, len(items))
	for i, it := range items {
		ids[i], lost[i], seqs[i], streams[i], notes[i] = it.WorkID, int64(it.LostSeq), int64(it.Seq), it.Stream, RepublishedNote(it.LostSeq, it.Stream, it.Seq)
	}
	rows, err := s.pool.Query(ctx, `UPDATE `+s.table.String()+` AS t SET stream_seq = u.seq, stream_name = u.stream, last_error = u.note
		FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[]) AS u(work_id, lost, seq, stream, note)
		WHERE t.work_id = u.work_id AND t.state = 'published' AND t.stream_seq = u.lost
		RETURNING t.work_id`, ids, lost, seqs, streams, notes)
	if err != nil {
		return nil, fmt.Errorf("record %d republished rows' sequences in %s: %w", len(items), s.table.Qualified(), err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("record %d republished rows' sequences in %s: %w", len(items), s.table.Qualified(), err)
	}
	return done, nil
}
