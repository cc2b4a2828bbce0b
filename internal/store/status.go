package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Counts is the table's health at a glance. Every figure is read through an
// index and costs the rows it counts, never the table (G16); which figures
// are exact is said by ReadyAtLeast and PublishedEstimated, and in
// docs/operations.md ("How exact the counts are").
type Counts struct {
	// ByState: scheduled and running are exact (poll_idx), failed,
	// cancelled and expired are exact (parked_idx); ready is exact unless
	// ReadyAtLeast; published is exact unless PublishedEstimated, and -1
	// when it cannot be estimated yet (a large table never analyzed).
	ByState map[string]int64 `json:"by_state"`
	// ReadyAtLeast: the ready rows reach past the newest RecentRows rows,
	// the only ones looked at, so ByState["ready"] is a lower bound and
	// OldestEligibleSeconds may be too. The slot's lag tells how far the
	// CDC path is behind.
	ReadyAtLeast bool `json:"ready_at_least"`
	// PublishedEstimated: the table is larger than ExactCountPages, and
	// published is the planner's estimate of the table's rows (pg_class,
	// kept by autovacuum and ANALYZE) minus the other states.
	PublishedEstimated bool `json:"published_estimated"`
	// OldestEligibleSeconds is the age of the oldest row that is due and not
	// published: ready rows (the CDC path's) and scheduled rows past their
	// available_at. Zero when there is none.
	OldestEligibleSeconds float64 `json:"oldest_eligible_seconds"`
	// FailedByReason groups failed rows by the class and reason at the head
	// of last_error ("rejected: max_payload", "uncertain: timeout", ...).
	FailedByReason map[string]int64 `json:"failed_by_reason"`
	// BlockedAggregates counts the aggregates whose later rows wait behind
	// a row with the poller or dead-lettered (G12); OldestBlocked is the
	// one blocked longest, with its blocking row.
	BlockedAggregates int64    `json:"blocked_aggregates"`
	OldestBlocked     *Blocked `json:"oldest_blocked,omitempty"`
}

// RecentRows is how many of the newest rows (by created_at) the statements
// that look for ready rows read. No index can find ready rows without making
// the CDC path's mark a non-HOT update (see migration 0012), but ready rows
// are the newest ones: the CDC path settles rows in commit order, so while
// it keeps up every ready row is among the last few thousand inserted.
const RecentRows = 10000

// ExactCountPages is the size, in 8 kB pages, up to which Counts counts
// published rows exactly (a scan of at most 10 MB, a few milliseconds).
// Above it, published is estimated from the planner's statistics.
const ExactCountPages = 1280

// recentSQL is the newest RecentRows rows, through created_idx; $1 is the
// limit.
func (s *Store) recentSQL(cols string) string {
	return `SELECT ` + cols + ` FROM ` + s.table.String() + ` ORDER BY created_at DESC, work_id DESC LIMIT $1`
}

// clamped is col clamped per row to the range a producer may write
// (migration 0008): an older row's '-infinity' cannot be subtracted from a
// clock. Per row, not the min: greatest and least skip a NULL, and would turn
// "no row" into the year 0001.
func clamped(col string) string {
	return `least(greatest(` + col + `, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00')`
}

