package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Counts is the table's health at a glance. Every figure is read through an
// index and costs the rows it counts, never the table (G16); which figures
// are exact is said by ReadyAtLeast and PublishedEstimated, and in
// docs/operator-commands.md ("How exact the counts are").
type Counts struct {
	// ByState: scheduled and running are exact (poll_idx), failed,
	// cancelled and expired are exact (parked_idx); ready is exact unless
	// ReadyAtLeast; published is exact unless PublishedEstimated, and -1
	// when it cannot be estimated yet (a large table never analyzed).
	ByState map[string]int64 `json:"by_state"`
	//
	// A 'ready' row the newest watermark covers (--on-publish none, G17)
	// counts as published, not as ready: the CDC path published it and
	// wrote nothing. ByState["ready"] is the ready rows in flight.
	//
	// ReadyAtLeast: the ready rows in flight reach past the newest
	// RecentRows rows, the only ones looked at, so ByState["ready"] is a
	// lower bound and OldestEligibleSeconds may be too. The slot's lag
	// tells how far the CDC path is behind.
	ReadyAtLeast bool `json:"ready_at_least"`
	// PublishedEstimated: the table is larger than ExactCountPages, and
	// published is the planner's estimate of the table's rows (pg_class,
	// kept by autovacuum and ANALYZE) minus the other states.
	PublishedEstimated bool `json:"published_estimated"`
	// PublishedByWatermark is how many of the published rows are 'ready'
	// rows the watermark covers (--on-publish none): published without a
	// stream sequence or published_at of their own. Exact on a table of at
	// most ExactCountPages pages; on a larger one it counts the newest
	// RecentRows rows only, and PublishedByWatermarkAtLeast is set.
	PublishedByWatermark        int64 `json:"published_by_watermark"`
	PublishedByWatermarkAtLeast bool  `json:"published_by_watermark_at_least"`
	// Watermark is the newest recorded watermark of the table's slots; nil
	// when none was ever recorded (the table never ran with
	// --on-publish none).
	Watermark *WatermarkStatus `json:"watermark,omitempty"`
	// OldestEligibleSeconds is the age of the oldest row that is due and not
	// published: ready rows in flight (the CDC path's, not covered by the
	// watermark), among the newest RecentRows rows, and scheduled rows past
	// their available_at. Zero when there is none.
	OldestEligibleSeconds float64 `json:"oldest_eligible_seconds"`
	// FailedByReason groups failed rows by the class and reason at the head
	// of last_error ("rejected: max_payload", "uncertain: timeout", ...).
	FailedByReason map[string]int64 `json:"failed_by_reason"`
	// BlockedAggregates counts the aggregates whose later rows wait behind
	// a row with the poller or dead-lettered (G12); OldestBlocked is the
	// one blocked longest, with its blocking row. BlockedAggregatesAtLeast:
	// more aggregates are held than the BlockedAggregatesLookedAt looked at
	// (BlockedLookAt, G16), so the count is a lower bound and OldestBlocked
	// the oldest of those looked at. Blocked are the BlockedShown oldest,
	// for the console.
	BlockedAggregates         int64     `json:"blocked_aggregates"`
	BlockedAggregatesAtLeast  bool      `json:"blocked_aggregates_at_least"`
	BlockedAggregatesLookedAt int       `json:"blocked_aggregates_looked_at"`
	OldestBlocked             *Blocked  `json:"oldest_blocked,omitempty"`
	Blocked                   []Blocked `json:"-"`
}

// BlockedShown is how many of the oldest blocked aggregates Counts reads.
const BlockedShown = 5

