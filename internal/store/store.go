// Package store holds every SQL statement the relay and the operator
// commands run on the outbox table's rows and its companions. Each is a
// named method whose guard lives in its WHERE clause; nothing else in the
// relay builds SQL against the table. Identifiers come from Table (quoted),
// values are always parameters. The table's schema (its migrations, layout,
// ownership and grants) is internal/schema's; the producer's statements are
// internal/enqueue's.
package store

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Policy is what happens to a row once the broker acknowledged it.
type Policy string

const (
	// PolicyMark sets state='published', published_at and stream_seq, keeping
	// the row as evidence until `outbox-relay prune`.
	PolicyMark Policy = "mark"
	// PolicyDelete deletes the row: the smallest table, no evidence kept.
	PolicyDelete Policy = "delete"
	// PolicyNone leaves a row the CDC path published as it was inserted
	// (G17): the watermark the relay records says it was published
	// (watermark.go). Rows the CDC path does not publish, and the poller's,
	// are written as with mark.
	PolicyNone Policy = "none"
)

// ParsePolicy reads the --on-publish flag.
func ParsePolicy(s string) (Policy, error) {
	switch p := Policy(s); p {
	case PolicyMark, PolicyDelete, PolicyNone:
		return p, nil
	}
	return "", fmt.Errorf("--on-publish %q: want mark, delete or none", s)
}

// RequiredColumns are the columns the relay reads or writes.
var RequiredColumns = []string{
	"work_id", "kind", "subject", "payload", "headers", "state", "created_at", "available_at",
	"attempts", "claim_generation", "claimed_by", "lease_until", "published_at", "stream_seq",
	"last_error", "redriven_at", "redriven_by", "redrive_reason",
	"aggregate_type", "aggregate_id", "aggregate_seq", "expires_at",
	"stream_name", "parked", "xact_id", "lookup_seq",
}

// Store runs the outbox table's statements on a pool.
type Store struct {
	pool   *pgxpool.Pool
	table  Table
	policy Policy

	settleSQL string
	// cached says the pool's connections may keep named statements: not
	// behind a transaction pooler (app.DB.Pooler), where a statement
	// prepared on one server connection is unknown on the next.
	cached bool

	// pruneHook, in tests, runs at the steps of a partition's prune
	// (SetPruneHook).
	pruneHook func(stage, partition string)
}

// SetPruneHook is for tests: prune calls f(PruneCounted, partition) after
// its first count of a partition it is about to detach, and f(PruneDetached,
// partition) inside the detach's transaction, before the second count.
func (s *Store) SetPruneHook(f func(stage, partition string)) { s.pruneHook = f }

// The stages SetPruneHook reports.
const (
	PruneCounted  = "counted"
	PruneDetached = "detached"
)

// New returns a Store for table t.
func New(pool *pgxpool.Pool, t Table, policy Policy) *Store {
	if policy == "" {
		policy = PolicyMark
	}
	s := &Store{pool: pool, table: t, policy: policy}
	if pool != nil {
		cc := pool.Config().ConnConfig
		s.cached = cc.DefaultQueryExecMode == pgx.QueryExecModeCacheStatement && cc.StatementCacheCapacity > 0
	}
	s.settleSQL = buildSettleSQL(t, policy)
	return s
}

// Policy is the on-publish policy the store applies.
func (s *Store) Policy() Policy { return s.policy }

// Table is the table this store works on.
func (s *Store) Table() Table { return s.table }

// ErrTableMissing says the outbox table does not exist.
var ErrTableMissing = errors.New("outbox table does not exist")

