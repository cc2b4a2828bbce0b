package store

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/outbox-relay/outbox-relay/internal/schema"
)

// A table partitioned by created_at (migrate --partition-interval, DESIGN.md
// Partitioned table). Migration 0014 records the interval in
// <table>_partitioning and creates <table>_add_partitions(), which keeps
// the partitions from the current interval to `ahead` intervals past it
// created, and a DEFAULT partition as the safety net; the relay calls it
// every minute (PartitionKeeper) and migrate once. prune drops whole
// partitions (prunePartitions); package outbox finds repeats across the
// partitions with <table>_work_id_free() (internal/enqueue).

// PartitionsMade is what one call of <table>_add_partitions() did.
type PartitionsMade struct {
	Created []string
	// DefaultRows is how many rows the DEFAULT partition holds (counted up
	// to 1,000,000): rows that found no partition of their own. Prune never
	// drops it; docs/partitions.md says what to do.
	DefaultRows int64
}

// Describe is a clause for a status line.
func (m PartitionsMade) Describe() string {
	var b strings.Builder
	if len(m.Created) > 0 {
		fmt.Fprintf(&b, "; created %s", strings.Join(m.Created, ", "))
	}
	if m.DefaultRows > 0 {
		fmt.Fprintf(&b, "; the DEFAULT partition holds %d rows that found no partition of their own (docs/partitions.md, \"Partition sizing\")", m.DefaultRows)
	}
	return b.String()
}

