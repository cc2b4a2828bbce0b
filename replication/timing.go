package replication

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// SlotTiming is what PostgreSQL can tell about a slot in seconds rather than
// bytes. A figure it cannot give is not known rather than zero: zero would
// read as "caught up".
type SlotTiming struct {
	// FlushLagSeconds is pg_stat_replication.flush_lag of the walsender that
	// streams the slot: the time between PostgreSQL writing WAL and the
	// receiver confirming it. Not known without a walsender, once it was
	// caught up and idle long enough that PostgreSQL cleared the figure, or
	// when the role may not read it (pg_read_all_stats).
	FlushLagSeconds float64
	FlushLagKnown   bool
	// InactiveSeconds is how long the slot has had no walsender, from
	// pg_replication_slots.inactive_since: known only on PostgreSQL 17+ and
	// while the slot is inactive.
	InactiveSeconds float64
	InactiveKnown   bool
}

// ReadSlotTiming reads a slot's SlotTiming from the catalog, so an instance
// that is not streaming the slot can still report it. found is false when
// the slot does not exist.
func ReadSlotTiming(ctx context.Context, q Querier, name string) (t SlotTiming, found bool, err error) {
	var flushLag, inactive *float64
	// inactive_since is read through to_jsonb so that servers before 17,
	// which lack the column, answer "not known" instead of failing.
	err = q.QueryRow(ctx, `SELECT extract(epoch FROM r.flush_lag)::float8,
			extract(epoch FROM clock_timestamp() - (to_jsonb(s) ->> 'inactive_since')::timestamptz)::float8
		FROM pg_catalog.pg_replication_slots s
		LEFT JOIN pg_catalog.pg_stat_replication r ON r.pid = s.active_pid
		WHERE s.slot_name = $1`, name).Scan(&flushLag, &inactive)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotTiming{}, false, nil
	}
	if err != nil {
		return SlotTiming{}, false, fmt.Errorf("read flush_lag and inactive_since of slot %s: %w", name, err)
	}
	if flushLag != nil {
		t.FlushLagSeconds, t.FlushLagKnown = *flushLag, true
	}
	if inactive != nil {
		t.InactiveSeconds, t.InactiveKnown = *inactive, true
	}
	return t, true, nil
}