// Counts reads counts by state, the oldest eligible age and failures by
// reason.
func (s *Store) Counts(ctx context.Context) (Counts, error) {
	c := Counts{ByState: map[string]int64{}, FailedByReason: map[string]int64{}}
	for _, st := range States {
		c.ByState[st] = 0
	}
	tbl := s.table.String()
	byState := func(what, q string) error {
		rows, err := s.pool.Query(ctx, q)
		if err != nil {
			return fmt.Errorf("count %s rows of %s: %w", what, s.table.Qualified(), err)
		}
		var state string
		var n int64
		if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error { c.ByState[state] = n; return nil }); err != nil {
			return fmt.Errorf("count %s rows of %s: %w", what, s.table.Qualified(), err)
		}
		return nil
	}
	// poll_at is set exactly on scheduled and running rows; parked exactly
	// on failed, cancelled and expired ones.
	if err := byState("the poller's", `SELECT state, count(*) FROM `+tbl+` WHERE poll_at IS NOT NULL GROUP BY state`); err != nil {
		return c, err
	}
	if err := byState("parked", `SELECT parked, count(*) FROM `+tbl+` WHERE parked IS NOT NULL GROUP BY parked`); err != nil {
		return c, err
	}
	// The ready rows among the newest: their count, the earliest
	// available_at among them, and whether the oldest row looked at is
	// ready itself (then the ready rows may reach further back).
	var ready int64
	var readyDue *float64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'ready'),
			extract(epoch FROM clock_timestamp() - min(`+clamped("available_at")+`) FILTER (WHERE state = 'ready'))::float8,
			count(*) = $1 AND (array_agg(state ORDER BY created_at, work_id))[1] = 'ready'
		FROM (`+s.recentSQL("state, available_at, created_at, work_id")+`) r`, int64(RecentRows)).
		Scan(&ready, &readyDue, &c.ReadyAtLeast)
	if err != nil {
		return c, fmt.Errorf("count ready rows of %s: %w", s.table.Qualified(), err)
	}
	c.ByState[StateReady] = ready
	// The oldest due scheduled row: the first of poll_idx's order that is
	// not running.
	var scheduledDue *float64
	err = s.pool.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - `+clamped("poll_at")+`)::float8 FROM `+tbl+`
		WHERE poll_at IS NOT NULL AND poll_at <= clock_timestamp() AND state = 'scheduled'
		ORDER BY poll_at LIMIT 1`).Scan(&scheduledDue)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return c, fmt.Errorf("oldest due row in %s: %w", s.table.Qualified(), err)
	}
	for _, age := range []*float64{readyDue, scheduledDue} {
		if age != nil {
			c.OldestEligibleSeconds = max(c.OldestEligibleSeconds, *age)
		}
	}
	others := int64(0)
	for st, n := range c.ByState {
		if st != StatePublished {
			others += n
		}
	}
	if c.ByState[StatePublished], c.PublishedEstimated, err = s.published(ctx, others); err != nil {
		return c, err
	}
	rows, err := s.pool.Query(ctx, `SELECT coalesce(substring(last_error FROM '^([a-z]+: [a-z_]+)'), 'unknown'), count(*)
		FROM `+tbl+` WHERE parked = 'failed' GROUP BY 1 ORDER BY 2 DESC`)
	if err != nil {
		return c, fmt.Errorf("failures in %s: %w", s.table.Qualified(), err)
	}
	var reason string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&reason, &n}, func() error { c.FailedByReason[reason] = n; return nil }); err != nil {
		return c, fmt.Errorf("failures in %s: %w", s.table.Qualified(), err)
	}
	total, oldest, err := s.BlockedAggregates(ctx, 1)
	if err != nil {
		return c, err
	}
	c.BlockedAggregates = total
	if len(oldest) > 0 {
		c.OldestBlocked = &oldest[0]
	}
	return c, nil
}

// published counts the published rows: exactly on a table of at most
// ExactCountPages pages, else as the planner's estimate of the table's rows
// (pg_class.reltuples per page, times the pages the table has now, as the
// planner scales it) minus others, the rows counted in the other states.
// -1 when a large table has no estimate yet (never vacuumed or analyzed).
func (s *Store) published(ctx context.Context, others int64) (n int64, estimated bool, err error) {
	var tuples float64
	var statPages, pages int64
	err = s.pool.QueryRow(ctx, `SELECT c.reltuples::float8, c.relpages::bigint,
			pg_relation_size(c.oid) / current_setting('block_size')::bigint
		FROM pg_catalog.pg_class c WHERE c.oid = $1::regclass`, s.table.String()).Scan(&tuples, &statPages, &pages)
	if err != nil {
		return 0, false, fmt.Errorf("read the size of %s: %w", s.table.Qualified(), err)
	}
	if pages <= ExactCountPages {
		err = s.pool.QueryRow(ctx, `SELECT count(*) FROM `+s.table.String()+` WHERE state = 'published'`).Scan(&n)
		if err != nil {
			return 0, false, fmt.Errorf("count published rows of %s: %w", s.table.Qualified(), err)
		}
		return n, false, nil
	}
	if tuples < 0 || statPages == 0 {
		return -1, true, nil
	}
	return max(0, int64(tuples/float64(statPages)*float64(pages))-others), true, nil
}