// Beginner is a connection or pool that can begin a transaction.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// AddPartitions creates the partitions of partitioned table t that are due,
// and attaches back those left detached, waiting at most lockTimeout for
// each lock (<table>_add_partitions(), migrations 0017 and 0018: a partition is made
// on its own and attached, which producers' INSERTs do not wait for; the
// DEFAULT partition's lock, which reads through the table need, is taken
// for a catalog change only). While the DEFAULT partition holds rows the
// function works in steps, one per transaction, and leaves a guard on the
// DEFAULT partition between them: it is called again while one is there,
// a few times at most (the next round goes on).
func AddPartitions(ctx context.Context, db Beginner, t Table, lockTimeout time.Duration) (PartitionsMade, error) {
	var m PartitionsMade
	// A call attaches one partition at most while a guard is in place
	// (0017): a round after a long stop or a raised ahead takes a call
	// per partition; the bound stops a loop that makes no progress.
	for call := range 4 + maxAhead {
		var made []string
		var guarded bool
		err := pgx.BeginFunc(ctx, db, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, lockTimeoutSetting(lockTimeout)); err != nil {
				return err
			}
			// The first call of a round drops a guard an unfinished
			// round left (0017): none of this round's is there yet.
			if _, err := tx.Exec(ctx, `SELECT set_config('outbox_relay.fresh_round', $1, true)`, map[bool]string{true: "on", false: "off"}[call == 0]); err != nil {
				return err
			}
			if err := tx.QueryRow(ctx, `SELECT created, default_rows FROM `+t.Derived("add_partitions", true)+`()`).Scan(&made, &m.DefaultRows); err != nil {
				return err
			}
			return tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_constraint
				WHERE conrelid = to_regclass($1) AND conname = $2)`,
				pgx.Identifier{t.Schema, defaultName(t)}.Sanitize(), guardName(t)).Scan(&guarded)
		})
		if err != nil {
			return m, fmt.Errorf("create the partitions of %s ahead of time: %w", t.Qualified(), err)
		}
		m.Created = append(m.Created, made...)
		if !guarded {
			break
		}
	}
	return m, nil
}

// maxAhead bounds how many partitions a round expects to make.
const maxAhead = 400

// defaultName is the name of the DEFAULT partition (0014).
func defaultName(t Table) string {
	n := t.Name + "_default"
	if len(n) > 63 {
		n = n[:63]
	}
	return n
}

// guardName is the name of the DEFAULT partition's guard (0017).
func guardName(t Table) string {
	n := t.Name
	if len(n) > 50 {
		n = n[:50]
	}
	return n + "_default_guard"
}

// Layout reads how the store's table is laid out.
func (s *Store) Layout(ctx context.Context) (schema.Layout, error) {
	l, err := schema.ReadLayout(ctx, s.pool, s.table)
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
	// DetachPending: a DETACH ... CONCURRENTLY was interrupted (by hand, or
	// by a prune of an earlier version): queries no longer see it.
	DetachPending bool
	// Detached: a table named as the table's partitions are that is not
	// attached, with rows outside the table: left by an interrupted prune of
	// an earlier version, or detached by hand. Its bounds are read from its
	// name. Prune attaches it back or drops it; the partition keeper
	// attaches it back (0017).
	Detached bool
}

// detachedSQL is true when the table $2 (regclass text) has a partition
// out of it: a DETACH ... CONCURRENTLY pending, or a table of its schema
// named as its partitions are ($3: <name>_p, then 8, 10 or 12 digits) that
// is not attached. Catalog reads only.
const detachedSQL = `(EXISTS (SELECT 1 FROM pg_catalog.pg_inherits i WHERE i.inhparent = $2::regclass AND i.inhdetachpending)
	OR EXISTS (SELECT 1 FROM pg_catalog.pg_class c
		WHERE c.relnamespace = (SELECT p.relnamespace FROM pg_catalog.pg_class p WHERE p.oid = $2::regclass AND p.relkind = 'p')
		  AND c.relkind = 'r' AND NOT c.relispartition AND starts_with(c.relname::text, $3::text)
		  AND substr(c.relname::text, length($3::text) + 1) ~ '^[0-9]{8}([0-9]{2}([0-9]{2})?)?$'))`

// Partitions lists the table's partitions in created_at order, the DEFAULT
// partition last, then the tables left detached (Partition.Detached).
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
	prefix := s.table.Name + "_p"
	rows, err = s.pool.Query(ctx, `SELECT c.relname::text FROM pg_catalog.pg_class c
		WHERE c.relnamespace = (SELECT p.relnamespace FROM pg_catalog.pg_class p WHERE p.oid = $1::regclass AND p.relkind = 'p')
		  AND c.relkind = 'r' AND NOT c.relispartition AND starts_with(c.relname::text, $2::text)
		  AND substr(c.relname::text, length($2::text) + 1) ~ '^[0-9]{8}([0-9]{2}([0-9]{2})?)?$'
		ORDER BY 1`, s.table.String(), prefix)
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s left detached: %w", s.table.Qualified(), err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list the partitions of %s left detached: %w", s.table.Qualified(), err)
	}
	if len(names) == 0 {
		return out, nil
	}
	l, err := schema.ReadLayout(ctx, s.pool, s.table)
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		digits := strings.TrimPrefix(n, prefix)
		start, err := time.ParseInLocation("200601021504"[:len(digits)], digits, time.UTC)
		if err != nil || !l.Partitioned() {
			continue
		}
		out = append(out, Partition{Name: n, Start: start, End: start.Add(l.PartitionInterval), Detached: true})
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
// Each partition is read, then detached, read again and dropped in ONE
// transaction (dropPartition). The first read is made without a lock that
// would stop anyone, and skips the partitions that are plainly kept. The
// second runs under the detach's ACCESS EXCLUSIVE lock on the table: every
// transaction that wrote to the partition has ended (the detach waited for
// them), and no statement reaches the table until the transaction ends.
// So a row that changed in between (a producer's transaction open across
// the partition's end, a settle of its rows, a redrive) is seen, and the
// transaction is rolled back: the partition was never out of the table
// for anyone. The table never lacks a partition while other statements
// run, and an interrupted prune (a signal, a lost connection) rolls back
// with its transaction.
//
// Partitions left out of the table by an earlier version or by hand (a
// DETACH ... CONCURRENTLY pending, a detached table of a partition's name)
// are finished: finalized, then dropped when nothing keeps them and they
// end before the cutoff, attached back otherwise (restorePartition).
func (s *Store) prunePartitions(ctx context.Context, r PruneRequest, res PruneResult, lockTimeout time.Duration) (PruneResult, error) {
	if !r.DryRun {
		if err := s.dropLeftoverGuard(ctx, lockTimeout); err != nil {
			return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
		}
	}
	parts, err := s.Partitions(ctx)
	if err != nil {
		return res, err
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
		if p.DetachPending || p.Detached {
			v, err := s.restorePartition(ctx, p, res.Cutoff, r, lockTimeout)
			if err != nil {
				return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
			}
			res.Partitions = append(res.Partitions, v)
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
		if s.pruneHook != nil {
			s.pruneHook(PruneCounted, p.Name)
		}
		if v, err = s.dropPartition(ctx, v, res.Cutoff, r.IncludeCancelled, lockTimeout); err != nil {
			return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
		}
		res.Partitions = append(res.Partitions, v)
	}
	return res, nil
}

// dropLeftoverGuard drops the DEFAULT partition's guard (0017) when no
// keeper round is at work (its advisory lock is free): a guard then is one
// an interrupted round left, which would refuse producers' rows in its
// range once it comes due while no relay runs to drop it.
func (s *Store) dropLeftoverGuard(ctx context.Context, lockTimeout time.Duration) error {
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, lockTimeoutSetting(lockTimeout)); err != nil {
			return err
		}
		var free, guarded bool
		if err := tx.QueryRow(ctx, `SELECT pg_try_advisory_xact_lock(hashtextextended('outbox-relay partitions ' || $1, 0)),
			EXISTS (SELECT 1 FROM pg_catalog.pg_constraint WHERE conrelid = to_regclass($2) AND conname = $3)`,
			s.table.Qualified(), pgx.Identifier{s.table.Schema, defaultName(s.table)}.Sanitize(), guardName(s.table)).Scan(&free, &guarded); err != nil {
			return err
		}
		if !free || !guarded {
			return nil
		}
		if _, err := tx.Exec(ctx, `ALTER TABLE `+pgx.Identifier{s.table.Schema, defaultName(s.table)}.Sanitize()+` DROP CONSTRAINT `+pgx.Identifier{guardName(s.table)}.Sanitize()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `UPDATE `+s.table.Derived("partitioning", true)+` SET guard_from = NULL, guard_to = NULL`)
		return err
	})
	if err != nil {
		return fmt.Errorf("drop the guard an interrupted partition keeper round left on %s: %w", defaultName(s.table), err)
	}
	return nil
}

// lockTimeoutSetting is d as a lock_timeout value (at least 1ms: 0 would
// mean no bound).
func lockTimeoutSetting(d time.Duration) string {
	return fmt.Sprintf("%dms", max(d.Milliseconds(), 1))
}

// isLockTimeout reports PostgreSQL's lock_not_available (55P03).
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
}

// dropPartition detaches v, counts it again and drops it, in one
// transaction that it rolls back when the count finds something that keeps
// the partition (prunePartitions). The wait for the table's lock is bounded
// by lockTimeout (the detach's ACCESS EXCLUSIVE request queues every
// statement on the table behind it); once granted, the table is held for
// the count of this one partition and the drop. Any failure, a cancel
// included, rolls the detach back.
func (s *Store) dropPartition(ctx context.Context, v PartitionVerdict, cutoff time.Time, includeCancelled bool, lockTimeout time.Duration) (PartitionVerdict, error) {
	ident := pgx.Identifier{s.table.Schema, v.Name}.Sanitize()
	var kept string
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, lockTimeoutSetting(lockTimeout)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `ALTER TABLE `+s.table.String()+` DETACH PARTITION `+ident); err != nil {
			return err
		}
		if s.pruneHook != nil {
			s.pruneHook(PruneDetached, v.Name)
		}
		c, err := s.countPartition(ctx, tx, v.Name, cutoff, includeCancelled)
		if err != nil {
			return err
		}
		v.Rows = c.rows
		if kept = c.why(); kept != "" {
			return errKeep
		}
		_, err = tx.Exec(ctx, `DROP TABLE `+ident)
		return err
	})
	switch {
	case err == nil:
		return v, nil
	case errors.Is(err, errKeep):
		v.Kept = kept + " (changed since it was first read; the detach was rolled back, it stays attached)"
		return v, nil
	case isLockTimeout(err):
		v.Kept = fmt.Sprintf("gave up waiting %s (--lock-timeout) for the table's lock to detach it; the next prune tries again", lockTimeout)
		return v, nil
	}
	return v, fmt.Errorf("drop partition %s: %w (the detach is rolled back with its transaction: %s stays attached, with its rows; a failure of the commit itself leaves it either attached or dropped, as `outbox-relay status` shows)", v.Name, err, v.Name)
}

// errKeep rolls back a detach whose second count found rows to keep.
var errKeep = errors.New("partition keeps rows")

// restorePartition finishes a partition left out of the table (a DETACH
// ... CONCURRENTLY pending, a table of a partition's name not attached):
// it drops it when it ends before the cutoff and holds nothing prune keeps,
// and attaches it back otherwise, so that its rows are in the table again
// (the relay holds its checkpoint at a row it does not find while such a
// table exists: Store.goneForAReason). A dry run only says what it would do.
func (s *Store) restorePartition(ctx context.Context, p Partition, cutoff time.Time, r PruneRequest, lockTimeout time.Duration) (PartitionVerdict, error) {
	v := PartitionVerdict{Partition: p}
	ident := pgx.Identifier{s.table.Schema, p.Name}.Sanitize()
	if p.DetachPending && !r.DryRun {
		// Only FINALIZE completes an interrupted DETACH ... CONCURRENTLY;
		// it waits for the transactions that may still see the partition,
		// holding SHARE UPDATE EXCLUSIVE, which blocks no producer.
		if _, err := s.pool.Exec(ctx, `ALTER TABLE `+s.table.String()+` DETACH PARTITION `+ident+` FINALIZE`); err != nil {
			return v, fmt.Errorf("finish the interrupted detach of partition %s: %w", p.Name, err)
		}
		v.DetachPending, v.Detached = false, true
	}
	c, err := s.countPartition(ctx, s.pool, p.Name, cutoff, r.IncludeCancelled)
	if err != nil {
		return v, err
	}
	v.Rows = c.rows
	why := c.why()
	if why == "" && !p.End.After(cutoff) {
		if r.DryRun {
			return v, nil
		}
		if _, err := s.pool.Exec(ctx, `DROP TABLE `+ident); err != nil {
			return v, fmt.Errorf("drop partition %s, left detached with nothing to keep: %w", p.Name, err)
		}
		return v, nil
	}
	if why == "" {
		why = "it ends after the cutoff"
	}
	if r.DryRun {
		v.Kept = why + "; it is out of the table (left detached): prune attaches it back"
		return v, nil
	}
	// Partition bounds take no parameters: literals. The wait for the
	// locks (SHARE UPDATE EXCLUSIVE on the table, ACCESS EXCLUSIVE on the
	// DEFAULT partition, which every statement reading the table queues
	// behind) is bounded.
	err = pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true)`, lockTimeoutSetting(lockTimeout)); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `ALTER TABLE `+s.table.String()+` ATTACH PARTITION `+ident+
			` FOR VALUES FROM (`+schema.Literal(p.Start.UTC().Format(time.RFC3339Nano))+`) TO (`+schema.Literal(p.End.UTC().Format(time.RFC3339Nano))+`)`)
		return err
	})
	if isLockTimeout(err) {
		v.Kept = fmt.Sprintf("%s; it is out of the table (left detached) and prune gave up waiting %s (--lock-timeout) for the locks to attach it back: the next prune tries again", why, lockTimeout)
		return v, nil
	}
	if err != nil {
		return v, fmt.Errorf("attach partition %s back (left detached, %s): %w; its rows are not lost: attach it by hand (ALTER TABLE %s ATTACH PARTITION %s FOR VALUES FROM ('%s') TO ('%s'))",
			p.Name, why, err, s.table.String(), ident, p.Start.UTC().Format(time.RFC3339), p.End.UTC().Format(time.RFC3339))
	}
	v.Detached, v.DetachPending = false, false
	v.Kept = why + " (was left detached; attached back)"
	return v, nil
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
	// Detached names the partitions out of the table (Partition.Detached,
	// DetachPending): their rows are not reachable through it, and the
	// relay holds its checkpoint at a row it cannot find until prune
	// attaches them back or drops them.
	Detached []string `json:"detached,omitempty"`
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
		if p.Detached || p.DetachPending {
			sum.Detached = append(sum.Detached, p.Name)
			if p.Detached {
				continue
			}
		}
		sum.Partitions++
		if p.End.After(sum.LastEnd) {
			sum.LastEnd = p.End
		}
	}
	return sum, nil
}