// WatermarkStatus is the newest watermark as status and the console show
// it: the slot that recorded it, the position the slot had confirmed past,
// when it was recorded and how long ago (on the database's clock).
type WatermarkStatus struct {
	Slot       string    `json:"slot"`
	LSN        string    `json:"lsn"`
	RecordedAt time.Time `json:"recorded_at"`
	AgeSeconds float64   `json:"age_seconds"`
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
	// The ready rows among the newest, split by the watermark into
	// published (covered) and in flight: the count of each, the earliest
	// available_at of those in flight, and whether the oldest row looked
	// at is in flight itself (then they may reach further back). The
	// watermark is a scalar subquery on the small <table>_slots, run once.
	var ready, covered int64
	var readyDue *float64
	err := s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'ready' AND NOT covered),
			count(*) FILTER (WHERE state = 'ready' AND covered),
			extract(epoch FROM clock_timestamp() - min(`+clamped("available_at")+`) FILTER (WHERE state = 'ready' AND NOT covered))::float8,
			count(*) = $1 AND (array_agg(state = 'ready' AND NOT covered ORDER BY created_at, work_id))[1]
		FROM (SELECT r.*, `+s.coveredSQL("r")+` AS covered
			FROM (`+s.recentSQL("state, available_at, created_at, work_id, xact_id")+`) r) r`, int64(RecentRows)).
		Scan(&ready, &covered, &readyDue, &c.ReadyAtLeast)
	if err != nil {
		return c, fmt.Errorf("count ready rows of %s: %w", s.table.Qualified(), err)
	}
	c.ByState[StateReady] = ready
	c.PublishedByWatermark, c.PublishedByWatermarkAtLeast = covered, true
	if w, found, err := s.LatestWatermark(ctx); err != nil {
		return c, err
	} else if !found {
		// Never recorded: nothing is covered, exactly.
		c.PublishedByWatermarkAtLeast = false
	} else {
		c.Watermark = &WatermarkStatus{Slot: w.Slot, LSN: w.LSN.String(), RecordedAt: w.RecordedAt}
		if err := s.pool.QueryRow(ctx, `SELECT greatest(extract(epoch FROM clock_timestamp() - $1::timestamptz), 0)::float8`, w.RecordedAt).
			Scan(&c.Watermark.AgeSeconds); err != nil {
			return c, fmt.Errorf("age of the watermark of %s: %w", s.table.Qualified(), err)
		}
	}
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
	var exactCovered int64
	if c.ByState[StatePublished], exactCovered, c.PublishedEstimated, err = s.published(ctx, others); err != nil {
		return c, err
	}
	if !c.PublishedEstimated {
		c.PublishedByWatermark, c.PublishedByWatermarkAtLeast = exactCovered, false
	}
	rows, err := s.pool.Query(ctx, `SELECT coalesce(`+ClassAndReasonSQL("last_error")+`, 'unknown'), count(*)
		FROM `+tbl+` WHERE parked = 'failed' GROUP BY 1 ORDER BY 2 DESC`)
	if err != nil {
		return c, fmt.Errorf("failures in %s: %w", s.table.Qualified(), err)
	}
	var reason string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&reason, &n}, func() error { c.FailedByReason[reason] = n; return nil }); err != nil {
		return c, fmt.Errorf("failures in %s: %w", s.table.Qualified(), err)
	}
	set, err := s.BlockedAggregates(ctx, BlockedShown)
	if err != nil {
		return c, err
	}
	c.BlockedAggregates, c.BlockedAggregatesAtLeast, c.BlockedAggregatesLookedAt, c.Blocked = set.Total, set.AtLeast, set.LookedAt, set.Oldest
	if len(set.Oldest) > 0 {
		c.OldestBlocked = &set.Oldest[0]
	}
	return c, nil
}

// published counts the published rows, the ready rows the watermark covers
// among them: exactly on a table of at most ExactCountPages pages (covered
// is then the covered ready rows), else as the planner's estimate of the
// table's rows (pg_class.reltuples per page, times the pages the table has
// now, as the planner scales it) minus others, the rows counted in the
// other states (ready: only those in flight, so the estimate includes the
// covered ones). -1 when a large table has no estimate yet (never vacuumed
// or analyzed).
func (s *Store) published(ctx context.Context, others int64) (n, covered int64, estimated bool, err error) {
	var tuples float64
	var statPages, pages int64
	err = s.pool.QueryRow(ctx, `SELECT c.reltuples::float8, c.relpages::bigint,
			pg_relation_size(c.oid) / current_setting('block_size')::bigint
		FROM pg_catalog.pg_class c WHERE c.oid = $1::regclass`, s.table.String()).Scan(&tuples, &statPages, &pages)
	if err != nil {
		return 0, 0, false, fmt.Errorf("read the size of %s: %w", s.table.Qualified(), err)
	}
	if pages <= ExactCountPages {
		err = s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE `+s.publishedSQL("o")+`),
				count(*) FILTER (WHERE o.state = 'ready' AND `+s.coveredSQL("o")+`)
			FROM `+s.table.String()+` AS o WHERE o.state IN ('published', 'ready')`).Scan(&n, &covered)
		if err != nil {
			return 0, 0, false, fmt.Errorf("count published rows of %s: %w", s.table.Qualified(), err)
		}
		return n, covered, false, nil
	}
	if tuples < 0 || statPages == 0 {
		return -1, 0, true, nil
	}
	return max(0, int64(tuples/float64(statPages)*float64(pages))-others), 0, true, nil
}