// Check verifies, before the relay starts, that the table exists with every
// column the relay needs and that this role may update and delete its rows,
// so a misconfiguration fails at once with a message that says what to do.
func (s *Store) Check(ctx context.Context) error {
	var exists bool
	err := s.pool.QueryRow(ctx,
		`SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p'))`,
		s.table.Schema, s.table.Name).Scan(&exists)
	if err != nil {
		return fmt.Errorf("check outbox table %s: %w", s.table.Qualified(), err)
	}
	if !exists {
		return fmt.Errorf("%w: %s: run `outbox-relay migrate` with the same --database-url and --table first", ErrTableMissing, s.table.Qualified())
	}
	rows, err := s.pool.Query(ctx,
		`SELECT attname FROM pg_catalog.pg_attribute WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`,
		s.table.String())
	if err != nil {
		return fmt.Errorf("check outbox table %s columns: %w", s.table.Qualified(), err)
	}
	cols, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("check outbox table %s columns: %w", s.table.Qualified(), err)
	}
	have := map[string]bool{}
	for _, c := range cols {
		have[c] = true
	}
	var missing []string
	for _, c := range RequiredColumns {
		if !have[c] {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("outbox table %s lacks column(s) %s: restore them or run `outbox-relay migrate` (a table made by hand needs every column of the design)",
			s.table.Qualified(), strings.Join(missing, ", "))
	}
	var slotsTable bool
	if err := s.pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, s.SlotsTable()).Scan(&slotsTable); err != nil {
		return fmt.Errorf("check slot state table of %s: %w", s.table.Qualified(), err)
	}
	if !slotsTable {
		return fmt.Errorf("%w: %s (the relay's record of its slots, added in migration 0003): run `outbox-relay migrate` with the same --database-url and --table",
			ErrTableMissing, s.SlotsTable())
	}
	var canUpdate, canDelete bool
	var role string
	err = s.pool.QueryRow(ctx,
		`SELECT current_user, has_table_privilege($1::regclass, 'UPDATE'), has_table_privilege($1::regclass, 'DELETE')`,
		s.table.String()).Scan(&role, &canUpdate, &canDelete)
	if err != nil {
		return fmt.Errorf("check privileges on %s: %w", s.table.Qualified(), err)
	}
	if !canUpdate || (s.policy == PolicyDelete && !canDelete) {
		return fmt.Errorf("role %s may not update%s rows of %s: GRANT SELECT, UPDATE, DELETE ON %s TO the relay's role (outbox-relay migrate --print-grants prints every grant)",
			role, map[bool]string{true: " or delete", false: ""}[s.policy == PolicyDelete], s.table.Qualified(), s.table.String())
	}
	return nil
}

// CheckRelayGrants verifies what only the relay needs beyond Check: recording
// its slot and the backfill marker in <table>_slots.
func (s *Store) CheckRelayGrants(ctx context.Context) error {
	var role string
	var ok bool
	err := s.pool.QueryRow(ctx, `SELECT current_user, has_table_privilege($1::regclass, 'SELECT')
		AND has_table_privilege($1::regclass, 'INSERT') AND has_table_privilege($1::regclass, 'UPDATE')`, s.SlotsTable()).Scan(&role, &ok)
	if err != nil {
		return fmt.Errorf("check privileges on %s: %w", s.SlotsTable(), err)
	}
	if !ok {
		return fmt.Errorf("role %s may not record its slot in %s: GRANT SELECT, INSERT, UPDATE ON %s TO %s (outbox-relay migrate --print-grants prints every grant)",
			role, s.SlotsTable(), s.SlotsTable(), role)
	}
	return nil
}

// Outcome is what the CDC path learned about one row it streamed.
type Outcome uint8

const (
	// Published: the broker acked it; apply the on-publish policy.
	Published Outcome = iota + 1
	// Delayed: its available_at is later than its transaction's commit
	// time; the poller publishes it when due.
	Delayed
	// Rejected: the broker refused it for good; the poller retries it later
	// and dead-letters it after max attempts.
	Rejected
	// Held: an earlier row of its aggregate is with the poller (G12); it
	// waits, scheduled, behind that row. Error names the row. Not a failure:
	// attempts stay 0.
	Held
)

// Settle is one row the CDC path wants to move out of 'ready'.
type Settle struct {
	WorkID string
	Xid    uint32 // the inserting transaction, to tell "not visible yet" from "already moved on"
	// XactID is the row's xact_id column (0: NULL, a row from before
	// migration 0013). With --on-publish none a published row that has one
	// is left alone: the watermark covers it.
	XactID  uint64
	Outcome Outcome
	Seq     uint64 // Published: the stream sequence
	Stream  string // Published: the stream that stored it
	// Error is stored in last_error. Rejected: the broker's reason.
	// Published: a DuplicateNote, or empty, which clears a last_error left
	// from before (a hold): a published row's last_error is about its
	// publication, never stale.
	Error   string
	RetryMs int64 // Rejected: delay before the poller's next attempt
}

