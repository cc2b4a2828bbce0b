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
	// WaitingAtLeast: Waiting reached BlockedLookAt, where counting stops.
	WaitingAtLeast bool `json:"waiting_at_least,omitempty"`
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

// BlockedLookAt bounds BlockedAggregates: it looks at that many held
// aggregates at most, and counts that many rows behind a blocking row at
// most. Each aggregate looked at costs a few index probes, so the statement
// costs a bounded amount whatever the number of blocked aggregates (G16);
// past the bound the count is a lower bound (BlockedSet.AtLeast), as
// status prints other lower bounds. On a partitioned table every probe
// reads each partition's index, so it looks at BlockedLookAt divided by the
// number of partitions, and never fewer than BlockedLookAtLeast.
const (
	BlockedLookAt      = 10000
	BlockedLookAtLeast = 100
)

// BlockedSet is what BlockedAggregates read.
type BlockedSet struct {
	// Total is the number of blocked aggregates among the held aggregates
	// looked at. AtLeast: there are more than LookedAt held aggregates,
	// only the first LookedAt (in aggregate order) were looked at, and
	// Total is a lower bound.
	Total    int64 `json:"total"`
	AtLeast  bool  `json:"at_least"`
	LookedAt int   `json:"looked_at"`
	// Oldest are the blocked aggregates whose blocking rows are the
	// oldest (created_at) among those looked at: the oldest of all unless
	// AtLeast.
	Oldest []Blocked `json:"oldest"`
}

// heldHeadSQL is the first row (lowest aggregate_type, aggregate_id,
// aggregate_seq) with the poller or dead-lettered of the first held
// aggregate after (after.aggregate_type, after.aggregate_id), or of the
// first of all when after is empty: one probe of aggregate_held_idx and one
// of dead_letter_idx, each stopping at its first entry. The lower of the
// two is the aggregate's head, as in heldAggregatesSQL.
func (s *Store) heldHeadSQL(after string) string {
	tbl := s.table.String()
	cond := func(alias string) string {
		if after == "" {
			return ""
		}
		return ` AND (` + alias + `.aggregate_type, ` + alias + `.aggregate_id) > (` + after + `.aggregate_type, ` + after + `.aggregate_id)`
	}
	// The key and work_id only: from aggregate_held_idx alone. With another
	// column to fetch, the planner may prefer aggregate_idx, whose entries
	// include every aggregate's published history.
	cols := func(a string) string {
		return a + `.aggregate_type, ` + a + `.aggregate_id, ` + a + `.aggregate_seq, ` + a + `.work_id`
	}
	return `SELECT x.* FROM (
			(SELECT ` + cols("p") + ` FROM ` + tbl + ` AS p
			WHERE p.poll_at IS NOT NULL AND p.aggregate_type IS NOT NULL` + cond("p") + `
			ORDER BY p.aggregate_type, p.aggregate_id, p.aggregate_seq LIMIT 1)
			UNION ALL
			(SELECT ` + cols("f") + ` FROM ` + tbl + ` AS f
			WHERE f.parked = '` + StateFailed + `' AND f.aggregate_type IS NOT NULL AND f.state = '` + StateFailed + `'` + cond("f") + `
			ORDER BY f.aggregate_type, f.aggregate_id, f.aggregate_seq LIMIT 1)
		) AS x ORDER BY x.aggregate_type, x.aggregate_id, x.aggregate_seq LIMIT 1`
}

