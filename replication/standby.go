package replication

import (
	"context"
	"fmt"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
)

// StandbyPosition is how far the standby behind one physical slot has
// flushed WAL: the flush_lsn its walsender reports while it is connected,
// else the slot's restart_lsn (which the standby's feedback advances).
type StandbyPosition struct {
	Slot    string
	Exists  bool // a physical slot of this name exists on this server
	Active  bool // its standby is connected
	Flushed pglogrepl.LSN
	// Lag is the server's flushed WAL minus Flushed, in bytes.
	Lag int64
}

// StandbyPositions reads the named physical slots' standbys, in one query.
func StandbyPositions(ctx context.Context, q Querier, slots []string) ([]StandbyPosition, error) {
	rows, err := q.Query(ctx, `SELECT n.name, s.slot_name IS NOT NULL, coalesce(s.active, false),
			coalesce(r.flush_lsn, s.restart_lsn, '0/0')::text,
			coalesce(pg_wal_lsn_diff(pg_current_wal_flush_lsn(), coalesce(r.flush_lsn, s.restart_lsn)), 0)::bigint
		FROM unnest($1::text[]) WITH ORDINALITY AS n(name, i)
		LEFT JOIN pg_catalog.pg_replication_slots s ON s.slot_name = n.name AND s.slot_type = 'physical'
		LEFT JOIN pg_catalog.pg_stat_replication r ON r.pid = s.active_pid
		ORDER BY n.i`, slots)
	if err != nil {
		return nil, fmt.Errorf("read the standbys' positions (--standby-slot %v): %w", slots, err)
	}
	var out []StandbyPosition
	var p StandbyPosition
	var flushed string
	_, err = pgx.ForEachRow(rows, []any{&p.Slot, &p.Exists, &p.Active, &flushed, &p.Lag}, func() error {
		lsn, err := pglogrepl.ParseLSN(flushed)
		if err != nil {
			return fmt.Errorf("standby slot %s: parse %q: %w", p.Slot, flushed, err)
		}
		p.Flushed = lsn
		out = append(out, p)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read the standbys' positions (--standby-slot %v): %w", slots, err)
	}
	return out, nil
}

// FailoverSupport says what the server offers for a slot to survive a
// promotion (PostgreSQL 17+).
type FailoverSupport struct {
	Version int // server_version_num
	// Supported: failover slots exist (17+).
	Supported bool
	// SynchronizedStandbySlots is the server's synchronized_standby_slots:
	// when it lists the standbys and the relay's slot is a failover slot,
	// the server itself withholds WAL from the slot until they flushed it.
	SynchronizedStandbySlots string
}

// ReadFailoverSupport reads the server version and its failover settings.
func ReadFailoverSupport(ctx context.Context, q Querier) (FailoverSupport, error) {
	var f FailoverSupport
	if err := q.QueryRow(ctx, `SELECT current_setting('server_version_num')::int,
			coalesce(current_setting('synchronized_standby_slots', true), '')`).Scan(&f.Version, &f.SynchronizedStandbySlots); err != nil {
		return f, fmt.Errorf("read the server's version and synchronized_standby_slots: %w", err)
	}
	f.Supported = f.Version >= 170000
	return f, nil
}

// SlotFailover reads whether a slot is a failover slot and whether it is a
// synced copy from a former primary (PostgreSQL 17+; false before).
func SlotFailover(ctx context.Context, q Querier, name string) (failover, synced bool, err error) {
	err = q.QueryRow(ctx, `SELECT coalesce((to_jsonb(s) ->> 'failover')::boolean, false), coalesce((to_jsonb(s) ->> 'synced')::boolean, false)
		FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1`, name).Scan(&failover, &synced)
	if err == pgx.ErrNoRows {
		return false, false, nil
	}
	if err != nil {
		return false, false, fmt.Errorf("read failover state of slot %s: %w", name, err)
	}
	return failover, synced, nil
}

// CurrentFlushLSN is the server's flushed WAL position: every transaction
// committed before the call ends at or before it.
func CurrentFlushLSN(ctx context.Context, q Querier) (pglogrepl.LSN, error) {
	var s string
	if err := q.QueryRow(ctx, `SELECT pg_current_wal_flush_lsn()::text`).Scan(&s); err != nil {
		return 0, fmt.Errorf("read pg_current_wal_flush_lsn(): %w", err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse pg_current_wal_flush_lsn() %q: %w", s, err)
	}
	return lsn, nil
}
