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

// HeldAggregates returns every aggregate that has a row with the poller
// ('scheduled' or 'running') or dead-lettered ('failed'), with its lowest
// such row: the CDC path must not publish rows of these aggregates itself.
// Read at the start of every session, so the held set survives restarts,
// and while any aggregate is held, to release those that cleared.
func (s *Store) HeldAggregates(ctx context.Context) (map[AggregateKey]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, work_id
		FROM `+s.table.String()+`
		WHERE aggregate_type IS NOT NULL AND state IN `+withPollerStatesSQL+`
		ORDER BY aggregate_type, aggregate_id, aggregate_seq`)
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

// WithPoller reports whether any row of agg is with the poller or
// dead-lettered ('scheduled', 'running', 'failed'): the rule HeldAggregates
// holds an aggregate by, for one aggregate. The CDC path asks it when a
// new row of a held aggregate arrives, to take the aggregate back once the
// poller has caught up. 'running' counts (the poller may be publishing that
// row right now), and only 'published' means the broker acked it. 'ready'
// rows are the CDC path's own, ordered by its chains. A row with a higher
// sequence counts too (explicit sequences may commit out of order): while
// any row of the aggregate is with the poller, the CDC path keeps off it.
// One range scan of aggregate_idx over the aggregate's rows.
func (s *Store) WithPoller(ctx context.Context, agg AggregateKey) (bool, error) {
	var with bool
	err := s.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+s.table.String()+`
		WHERE aggregate_type = $1 AND aggregate_id = $2 AND state IN `+withPollerStatesSQL+`)`,
		agg.Type, agg.ID).Scan(&with)
	if err != nil {
		return false, fmt.Errorf("read whether aggregate (%q, %q) of %s has rows with the poller: %w", agg.Type, agg.ID, s.table.Qualified(), err)
	}
	return with, nil
}

// BlockedAggregates counts the aggregates whose rows wait behind a lower
// unpublished row that is with the poller or dead-lettered, and returns the
// oldest few of them with their blocking rows. The candidates are the rows
// with the poller (poll_idx) and the dead letters (parked_idx), and each
// one's waiting rows are counted in aggregate_idx above it: the cost is
// those rows, not the table nor an aggregate's published history (G16). A
// lower row of the aggregate still 'ready' (explicit sequences committed out
// of order) is not looked for: it is on its way through the CDC path, and
// finding it would walk the aggregate's history.
func (s *Store) BlockedAggregates(ctx context.Context, limit int) (total int64, oldest []Blocked, err error) {
	rows, err := s.pool.Query(ctx, `WITH firsts AS (
			SELECT DISTINCT ON (aggregate_type, aggregate_id) aggregate_type, aggregate_id, work_id, aggregate_seq, state, created_at
			FROM `+s.table.String()+`
			WHERE aggregate_type IS NOT NULL AND (poll_at IS NOT NULL OR parked = 'failed')
			ORDER BY aggregate_type, aggregate_id, aggregate_seq),
		blocked AS (
			SELECT f.*, (SELECT count(*) FROM `+s.table.String()+` w
				WHERE w.aggregate_type = f.aggregate_type AND w.aggregate_id = f.aggregate_id
				  AND w.aggregate_seq > f.aggregate_seq AND w.state IN `+blockingStatesSQL+`) AS waiting
			FROM firsts f)
		SELECT aggregate_type, aggregate_id, work_id, aggregate_seq, state, created_at, waiting, count(*) OVER ()
		FROM blocked WHERE waiting > 0 ORDER BY created_at LIMIT $1`, limit)
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
	rows, err := s.pool.Query(ctx, `UPDATE `+s.table.String()+` AS t SET state = 'expired', claimed_by = NULL, lease_until = NULL,
			last_error = 'expired: deadline ' || `+sqlTimeText("t.expires_at")+` || ' passed; ' ||
			CASE
				WHEN t.state = 'running' THEN 'possibly accepted: a worker held it when its lease ran out, after ' || t.attempts || ' attempt(s)'
				WHEN t.attempts = 0 THEN 'never attempted'
				WHEN t.last_error LIKE 'rejected:%' THEN 'none accepted: ' || t.attempts || ' attempt(s), the last ' || t.last_error
				ELSE 'possibly accepted: ' || t.attempts || ' attempt(s), the last ' || coalesce(t.last_error, 'without an error')
			END
		WHERE t.poll_at IS NOT NULL AND t.expires_at <= clock_timestamp()
		  AND (t.state = 'scheduled' OR (t.state = 'running' AND t.lease_until <= clock_timestamp()))
		RETURNING t.work_id`)
	if err != nil {
		return nil, fmt.Errorf("expire rows of %s past their deadline: %w", s.table.Qualified(), err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("expire rows of %s past their deadline: %w", s.table.Qualified(), err)
	}
	return ids, nil
}