// blockedAggregatesSQL is BlockedAggregates' statement: $1 the number of
// aggregates to return, $2 BlockedLookAt, $3 BlockedLookAtLeast, $4 the
// table.
//
// heads walks the held aggregates in index order, one aggregate a step
// (heldHeadSQL, a skip over the rows of each), and looked stops it after
// budget + 1 of them: the last says only that there are more. budget is
// $2 divided by the table's partitions, at least $3. It used to
// gather every held row, sort them and join each aggregate's head back to
// the table by a nested loop: quadratic, 20,000 blocked aggregates took
// minutes.
//
// A head blocks its aggregate unless the row right below it is 'ready'
// (then it waits for the CDC path's row, not for the poller). Only that
// immediate predecessor is read, not the history below it: a 'ready' row
// further down, under published ones, is there only when explicit
// sequences committed out of order, and is not seen. It blocks something
// when a row above it waits (EXISTS: the first one found); waiting, read
// for the $1 returned only, counts them up to $2.
func (s *Store) blockedAggregatesSQL() string {
	tbl := s.table.String()
	return `WITH RECURSIVE heads AS (
			(` + s.heldHeadSQL("") + `)
			UNION ALL
			SELECT n.* FROM heads AS h CROSS JOIN LATERAL (` + s.heldHeadSQL("h") + `) AS n),
		budget AS MATERIALIZED (SELECT greatest($2::int / greatest(count(*)::int, 1), $3::int) AS n
			FROM pg_catalog.pg_inherits WHERE inhparent = $4::regclass),
		looked AS MATERIALIZED (SELECT * FROM heads LIMIT (SELECT n FROM budget) + 1),
		first AS (SELECT * FROM looked ORDER BY aggregate_type, aggregate_id LIMIT (SELECT n FROM budget)),
		blocked AS MATERIALIZED (
			SELECT f.*, o.state, o.created_at FROM first AS f
			CROSS JOIN LATERAL (SELECT o.state, o.created_at FROM ` + tbl + ` o
				WHERE o.aggregate_type = f.aggregate_type AND o.aggregate_id = f.aggregate_id AND o.aggregate_seq = f.aggregate_seq
				  AND o.work_id = f.work_id LIMIT 1) AS o
			WHERE coalesce((SELECT CASE WHEN b.state = '` + StateReady + `' AND ` + s.coveredSQL("b") + ` THEN '` + StatePublished + `' ELSE b.state END FROM ` + tbl + ` b
				WHERE b.aggregate_type = f.aggregate_type AND b.aggregate_id = f.aggregate_id AND b.aggregate_seq < f.aggregate_seq
				ORDER BY b.aggregate_seq DESC LIMIT 1), '') <> '` + StateReady + `'
			  AND EXISTS (SELECT 1 FROM ` + tbl + ` w
				WHERE w.aggregate_type = f.aggregate_type AND w.aggregate_id = f.aggregate_id
				  AND w.aggregate_seq > f.aggregate_seq AND w.state IN ` + blockingStatesSQL + `
				  AND NOT (w.state = '` + StateReady + `' AND ` + s.coveredSQL("w") + `))),
		total AS (SELECT count(*) AS n, (SELECT count(*) FROM looked) > (SELECT n FROM budget) AS more, (SELECT n FROM budget) AS budget FROM blocked)
		SELECT t.n, t.more, t.budget, o.aggregate_type, o.aggregate_id, o.work_id, o.aggregate_seq, o.state, o.created_at, o.waiting
		FROM total AS t LEFT JOIN LATERAL (
			SELECT b.*, (SELECT count(*) FROM (SELECT FROM ` + tbl + ` w
				WHERE w.aggregate_type = b.aggregate_type AND w.aggregate_id = b.aggregate_id
				  AND w.aggregate_seq > b.aggregate_seq AND w.state IN ` + blockingStatesSQL + `
				  AND NOT (w.state = '` + StateReady + `' AND ` + s.coveredSQL("w") + `) LIMIT $2::int) AS c) AS waiting
			FROM (SELECT * FROM blocked ORDER BY created_at, work_id LIMIT $1::int) AS b) AS o ON true
		ORDER BY o.created_at, o.work_id`
}

// BlockedAggregates counts the aggregates whose rows wait behind a lower
// unpublished row that is with the poller or dead-lettered, and returns the
// oldest limit of them with their blocking rows. It looks at
// BlockedLookAt held aggregates at most, a few index probes each, and
// counts the rows behind the ones it returns up to BlockedLookAt
// (Blocked.WaitingAtLeast): its cost has a bound, however many aggregates
// are blocked (G16).
func (s *Store) BlockedAggregates(ctx context.Context, limit int) (BlockedSet, error) {
	var set BlockedSet
	rows, err := s.pool.Query(ctx, s.blockedAggregatesSQL(), limit, BlockedLookAt, BlockedLookAtLeast, s.table.String())
	if err != nil {
		return set, fmt.Errorf("read blocked aggregates of %s: %w", s.table.Qualified(), err)
	}
	var typ, id, workID, state *string
	var seq, waiting *int64
	var since *time.Time
	_, err = pgx.ForEachRow(rows, []any{&set.Total, &set.AtLeast, &set.LookedAt, &typ, &id, &workID, &seq, &state, anyTimePtr{&since}, &waiting}, func() error {
		if workID == nil {
			return nil // none blocked: the totals alone
		}
		b := Blocked{Aggregate: AggregateKey{Type: *typ, ID: *id}, WorkID: *workID, Seq: *seq, State: *state, Waiting: *waiting}
		b.WaitingAtLeast = b.Waiting >= BlockedLookAt
		if since != nil {
			b.Since = *since
		}
		set.Oldest = append(set.Oldest, b)
		return nil
	})
	if err != nil {
		return BlockedSet{}, fmt.Errorf("read blocked aggregates of %s: %w", s.table.Qualified(), err)
	}
	return set, nil
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
			last_error = ` + ClassExpired.SQLNote(`'deadline ' || `+sqlTimeText("t.expires_at")+` || ' passed; '`) + ` ||
			CASE
				WHEN t.state = 'running' THEN 'possibly accepted: a worker held it when its lease ran out, after ' || t.attempts || ' attempt(s)'
				WHEN t.attempts = 0 THEN 'never attempted'
				WHEN ` + ClassRejected.Like("t.last_error") + ` THEN 'none accepted: ' || t.attempts || ' attempt(s), the last ' || t.last_error
				ELSE 'possibly accepted: ' || t.attempts || ' attempt(s), the last ' || coalesce(t.last_error, 'without an error')
			END
		WHERE t.poll_at IS NOT NULL AND t.expires_at IS NOT NULL AND t.expires_at <= (SELECT clock_timestamp())
		  AND (t.state = 'scheduled' OR (t.state = 'running' AND t.lease_until <= clock_timestamp()))
		RETURNING t.work_id`
}
