package store

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// redrivenUncertainPrefix starts the last_error a redrive leaves on a row
// whose last attempt was uncertain: the evidence the poller needs to look
// the message up in the stream before publishing it again (G18), and the
// earliest time that attempt can have happened (its row's available_at,
// see OpRow.SinceLastAttempt).
var redrivenUncertainPrefix = ClassUncertain.Note("redriven; last attempt at or after ")

// redrivenUncertainSQL is the last_error a redrive sets: NULL (attempts
// start over), except on an uncertain row, where the attempt's evidence
// stays for the lookup (RedrivenUncertainSince reads it back).
func redrivenUncertainSQL(prevError, lastTry string) string {
	return `CASE WHEN ` + ClassUncertain.Like(prevError) + ` AND isfinite(` + lastTry + `)
		THEN '` + redrivenUncertainPrefix + `' || ` + sqlTimeText(lastTry) + ` || ' (' || left(` + prevError + `, 200) || ')'
		END`
}

// RedrivenUncertainSince reads the time a redriven uncertain row's last
// attempt happened at or after (see redrivenUncertainSQL). ok is false for
// any other last_error.
func RedrivenUncertainSince(lastError string) (since time.Time, ok bool) {
	rest, found := strings.CutPrefix(lastError, redrivenUncertainPrefix)
	if !found {
		return time.Time{}, false
	}
	ts, _, _ := strings.Cut(rest, " ")
	t, err := time.Parse(time.RFC3339Nano, ts)
	if err != nil {
		return time.Time{}, false
	}
	return t, true
}

// FoundNote is the last_error of a row settled as published because its
// message was found in the stream after an uncertain attempt.
func FoundNote(stream string, seq uint64) string {
	return ClassFound.Notef("uncertain attempt found stored in stream %s at sequence %d (not published again)", stream, seq)
}

// Found is a redriven row whose message the stream already holds.
type Found struct {
	WorkID string
	// Generation is the row's claim generation when it was redriven: a
	// claim since (the poller took it) makes the settle match nothing.
	Generation int64
	Stream     string
	Seq        uint64
}

// SettleFound settles redriven rows still 'scheduled' under generation as
// published with the stream sequence found (redrive, G18), under the
// on-publish policy as Complete does for an acked claim: marked published
// with the sequence (mark, none) or deleted (delete). A row the poller
// claimed meanwhile is left to it (it looks the message up itself). It
// returns the work IDs settled.
func (s *Store) SettleFound(ctx context.Context, items []Found) ([]string, error) {
	if len(items) == 0 {
		return nil, nil
	}
	settle := make([]Completion, len(items))
	for i, it := range items {
		settle[i] = Completion{WorkID: it.WorkID, Generation: it.Generation, Seq: it.Seq, Stream: it.Stream, Note: FoundNote(it.Stream, it.Seq)}
	}
	ids, gens, seqs, streams, notes := completionArrays(settle)
	args := []any{ids, gens, seqs, streams, notes}
	if s.policy == PolicyDelete {
		args = args[:2]
	}
	rows, err := s.pool.Query(ctx, settleFoundSQL(s.table, s.policy), args...)
	if err != nil {
		return nil, fmt.Errorf("settle %d rows found in the stream as published in %s: %w", len(items), s.table.Qualified(), err)
	}
	done, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("settle %d rows found in the stream as published in %s: %w", len(items), s.table.Qualified(), err)
	}
	return done, nil
}

// settleFoundSQL is SettleFound's statement: $1 work IDs, $2 claim
// generations, $3 stream sequences, $4 streams and $5 notes (not under
// delete). The guard is the row still scheduled under the generation the
// redrive read, not a claim.
func settleFoundSQL(t Table, policy Policy) string {
	const guard = `t.work_id = u.work_id AND t.claim_generation = u.gen AND t.state = 'scheduled'`
	if policy == PolicyDelete {
		return `DELETE FROM ` + t.String() + ` AS t USING unnest($1::text[], $2::bigint[]) AS u(work_id, gen)
			WHERE ` + guard + `
			RETURNING t.work_id`
	}
	return `UPDATE ` + t.String() + ` AS t SET ` + publishedSet + `
		FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[]) AS u(work_id, gen, seq, stream, note)
		WHERE ` + guard + `
		RETURNING t.work_id`
}