// SettleRows applies each outcome with a guard on state = 'ready', in one
// statement. settled[i] is true when items[i] is done with: its row changed
// now, or its transaction is visible and the row is already in another state
// or gone (a replay after a crash, an operator, the poller). false means the
// inserting transaction is not visible yet: try again later, and do not let
// the checkpoint pass it.
func (s *Store) SettleRows(ctx context.Context, items []Settle) (settled []bool, err error) {
	if s.policy == PolicyNone {
		return s.settleUnwritten(ctx, items)
	}
	var pubIDs, pubStreams, pubNotes, delayIDs, rejIDs, rejErrs, heldIDs, heldErrs []string
	var pubSeqs, rejDelay []int64
	for _, it := range items {
		switch it.Outcome {
		case Published:
			pubIDs = append(pubIDs, it.WorkID)
			pubSeqs = append(pubSeqs, int64(it.Seq))
			pubStreams = append(pubStreams, it.Stream)
			pubNotes = append(pubNotes, it.Error)
		case Delayed:
			delayIDs = append(delayIDs, it.WorkID)
		case Rejected:
			rejIDs = append(rejIDs, it.WorkID)
			rejErrs = append(rejErrs, it.Error)
			rejDelay = append(rejDelay, it.RetryMs)
		case Held:
			heldIDs = append(heldIDs, it.WorkID)
			heldErrs = append(heldErrs, it.Error)
		default:
			return nil, fmt.Errorf("settle %s: unknown outcome %d", it.WorkID, it.Outcome)
		}
	}
	var changed []string
	var snapText string
	mode := s.batchMode(len(items))
	args := []any{mode, pubIDs, pubSeqs, pubStreams, pubNotes, delayIDs, rejIDs, rejErrs, rejDelay, heldIDs, heldErrs}
	if s.policy == PolicyDelete {
		args = []any{mode, pubIDs, delayIDs, rejIDs, rejErrs, rejDelay, heldIDs, heldErrs}
	}
	if err := s.pool.QueryRow(ctx, s.settleSQL, args...).Scan(&changed, &snapText); err != nil {
		return nil, fmt.Errorf("settle %d rows in %s: %w", len(items), s.table.Qualified(), err)
	}
	snap, err := ParseSnapshot(snapText)
	if err != nil {
		return nil, err
	}
	done := make(map[string]struct{}, len(changed))
	for _, id := range changed {
		done[id] = struct{}{}
	}
	settled = make([]bool, len(items))
	var unchanged []string
	for i, it := range items {
		if _, ok := done[it.WorkID]; ok {
			settled[i] = true
		} else if snap.Visible(it.Xid) {
			unchanged = append(unchanged, it.WorkID)
		}
	}
	if len(unchanged) == 0 {
		return settled, nil
	}
	gone, err := s.goneForAReason(ctx, unchanged)
	if err != nil {
		return nil, err
	}
	for i, it := range items {
		if !settled[i] {
			_, settled[i] = gone[it.WorkID]
		}
	}
	return settled, nil
}

// goneForAReason says which of ids, rows a settle changed nothing of while
// their transactions are visible, are done with: a row in another state
// than 'ready' (a replay after a crash, the poller, an operator moved it
// on), and a row that is not in the table while no partition of it is
// detached: the relay deleted it (--on-publish delete), prune deleted it
// once published, or its partition was dropped, which prune does only in
// the transaction that detached it and found nothing owed in it
// (dropPartition). A row not found while a partition is detached (left by
// an interrupted prune of an earlier version, a DETACH ... CONCURRENTLY
// pending, one detached by hand) may be in that partition: it is not
// settled, and the checkpoint waits until prune or the partition keeper
// attaches the partition back. A row found 'ready' has not moved on: the
// next settle changes it.
func (s *Store) goneForAReason(ctx context.Context, ids []string) (map[string]struct{}, error) {
	var moved, present []string
	var detached bool
	err := s.pool.QueryRow(ctx, `WITH f AS (SELECT o.work_id, o.state FROM `+s.table.String()+` AS o WHERE o.work_id = ANY($1::text[]))
		SELECT ARRAY(SELECT work_id FROM f WHERE state <> 'ready'), ARRAY(SELECT work_id FROM f), `+detachedSQL+``,
		ids, s.table.String(), s.table.Name+"_p").Scan(&moved, &present, &detached)
	if err != nil {
		return nil, fmt.Errorf("settle %d rows in %s: look up the rows the settle did not change: %w", len(ids), s.table.Qualified(), err)
	}
	gone := make(map[string]struct{}, len(ids))
	for _, id := range moved {
		gone[id] = struct{}{}
	}
	if detached {
		return gone, nil
	}
	in := make(map[string]struct{}, len(present))
	for _, id := range present {
		in[id] = struct{}{}
	}
	for _, id := range ids {
		if _, ok := in[id]; !ok {
			gone[id] = struct{}{}
		}
	}
	return gone, nil
}

// settleUnwritten is SettleRows under --on-publish none (G17): a published
// row with an xact_id needs no statement, and is settled now; the others
// (rows the CDC path did not publish, and rows from before migration 0013,
// which the watermark cannot judge) are written as with mark.
func (s *Store) settleUnwritten(ctx context.Context, items []Settle) ([]bool, error) {
	settled := make([]bool, len(items))
	var rest []Settle
	var at []int
	for i, it := range items {
		if it.Outcome == Published && it.XactID != 0 {
			settled[i] = true
			continue
		}
		rest = append(rest, it)
		at = append(at, i)
	}
	if len(rest) == 0 {
		return settled, nil
	}
	s2 := *s
	s2.policy = PolicyMark
	done, err := s2.SettleRows(ctx, rest)
	if err != nil {
		return nil, err
	}
	for j, i := range at {
		settled[i] = done[j]
	}
	return settled, nil
}

