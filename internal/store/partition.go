package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A table partitioned by created_at (migrate --partition-interval, DESIGN.md
// Partitioned table). Migration 0014 records the interval in
// <table>_partitioning and creates <table>_add_partitions(), which keeps
// the partitions from the current interval to `ahead` intervals past it
// created, and a DEFAULT partition as the safety net; the relay calls it
// every minute (PartitionKeeper) and migrate once. prune drops whole
// partitions (prunePartitions); package outbox finds repeats across the
// partitions with <table>_work_id_free() (enqueue.go).

// PartitionsMade is what one call of <table>_add_partitions() did.
type PartitionsMade struct {
	Created []string
	// DefaultRows is how many rows the DEFAULT partition holds (counted up
	// to 1,000,000): rows that found no partition of their own. Prune never
	// drops it; docs/operations.md says what to do.
	DefaultRows int64
}

// Describe is a clause for a status line.
func (m PartitionsMade) Describe() string {
	var b strings.Builder
	if len(m.Created) > 0 {
		fmt.Fprintf(&b, "; created %s", strings.Join(m.Created, ", "))
	}
	if m.DefaultRows > 0 {
		fmt.Fprintf(&b, "; the DEFAULT partition holds %d rows that found no partition of their own (docs/operations.md, \"Partition sizing\")", m.DefaultRows)
	}
	return b.String()
}

// Beginner is a connection or pool that can begin a transaction.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// AddPartitions creates the partitions of partitioned table t that are due,
// waiting at most lockTimeout for the table's lock (CREATE TABLE ...
// PARTITION OF takes ACCESS EXCLUSIVE on it for the catalog change, and
// every INSERT queues behind the waiting request).
func AddPartitions(ctx context.Context, db Beginner, t Table, lockTimeout time.Duration) (PartitionsMade, error) {
	var m PartitionsMade
	err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, fmt.Sprintf("%dms", max(lockTimeout.Milliseconds(), 1))); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT created, default_rows FROM `+t.derived("add_partitions", true)+`()`).Scan(&m.Created, &m.DefaultRows)
	})
	if err != nil {
		return m, fmt.Errorf("create the partitions of %s ahead of time: %w", t.Qualified(), err)
	}
	return m, nil
}

// Layout reads how the store's table is laid out.
func (s *Store) Layout(ctx context.Context) (Layout, error) {
	l, err := ReadLayout(ctx, s.pool, s.table)
	return l.Layout, err
}

// PartitionKeeperInterval is how often the relay creates due partitions.
const PartitionKeeperInterval = time.Minute

// PartitionKeeper creates the partitions of a partitioned table ahead of
// time, every interval until ctx ends, and reports each call: made is what
// it created and what the DEFAULT partition holds, err a failure (a lock
// wait that gave up, a role without EXECUTE on <table>_add_partitions).
// A failure is retried at the next tick: `ahead` intervals are created, so
// many ticks may fail before producers need the next partition.
func (s *Store) PartitionKeeper(ctx context.Context, interval time.Duration, report func(made PartitionsMade, err error)) {
	for {
		made, err := AddPartitions(ctx, s.pool, s.table, time.Second)
		if ctx.Err() != nil {
			return
		}
		report(made, err)
		select {
		case <-ctx.Done():
			return
		case <-time.After(interval):
		}
	}
}

// Partition is one partition of the table.
type Partition struct {
	Name string
	// Start and End bound its created_at; both zero for the DEFAULT
	// partition.
	Start, End time.Time
	Default    bool
	// DetachPending: a DETACH ... CONCURRENTLY was interrupted.
	DetachPending bool
}

// Partitions lists the table's partitions in created_at order, the DEFAULT
// partition last.
func (s *Store) Partitions(ctx context.Context) ([]Partition, error) {
	// The bounds are read back from the catalog's text of them, FOR VALUES
	// FROM ('...') TO ('...') in the session's time zone, which PostgreSQL
	// reads as it wrote it.
	rows, err := s.pool.Query(ctx, `SELECT c.relname::text, i.inhdetachpending, b.expr = 'DEFAULT',
			coalesce(m[1]::timestamptz, '-infinity'), coalesce(m[2]::timestamptz, '-infinity')
		FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid,
			LATERAL (SELECT pg_catalog.pg_get_expr(c.relpartbound, c.oid) AS expr) b,
			LATERAL regexp_match(b.expr, $$FROM \('([^']+)'\) TO \('([^']+)'\)$$) AS m
		WHERE i.inhparent = $1::regclass
		ORDER BY b.expr = 'DEFAULT', 4`, s.table.String())
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", s.table.Qualified(), err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Partition, error) {
		var p Partition
		var start, end pgtype.Timestamptz
		err := r.Scan(&p.Name, &p.DetachPending, &p.Default, &start, &end)
		p.Start, p.End = start.Time, end.Time
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// owedSQL is true for a row of alias the relay still owes the broker: with
// the poller, or 'ready' and not covered by the watermark (with
// --on-publish none a published row stays 'ready', and the watermark says
// it was published: G17).
func (s *Store) owedSQL(alias string) string {
	return `(` + alias + `.state IN ('scheduled', 'running') OR (` + alias + `.state = 'ready' AND NOT ` + s.coveredSQL(alias) + `))`
}

// PartitionVerdict is what prune found in one partition that ends before
// the cutoff, and what it did.
type PartitionVerdict struct {
	Partition
	Rows int64
	// Kept says why the partition was kept, "" when it was dropped (or,
	// in a dry run, would be).
	Kept string
}

// partitionCounts are the rows of one partition that keep it.
type partitionCounts struct {
	rows, ready, scheduled, running, failed, cancelled, expired, recent int64
}

// why says why a partition with these rows must stay, "" when nothing
// keeps it. The promises are those of prune on a plain table: rows the
// relay still owes, dead letters (failed) and rows published within
// --older-than are never removed; cancelled and expired rows only with
// --include-cancelled, once cancelled (or expired) longer ago than it.
func (c partitionCounts) why() string {
	var parts []string
	if owed := c.ready + c.scheduled + c.running; owed > 0 {
		var what []string
		for _, x := range []struct {
			n    int64
			what string
		}{{c.scheduled, "scheduled"}, {c.running, "running"}, {c.ready, "ready not yet published"}} {
			if x.n > 0 {
				what = append(what, fmt.Sprintf("%d %s", x.n, x.what))
			}
		}
		parts = append(parts, fmt.Sprintf("%d rows still owed (%s)", owed, strings.Join(what, ", ")))
	}
	if c.failed > 0 {
		parts = append(parts, fmt.Sprintf("%d failed rows (dead letters: redrive or cancel them)", c.failed))
	}
	if c.cancelled+c.expired > 0 {
		parts = append(parts, fmt.Sprintf("%d cancelled and %d expired rows (dropped with --include-cancelled once cancelled or expired longer ago than --older-than)", c.cancelled, c.expired))
	}
	if c.recent > 0 {
		parts = append(parts, fmt.Sprintf("%d rows published within --older-than", c.recent))
	}
	return strings.Join(parts, "; ")
}

// countPartition reads, in one scan of the partition alone, the rows that
// keep it ($1 the cutoff, $2 whether cancelled and expired rows go).
func (s *Store) countPartition(ctx context.Context, q DBTX, part string, cutoff time.Time, includeCancelled bool) (partitionCounts, error) {
	var c partitionCounts
	ident := pgx.Identifier{s.table.Schema, part}.Sanitize()
	err := q.QueryRow(ctx, `SELECT count(*),
			count(*) FILTER (WHERE `+s.owedSQL("p")+` AND p.state = 'ready'),
			count(*) FILTER (WHERE `+s.owedSQL("p")+` AND p.state = 'scheduled'),
			count(*) FILTER (WHERE `+s.owedSQL("p")+` AND p.state = 'running'),
			count(*) FILTER (WHERE p.state = 'failed'),
			count(*) FILTER (WHERE p.state = 'cancelled' AND NOT ($2 AND coalesce(p.redriven_at, p.created_at) < $1)),
			count(*) FILTER (WHERE p.state = 'expired' AND NOT ($2 AND p.expires_at < $1)),
			count(*) FILTER (WHERE p.state = 'published' AND NOT coalesce(p.published_at < $1, false))
		FROM ONLY `+ident+` AS p`, cutoff, includeCancelled).
		Scan(&c.rows, &c.ready, &c.scheduled, &c.running, &c.failed, &c.cancelled, &c.expired, &c.recent)
	if err != nil {
		return c, fmt.Errorf("count the rows of partition %s: %w", part, err)
	}
	return c, nil
}

// prunePartitions drops the partitions that end before the cutoff and hold
// nothing prune must keep (partitionCounts.why). It never deletes a row:
// a partition goes whole or stays whole.
//
// Each partition is read, detached, read again and dropped. The first
// read is made without a lock that would stop the relay; the second reads
// the partition once nothing can reach it through the table any more (every
// statement of the relay, the operator's commands and producers goes
// through the table), so a row that changed in between (a redrive of a
// published row, a late settle) is seen, and the partition is attached
// again instead of dropped. With a DEFAULT partition (0014 always makes
// one) PostgreSQL cannot detach CONCURRENTLY; the plain DETACH takes ACCESS
// EXCLUSIVE on the table for a catalog change, its wait bounded by
// lockTimeout: a prune that gives up says so and the next one tries again.
func (s *Store) prunePartitions(ctx context.Context, r PruneRequest, res PruneResult, lockTimeout time.Duration) (PruneResult, error) {
	parts, err := s.Partitions(ctx)
	if err != nil {
		return res, err
	}
	hasDefault := false
	for _, p := range parts {
		hasDefault = hasDefault || p.Default
	}
	for _, p := range parts {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("prune %s: stopped: %w", s.table.Qualified(), err)
		}
		if p.Default {
			var n int64
			if err := s.pool.QueryRow(ctx, `SELECT count(*) FROM ONLY `+pgx.Identifier{s.table.Schema, p.Name}.Sanitize()).Scan(&n); err != nil {
				return res, fmt.Errorf("prune %s: count the rows of the DEFAULT partition %s: %w", s.table.Qualified(), p.Name, err)
			}
			if n > 0 {
				res.Partitions = append(res.Partitions, PartitionVerdict{Partition: p, Rows: n, Kept: "the DEFAULT partition is never dropped"})
			}
			continue
		}
		if p.End.After(res.Cutoff) {
			continue
		}
		v := PartitionVerdict{Partition: p}
		c, err := s.countPartition(ctx, s.pool, p.Name, res.Cutoff, r.IncludeCancelled)
		if err != nil {
			return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
		}
		v.Rows, v.Kept = c.rows, c.why()
		if v.Kept != "" || r.DryRun {
			res.Partitions = append(res.Partitions, v)
			continue
		}
		if v, err = s.dropPartition(ctx, v, res.Cutoff, r.IncludeCancelled, hasDefault, lockTimeout); err != nil {
			return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
		}
		res.Partitions = append(res.Partitions, v)
	}
	return res, nil
}

// dropPartition detaches v, checks it again, and drops it or attaches it
// back (prunePartitions).
func (s *Store) dropPartition(ctx context.Context, v PartitionVerdict, cutoff time.Time, includeCancelled, hasDefault bool, lockTimeout time.Duration) (PartitionVerdict, error) {
	ident := pgx.Identifier{s.table.Schema, v.Name}.Sanitize()
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return v, fmt.Errorf("detach partition %s: %w", v.Name, err)
	}
	defer conn.Release()
	timeout := fmt.Sprintf("%dms", max(lockTimeout.Milliseconds(), 1))
	if v.DetachPending {
		// An interrupted DETACH ... CONCURRENTLY: only FINALIZE completes it.
		if _, err := conn.Exec(ctx, `ALTER TABLE `+s.table.String()+` DETACH PARTITION `+ident+` FINALIZE`); err != nil {
			return v, fmt.Errorf("finish the interrupted detach of partition %s: %w", v.Name, err)
		}
	} else if !hasDefault {
		// Waits for the transactions that might see the partition, holding
		// only SHARE UPDATE EXCLUSIVE: producers and the relay go on. Not
		// in a transaction block (PostgreSQL's rule).
		if _, err := conn.Exec(ctx, `ALTER TABLE `+s.table.String()+` DETACH PARTITION `+ident+` CONCURRENTLY`); err != nil {
			return v, fmt.Errorf("detach partition %s concurrently: %w", v.Name, err)
		}
	} else if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, timeout); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `ALTER TABLE `+s.table.String()+` DETACH PARTITION `+ident)
		return err
	}); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "55P03" {
			v.Kept = fmt.Sprintf("gave up waiting %s (--lock-timeout) for the table's lock to detach it; the next prune tries again", lockTimeout)
			return v, nil
		}
		return v, fmt.Errorf("detach partition %s: %w", v.Name, err)
	}
	if s.afterDetach != nil {
		s.afterDetach(v.Name)
	}
	c, err := s.countPartition(ctx, conn, v.Name, cutoff, includeCancelled)
	if err != nil {
		return v, err
	}
	if why := c.why(); why != "" {
		// Partition bounds take no parameters: literals.
		_, err := conn.Exec(ctx, `ALTER TABLE `+s.table.String()+` ATTACH PARTITION `+ident+
			` FOR VALUES FROM (`+literal(v.Start.UTC().Format(time.RFC3339Nano))+`) TO (`+literal(v.End.UTC().Format(time.RFC3339Nano))+`)`)
		if err != nil {
			return v, fmt.Errorf("attach partition %s back (it changed while being detached: %s): %w; its rows are not lost: attach it by hand", v.Name, why, err)
		}
		v.Rows, v.Kept = c.rows, why+" (changed while it was being detached; attached back)"
		return v, nil
	}
	if _, err := conn.Exec(ctx, `DROP TABLE `+ident); err != nil {
		return v, fmt.Errorf("drop the detached partition %s: %w", v.Name, err)
	}
	v.Rows = c.rows
	return v, nil
}

// The layout of the tables package outbox writes to, by database and table:
// the statements differ (enqueue.go). A table is laid out for good (the
// conversion procedure makes a new table), so the answer is kept; a
// statement that fails forgets it, so that a table dropped and made again
// with another layout under the same name costs one failed statement.
var layouts sync.Map // layoutKey -> bool (partitioned)

type layoutKey struct{ db, table string }

// dbKey names the database db talks to, "" when it cannot tell.
func dbKey(db DBTX) string {
	var cfg *pgx.ConnConfig
	switch c := db.(type) {
	case interface{ Conn() *pgx.Conn }:
		if cn := c.Conn(); cn != nil {
			cfg = cn.Config()
		}
	case *pgx.Conn:
		cfg = c.Config()
	case *pgxpool.Pool:
		cfg = c.Config().ConnConfig
	}
	if cfg == nil {
		return ""
	}
	return fmt.Sprintf("%s:%d/%s", cfg.Host, cfg.Port, cfg.Database)
}

// isPartitioned says whether t is partitioned, asking the database once.
func isPartitioned(ctx context.Context, db DBTX, t Table) (bool, layoutKey, error) {
	k := layoutKey{dbKey(db), t.Qualified()}
	if k.db != "" {
		if v, ok := layouts.Load(k); ok {
			return v.(bool), k, nil
		}
	}
	var p bool
	if err := db.QueryRow(ctx, `SELECT coalesce((SELECT relkind = 'p' FROM pg_catalog.pg_class WHERE oid = to_regclass($1)), false)`, t.String()).Scan(&p); err != nil {
		return false, k, fmt.Errorf("read the layout of %s: %w", t.Qualified(), err)
	}
	if k.db != "" {
		layouts.Store(k, p)
	}
	return p, k, nil
}

func forgetLayout(k layoutKey) { layouts.Delete(k) }

// ReadEnqueueLayout reads, and keeps, whether t is partitioned, as the
// first enqueue into it would.
func ReadEnqueueLayout(ctx context.Context, db DBTX, t Table) error {
	_, _, err := isPartitioned(ctx, db, t)
	return err
}

// PartitionSummary is what `status` says of a partitioned table.
type PartitionSummary struct {
	IntervalSeconds float64 `json:"interval_seconds"`
	// Partitions counts the ranged partitions; LastEnd is where the last
	// one ends: producers' rows past it go to the DEFAULT partition.
	Partitions int       `json:"partitions"`
	LastEnd    time.Time `json:"last_end"`
	// DefaultRows estimates the rows of the DEFAULT partition
	// (pg_stat_user_tables.n_live_tup: reading the partition would need a
	// grant on it, and counting through the table reads every partition).
	DefaultRows int64 `json:"default_rows_estimate"`
}

// PartitionSummary describes a partitioned table; nil for a plain one.
func (s *Store) PartitionSummary(ctx context.Context) (*PartitionSummary, error) {
	l, err := s.Layout(ctx)
	if err != nil || !l.Partitioned() {
		return nil, err
	}
	parts, err := s.Partitions(ctx)
	if err != nil {
		return nil, err
	}
	sum := &PartitionSummary{IntervalSeconds: l.PartitionInterval.Seconds()}
	for _, p := range parts {
		if p.Default {
			if err := s.pool.QueryRow(ctx, `SELECT coalesce((SELECT n_live_tup FROM pg_catalog.pg_stat_user_tables WHERE relid = to_regclass($1)), 0)`,
				pgx.Identifier{s.table.Schema, p.Name}.Sanitize()).Scan(&sum.DefaultRows); err != nil {
				return nil, fmt.Errorf("read the statistics of the DEFAULT partition of %s: %w", s.table.Qualified(), err)
			}
			continue
		}
		sum.Partitions++
		if p.End.After(sum.LastEnd) {
			sum.LastEnd = p.End
		}
	}
	return sum, nil
}
