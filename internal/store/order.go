package store

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// Order of work per aggregate (G12) and business deadlines (G13). Which
// states block the later rows of an aggregate: BlockingStates (states.go).

// DefaultDeadlineMargin is how close to its deadline a row may still be
// published, on either path: the time a publish and its ack may take.
const DefaultDeadlineMargin = time.Second

// AggregateKey names an aggregate.
type AggregateKey struct {
	Type string `json:"type"`
	ID   string `json:"id"`
}

// String prints the aggregate for people: type and id each as a Go-quoted
// string, "order"/"103". Either may contain a slash, so a bare type/id would
// print a/b+c and a+b/c alike; quoted, every pair prints differently, and
// control and bidi characters from the row are escaped.
func (k AggregateKey) String() string { return strconv.Quote(k.Type) + "/" + strconv.Quote(k.ID) }

// Blocked is an aggregate whose lowest unpublished row is with the poller or
// dead-lettered, and so holds the rows after it.
type Blocked struct {
	Aggregate AggregateKey `json:"aggregate"`
	WorkID    string       `json:"work_id"` // the blocking row: the aggregate's lowest unpublished sequence
	Seq       int64        `json:"aggregate_seq"`
	State     string       `json:"state"`
	Since     time.Time    `json:"since"`   // the blocking row's created_at
	Waiting   int64        `json:"waiting"` // rows of the aggregate behind it
}

// The held set (G12) is read without reading the table (G16). A row with the
// poller ('scheduled', 'running') is exactly a row with poll_at set, and
// aggregate_held_idx holds those of aggregates; a dead letter is a row whose
// parked column (kept by triggers, migration 0012) is 'failed', and
// dead_letter_idx holds those of aggregates (its state is checked too). Neither index reads a column the CDC
// path's mark changes, so marks stay HOT updates (TestCDCMarksStayHOT).

// heldRowsSQL selects (aggregate_type, aggregate_id, aggregate_seq,
// work_id) of every row of an aggregate that is with the poller (read from
// aggregate_held_idx alone) or dead-lettered.
func (s *Store) heldRowsSQL() string {
	tbl := s.table.String()
	return `SELECT p.aggregate_type, p.aggregate_id, p.aggregate_seq, p.work_id FROM ` + tbl + ` AS p
		WHERE p.poll_at IS NOT NULL AND p.aggregate_type IS NOT NULL
		UNION ALL
		SELECT f.aggregate_type, f.aggregate_id, f.aggregate_seq, f.work_id FROM ` + tbl + ` AS f
		WHERE f.parked = '` + StateFailed + `' AND f.aggregate_type IS NOT NULL AND f.state = '` + StateFailed + `'`
}

// heldAggregatesSQL is HeldAggregates' statement: each held aggregate's
// lowest row with the poller or dead-lettered.
func (s *Store) heldAggregatesSQL() string {
	return `SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, work_id
		FROM (` + s.heldRowsSQL() + `) AS h
		ORDER BY aggregate_type, aggregate_id, aggregate_seq`
}