// buildSettleSQL writes the settle statement once per table and policy. The
// snapshot is read in the same statement as the updates, so it is the one
// they ran under. Each UPDATE also filters with work_id = ANY so the planner
// uses the primary key whatever it guesses about unnest.
func buildSettleSQL(t Table, policy Policy) string {
	tbl := t.String()
	pub := `UPDATE ` + tbl + ` AS o SET state = 'published', published_at = clock_timestamp(), stream_seq = u.seq,
			stream_name = u.stream, last_error = nullif(u.note, '')
		FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[]) AS u(work_id, seq, stream, note)
		WHERE o.work_id = u.work_id AND o.work_id = ANY($1::text[]) AND o.state = 'ready'
		RETURNING o.work_id`
	n := 4
	if policy == PolicyDelete {
		pub = `DELETE FROM ` + tbl + ` AS o WHERE o.work_id = ANY($1::text[]) AND o.state = 'ready' RETURNING o.work_id`
		n = 1
	}
	p := func(i int) string { return fmt.Sprintf("$%d", n+i) }
	return `WITH pub AS (` + pub + `),
	delayed AS (
		UPDATE ` + tbl + ` AS o SET state = 'scheduled'
		WHERE o.work_id = ANY(` + p(1) + `::text[]) AND o.state = 'ready'
		RETURNING o.work_id),
	rejected AS (
		UPDATE ` + tbl + ` AS o SET state = 'scheduled', attempts = 1, last_error = u.err,
			available_at = clock_timestamp() + u.delay_ms * interval '1 millisecond'
		FROM unnest(` + p(2) + `::text[], ` + p(3) + `::text[], ` + p(4) + `::bigint[]) AS u(work_id, err, delay_ms)
		WHERE o.work_id = u.work_id AND o.work_id = ANY(` + p(2) + `::text[]) AND o.state = 'ready'
		RETURNING o.work_id),
	held AS (
		UPDATE ` + tbl + ` AS o SET state = 'scheduled', last_error = u.err
		FROM unnest(` + p(5) + `::text[], ` + p(6) + `::text[]) AS u(work_id, err)
		WHERE o.work_id = u.work_id AND o.work_id = ANY(` + p(5) + `::text[]) AND o.state = 'ready'
		RETURNING o.work_id)
	SELECT ARRAY(SELECT work_id FROM pub UNION ALL SELECT work_id FROM delayed UNION ALL SELECT work_id FROM rejected
		UNION ALL SELECT work_id FROM held),
		pg_current_snapshot()::text`
}

// DuplicateNote is a published row's last_error when the broker answered
// its publish as a duplicate: the message the row now points at is the one
// the stream already held under its work ID, whose content may be another.
func DuplicateNote(stream string, seq uint64) string {
	return ClassDuplicate.Notef("duplicate of stream sequence %d in stream %s: the broker already held a message with this work ID "+
		"inside its duplicate window and stored nothing new; harmless when it is this row's own earlier publish (a retry or a restart), "+
		"but if the work ID was reused for other content, this row's content was never delivered", seq, stream)
}

// DuplicateLog is the warning both paths log, with the work ID, for a
// duplicate acknowledgement.
const DuplicateLog = "duplicate ack: the stream already held a message with this work ID and kept it; " +
	"if this row's content differs, it was not delivered (a work_id reused within the duplicate window)"

// unplanned runs a statement as an unnamed prepared statement, which
// PostgreSQL plans for the parameters it is given, every time. The batched
// statements (settle, complete, renew) join arrays of thousands of IDs; a
// named statement switches to a generic plan after five runs, guesses 10
// rows for unnest and picks a nested loop whose cost grows with the square
// of the batch (measured: docs/benchmarks.md, "Figures that used to live in
// code comments").
const unplanned = pgx.QueryExecModeExec

// smallBatch is the largest batch a batched statement runs with a cached
// plan. Planning the settle statement (four updates) costs PostgreSQL more
// than running it for a few rows, and at one row per transaction the relay
// settles a few rows every few milliseconds: there the marks competed with
// the producers for the server's CPU. A generic plan's nested loop is
// quadratic in the batch, which is harmless up to this size.
const smallBatch = 64

// batchMode is how a batched statement of n rows runs: with the statement
// and plan cached on the connection for small batches, planned for its
// parameters otherwise.
func (s *Store) batchMode(n int) pgx.QueryExecMode {
	if n <= smallBatch && s.cached {
		return pgx.QueryExecModeCacheStatement
	}
	return unplanned
}

// The SQLSTATEs the store tells apart, written out rather than taken from
// pgerrcode: the public outbox package builds on the store and depends on
// nothing beyond pgx and the standard library.
const (
	sqlstateUndefinedTable        = "42P01"
	sqlstateInsufficientPrivilege = "42501"
)

// IsUndefinedTable reports a 42P01 error.
func IsUndefinedTable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == sqlstateUndefinedTable
}
