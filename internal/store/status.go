package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Counts is the table's health at a glance.
type Counts struct {
	ByState map[string]int64 `json:"by_state"`
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

// Counts reads counts by state, the oldest eligible age and failures by
// reason.
func (s *Store) Counts(ctx context.Context) (Counts, error) {
	c := Counts{ByState: map[string]int64{}, FailedByReason: map[string]int64{}}
	for _, st := range States {
		c.ByState[st] = 0
	}
	rows, err := s.pool.Query(ctx, `SELECT state, count(*) FROM `+s.table.String()+` GROUP BY state`)
	if err != nil {
		return c, fmt.Errorf("count %s by state: %w", s.table.Qualified(), err)
	}
	var state string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&state, &n}, func() error { c.ByState[state] = n; return nil }); err != nil {
		return c, fmt.Errorf("count %s by state: %w", s.table.Qualified(), err)
	}
	// Each value clamped to the range a producer may write (migration
	// 0008): an older row's '-infinity' cannot be subtracted from a clock.
	// Per row, not the min: greatest and least skip a NULL, and would turn
	// "no row" into the year 0001.
	err = s.pool.QueryRow(ctx, `SELECT coalesce(extract(epoch FROM clock_timestamp() -
			min(least(greatest(available_at, '0001-01-01 00:00:00+00'), '9999-12-31 23:59:59+00'))), 0)::float8
		FROM `+s.table.String()+` WHERE state = 'ready' OR (state = 'scheduled' AND available_at <= clock_timestamp())`).
		Scan(&c.OldestEligibleSeconds)
	if err != nil {
		return c, fmt.Errorf("oldest eligible row in %s: %w", s.table.Qualified(), err)
	}
	rows, err = s.pool.Query(ctx, `SELECT coalesce(substring(last_error FROM '^([a-z]+: [a-z_]+)'), 'unknown'), count(*)
		FROM `+s.table.String()+` WHERE state = 'failed' GROUP BY 1 ORDER BY 2 DESC`)
	if err != nil {
		return c, fmt.Errorf("failures in %s: %w", s.table.Qualified(), err)
	}
	var reason string
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