// HeldAggregates returns every aggregate that has a row with the poller
// ('scheduled' or 'running') or dead-lettered ('failed'), with its lowest
// such row: the CDC path must not publish rows of these aggregates itself.
// Read at the start of every session, so the held set survives restarts,
// and while any aggregate is held, to release those that cleared. It reads
// the held rows only (aggregate_held_idx and the dead letters), however
// large the table.
func (s *Store) HeldAggregates(ctx context.Context) (map[AggregateKey]string, error) {
	rows, err := s.pool.Query(ctx, s.heldAggregatesSQL())
	if err != nil {
		return nil, fmt.Errorf("read held aggregates of %s: %w", s.table.Qualified(), err)
	}
	out := map[AggregateKey]string{}
	var k AggregateKey
	var id string
	if _, err := pgx.ForEachRow(rows, []any{&k.Type, &k.ID, &id}, func() error { out[k] = id; return nil }); err != nil {
		return nil, fmt.Errorf("read held aggregates of %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// withPollerSQL is WithPoller's statement: $1 aggregate_type, $2
// aggregate_id.
func (s *Store) withPollerSQL() string {
	return `SELECT EXISTS (SELECT 1 FROM ` + s.table.String() + ` AS p
			WHERE p.aggregate_type = $1 AND p.aggregate_id = $2 AND p.poll_at IS NOT NULL AND p.aggregate_type IS NOT NULL)
		OR EXISTS (SELECT 1 FROM ` + s.table.String() + ` AS f
			WHERE f.aggregate_type = $1 AND f.aggregate_id = $2 AND f.parked = '` + StateFailed + `' AND f.state = '` + StateFailed + `')`
}

// WithPoller reports whether any row of agg is with the poller or
// dead-lettered ('scheduled', 'running', 'failed'): the rule HeldAggregates
// holds an aggregate by, for one aggregate. The CDC path asks it when a
// new row of a held aggregate arrives, to take the aggregate back once the
// poller has caught up. 'running' counts (the poller may be publishing that
// row right now), and only 'published' means the broker acked it. 'ready'
// rows are the CDC path's own, ordered by its chains. A row with a higher
// sequence counts too (explicit sequences may commit out of order): while
// any row of the aggregate is with the poller, the CDC path keeps off it.
// It reads the aggregate's held rows only, never its published history.
func (s *Store) WithPoller(ctx context.Context, agg AggregateKey) (bool, error) {
	var with bool
	err := s.pool.QueryRow(ctx, s.withPollerSQL(), agg.Type, agg.ID).Scan(&with)
	if err != nil {
		return false, fmt.Errorf("read whether aggregate (%q, %q) of %s has rows with the poller: %w", agg.Type, agg.ID, s.table.Qualified(), err)
	}
	return with, nil
}

// blockedAggregatesSQL is BlockedAggregates' statement: $1 the number of
// aggregates to return.
//
// held: each held aggregate's lowest row with the poller or dead-lettered.
// The aggregate is blocked by it unless the row right below it is 'ready'
// (then it waits for the CDC path's row, not for the poller). Only that
// immediate predecessor is read, not the history below it: a 'ready' row
// further down, under published ones, is there only when explicit
// sequences committed out of order, and is not seen. waiting reads the
// aggregate's rows above its first held row.
func (s *Store) blockedAggregatesSQL() string {
	tbl := s.table.String()
	return `WITH held AS (
			SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, work_id, aggregate_seq
			FROM (` + s.heldRowsSQL() + `) AS h
			ORDER BY aggregate_type, aggregate_id, aggregate_seq),
		blocked AS (
			SELECT f.*, o.state, o.created_at, (SELECT count(*) FROM ` + tbl + ` w
				WHERE w.aggregate_type = f.aggregate_type AND w.aggregate_id = f.aggregate_id
				  AND w.aggregate_seq > f.aggregate_seq AND w.state IN ` + blockingStatesSQL + `
				  AND NOT (w.state = '` + StateReady + `' AND ` + s.coveredSQL("w") + `)) AS waiting
			FROM held f JOIN ` + tbl + ` o ON o.work_id = f.work_id
			WHERE coalesce((SELECT CASE WHEN b.state = '` + StateReady + `' AND ` + s.coveredSQL("b") + ` THEN '` + StatePublished + `' ELSE b.state END FROM ` + tbl + ` b
				WHERE b.aggregate_type = f.aggregate_type AND b.aggregate_id = f.aggregate_id AND b.aggregate_seq < f.aggregate_seq
				ORDER BY b.aggregate_seq DESC LIMIT 1), '') <> '` + StateReady + `')
		SELECT aggregate_type, aggregate_id, work_id, aggregate_seq, state, created_at, waiting, count(*) OVER ()
		FROM blocked WHERE waiting > 0 ORDER BY created_at LIMIT $1`
}

// BlockedAggregates counts the aggregates whose rows wait behind a lower
// unpublished row that is with the poller or dead-lettered, and returns the
// oldest few of them with their blocking rows. It reads the held rows and,
// per held aggregate, the rows from its first held one up.
func (s *Store) BlockedAggregates(ctx context.Context, limit int) (total int64, oldest []Blocked, err error) {
	rows, err := s.pool.Query(ctx, s.blockedAggregatesSQL(), limit)
	if err != nil {
		return 0, nil, fmt.Errorf("read blocked aggregates of %s: %w", s.table.Qualified(), err)
	}
	var b Blocked
	_, err = pgx.ForEachRow(rows, []any{&b.Aggregate.Type, &b.Aggregate.ID, &b.WorkID, &b.Seq, &b.State, anyTime{&b.Since}, &b.Waiting, &total}, func() error {
		oldest = append(oldest, b)
		return nil
	})
	if err != nil {
		return 0, nil, fmt.Errorf("read blocked aggregates of %s: %w", s.table.Qualified(), err)
	}
	return total, oldest, nil
}

// ExpireDue moves rows whose deadline passed out of the poller's hands into
// 'expired' ('scheduled' rows, and 'running' ones whose lease ran out), with
// last_error saying whether any attempt was made and whether the broker may
// have taken one: "never attempted", "none accepted" (every attempt was a
// known rejection) or "possibly accepted". Decided on the database clock.
// It returns the work IDs it expired.
func (s *Store) ExpireDue(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, s.expireDueSQL())
	if err != nil {
		return nil, fmt.Errorf("expire rows of %s past their deadline: %w", s.table.Qualified(), err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("expire rows of %s past their deadline: %w", s.table.Qualified(), err)
	}
	return ids, nil
}

// expireDueSQL is ExpireDue's statement. The deadline is compared with one
// reading of the clock, taken once for the statement (an InitPlan): a value
// the planner can look up in expires_idx, where clock_timestamp() itself,
// volatile, can only filter the rows already read. A row that reaches its
// deadline while the statement runs is the next sweep's.
func (s *Store) expireDueSQL() string {
	return `UPDATE ` + s.table.String() + ` AS t SET state = 'expired', claimed_by = NULL, lease_until = NULL,
			last_error = 'expired: deadline ' || ` + sqlTimeText("t.expires_at") + ` || ' passed; ' ||
			CASE
				WHEN t.state = 'running' THEN 'possibly accepted: a worker held it when its lease ran out, after ' || t.attempts || ' attempt(s)'
				WHEN t.attempts = 0 THEN 'never attempted'
				WHEN t.last_error LIKE 'rejected:%' THEN 'none accepted: ' || t.attempts || ' attempt(s), the last ' || t.last_error
				ELSE 'possibly accepted: ' || t.attempts || ' attempt(s), the last ' || coalesce(t.last_error, 'without an error')
			END
		WHERE t.poll_at IS NOT NULL AND t.expires_at IS NOT NULL AND t.expires_at <= (SELECT clock_timestamp())
		  AND (t.state = 'scheduled' OR (t.state = 'running' AND t.lease_until <= clock_timestamp()))
		RETURNING t.work_id`
}
