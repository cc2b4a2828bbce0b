package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// The poller's statements. A claim moves a due row to 'running' under a
// lease and a new claim generation; every later statement on that claim
// (complete, renew, reschedule, fail) is guarded in its WHERE clause by
//
//	state = 'running' AND claimed_by = <worker> AND claim_generation = <gen>
//	AND lease_until > clock_timestamp()
//
// so a worker whose lease expired, or whose row was reclaimed by another
// worker (generation + 1), matches zero rows and can never overwrite the
// newer claim (G6). Every time decision is made with the database's
// clock_timestamp(): never now() (frozen at transaction start), never the
// worker's clock. Each method is one autocommitted statement.

// Claimed is one row a claim returned, in its new running state.
type Claimed struct {
	WorkID          string
	Kind            string
	Subject         string // empty when the column is NULL
	Payload         []byte // jsonb's or json's text, bytea's bytes
	Binary          bool   // the payload column is bytea
	Headers         []byte // the headers' JSON text, nil when NULL
	Attempts        int    // after this claim's +1
	ClaimGeneration int64  // this claim's generation: the fence of every later statement
	LastError       string
	// Reclaimed says the row was 'running' under an expired lease: an
	// earlier worker's publish may or may not have reached the broker.
	Reclaimed bool
	// The aggregate and sequence (G12; Seq 0: unordered) and the deadline
	// (G13; zero: none).
	AggregateType, AggregateID string
	AggregateSeq               int64
	ExpiresAt                  time.Time
	// CreatedAt is the row's created_at (CloudEvents' time attribute).
	CreatedAt time.Time
	// AvailableAt is when the row became due (the claim leaves it as it
	// was): after a reschedule, its last attempt's time plus the backoff.
	AvailableAt time.Time
	// LookupSeq, when HasLookupSeq, is the row's lookup_seq before this
	// claim: an earlier claim may have published it, and any message of
	// it is stored in the own stream after this sequence (G18).
	LookupSeq    uint64
	HasLookupSeq bool
}

// ClaimOptions are the rules a claim follows beyond due and unlocked.
type ClaimOptions struct {
	// Ordered: claim, per aggregate, only a run of its lowest unpublished
	// sequences (orderedClaimSQL), never while another claim holds rows of
	// it, for the poller to publish in sequence order (G12).
	Ordered bool
	// DeadlineMargin: never claim a row whose deadline is closer than
	// this; it is left to ExpireDue (G13).
	DeadlineMargin time.Duration
	// StreamSeq, when HasStreamSeq, is a sequence of the own stream that
	// every message published from now on is stored after: a row claimed
	// for the first time records it as its lookup_seq, where a lookup of
	// this claim's publish starts (G18).
	StreamSeq    uint64
	HasStreamSeq bool
}

// Completion is one acked publish of a claim.
type Completion struct {
	WorkID     string
	Generation int64
	Seq        uint64
	Stream     string // the stream that stored it
	// Note is the row's last_error once published: a DuplicateNote, or
	// empty, which clears the error of an earlier attempt.
	Note string
}

func micros(d time.Duration) int64 { return d.Microseconds() }

// Claim takes up to batch due rows ('scheduled' with available_at reached,
// or 'running' with an expired lease) for workerID with a lease, in one
// statement: rows other workers hold locked are skipped, not waited for.
// A reclaim after an expired lease counts as an attempt.
func (s *Store) Claim(ctx context.Context, workerID string, lease time.Duration, batch int, o ClaimOptions) ([]Claimed, error) {
	q := s.claimSQL(o.Ordered)
	// Planned for each call (see unplanned): a plan cached while the table
	// was small would keep joining the claims to it by a sequential scan
	// once a backlog arrives.
	var seq *int64
	if o.HasStreamSeq {
		v := int64(o.StreamSeq)
		seq = &v
	}
	rows, err := s.pool.Query(ctx, q, unplanned, batch, workerID, micros(lease), micros(o.DeadlineMargin), seq)
	if err != nil {
		return nil, fmt.Errorf("claim from %s: %w", s.table.Qualified(), err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Claimed, error) {
		var c Claimed
		var aggSeq, lookup *int64
		var expires *time.Time
		// Payload and Headers scan straight into []byte (a copy of the
		// row's text or bytes; nil for NULL headers): no string in between.
		// The payload is the column as it is, whatever its type.
		err := r.Scan(&c.WorkID, &c.Kind, &c.Subject, &c.Payload, &c.Headers, &c.Attempts, &c.ClaimGeneration, &c.LastError, &c.Reclaimed,
			&c.AggregateType, &c.AggregateID, &aggSeq, anyTimePtr{&expires}, anyTime{&c.AvailableAt}, &lookup, anyTime{&c.CreatedAt})
		c.Binary = isBytea(r.FieldDescriptions()[3])
		if lookup != nil && *lookup >= 0 {
			c.LookupSeq, c.HasLookupSeq = uint64(*lookup), true
		}
		if aggSeq != nil {
			c.AggregateSeq = *aggSeq
		}
		if expires != nil {
			c.ExpiresAt = *expires
		}
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("claim from %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// claimGuard is the fence of every statement on a claim: $2 worker, and the
// generation column compared by the caller.
const claimGuard = `t.state = 'running' AND t.claimed_by = $2 AND t.lease_until > clock_timestamp()`

// batchGuard is claimGuard for the statements on many claims at once
// (complete, renew), which join an unnest of the claims to the table. The
// same test, wrapped in coalesce so that the planner cannot estimate its
// selectivity: read as it is, it makes the planner (from statistics taken
// before the rows were claimed, or none yet) expect about one row of the
// table to pass it, and then scan the table once and rescan the unnest for
// every row found, a cost that grows with the table times the batch
// (measured: docs/benchmarks.md, "Figures that used to live in code
// comments"). Opaque,
// the filter leaves the table's side large, and the only plans left look
// each claim up by primary key (or hash a small table).
const batchGuard = `coalesce(` + claimGuard + `, false)`

// Complete applies the on-publish policy to acked claims of workerID in one
// statement, guarded per row by its claim generation and a live lease. It
// returns the work IDs it changed; the others' claims are gone.
func (s *Store) Complete(ctx context.Context, items []Completion, workerID string) (completed []string, err error) {
	if len(items) == 0 {
		return nil, nil
	}
	ids, gens, seqs, streams, notes := completionArrays(items)
	args := []any{unplanned, ids, workerID, gens, seqs, streams, notes}
	if s.policy == PolicyDelete {
		args = args[:4]
	}
	rows, err := s.pool.Query(ctx, completeSQL(s.table, s.policy), args...)
	if err != nil {
		return nil, fmt.Errorf("complete %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	completed, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("complete %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	return completed, nil
}

// completeSQL is Complete's statement: $1 work IDs, $2 worker, $3 claim
// generations, $4 stream sequences, $5 streams and $6 notes (mark policy
// only).
//
// Each claim finds its row through the primary key, the join driven from
// unnest. Two things keep the planner there. There is no
// `t.work_id = ANY($1)` filter beside the join (the settle statement has
// one): with it the planner scanned the key for the whole array and rescanned
// unnest for every row found, quadratic in the batch (measured:
// docs/benchmarks.md, "Figures that used to live in code comments"). And the
// guard is batchGuard, opaque to the planner.
func completeSQL(t Table, policy Policy) string {
	if policy == PolicyDelete {
		return `DELETE FROM ` + t.String() + ` AS t USING unnest($1::text[], $3::bigint[]) AS u(work_id, gen)
			WHERE t.work_id = u.work_id AND t.claim_generation = u.gen AND ` + batchGuard + `
			RETURNING t.work_id`
	}
	return `UPDATE ` + t.String() + ` AS t SET ` + publishedSet + `
		FROM unnest($1::text[], $3::bigint[], $4::bigint[], $5::text[], $6::text[]) AS u(work_id, gen, seq, stream, note)
		WHERE t.work_id = u.work_id AND t.claim_generation = u.gen AND ` + batchGuard + `
		RETURNING t.work_id`
}

// publishedSet is what settling a row as published writes under mark and
// none, from an unnest row u(work_id, gen, seq, stream, note): Complete's
// acked claims and SettleFound's rows found in the stream.
const publishedSet = `state = 'published', published_at = clock_timestamp(), stream_seq = u.seq,
			stream_name = u.stream, last_error = nullif(u.note, ''), claimed_by = NULL, lease_until = NULL`

// completionArrays are the unnest parameters of a settle statement.
func completionArrays(items []Completion) (ids []string, gens, seqs []int64, streams, notes []string) {
	ids = make([]string, len(items))
	gens = make([]int64, len(items))
	seqs = make([]int64, len(items))
	streams = make([]string, len(items))
	notes = make([]string, len(items))
	for i, it := range items {
		ids[i], gens[i], seqs[i], streams[i], notes[i] = it.WorkID, it.Generation, int64(it.Seq), it.Stream, it.Note
	}
	return ids, gens, seqs, streams, notes
}

func (s *Store) guarded(ctx context.Context, op, workID, set string, args ...any) (bool, error) {
	q := `UPDATE ` + s.table.String() + ` AS t SET ` + set + `
		WHERE t.work_id = $1 AND t.claim_generation = $3 AND ` + claimGuard
	tag, err := s.pool.Exec(ctx, q, append([]any{workID}, args...)...)
	if err != nil {
		return false, fmt.Errorf("%s claim of %s in %s: %w", op, workID, s.table.Qualified(), err)
	}
	return tag.RowsAffected() == 1, nil
}

// Renew extends workerID's lease on its claim gen of workID to lease from
// now (database clock). false: the claim is gone.
func (s *Store) Renew(ctx context.Context, workID, workerID string, gen int64, lease time.Duration) (bool, error) {
	return s.guarded(ctx, "renew", workID,
		`lease_until = clock_timestamp() + $4::bigint * interval '1 microsecond'`,
		workerID, gen, micros(lease))
}

// RenewClaims extends workerID's leases on several claims in one statement
// (items' Seq is ignored). It returns the work IDs it renewed; the others'
// claims are gone.
func (s *Store) RenewClaims(ctx context.Context, items []Completion, workerID string, lease time.Duration) ([]string, error) {
	ids := make([]string, len(items))
	gens := make([]int64, len(items))
	for i, it := range items {
		ids[i], gens[i] = it.WorkID, it.Generation
	}
	rows, err := s.pool.Query(ctx, renewSQL(s.table), unplanned, ids, workerID, gens, micros(lease))
	if err != nil {
		return nil, fmt.Errorf("renew %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	renewed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("renew %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	return renewed, nil
}

// renewSQL is RenewClaims' statement, planned like completeSQL: $1 work
// IDs, $2 worker, $3 claim generations, $4 lease in microseconds.
func renewSQL(t Table) string {
	return `UPDATE ` + t.String() + ` AS t
			SET lease_until = clock_timestamp() + $4::bigint * interval '1 microsecond'
		FROM unnest($1::text[], $3::bigint[]) AS u(work_id, gen)
		WHERE t.work_id = u.work_id AND t.claim_generation = u.gen AND ` + batchGuard + `
		RETURNING t.work_id`
}

// Reschedule gives the row back to the poller after delay, recording why.
// false: the claim is gone.
func (s *Store) Reschedule(ctx context.Context, workID, workerID string, gen int64, delay time.Duration, lastError string) (bool, error) {
	return s.guarded(ctx, "reschedule", workID,
		`state = 'scheduled', available_at = clock_timestamp() + $4::bigint * interval '1 microsecond', last_error = $5,
		 claimed_by = NULL, lease_until = NULL`,
		workerID, gen, micros(delay), lastError)
}

// Unclaimed is a claim given back without a publish: a row of an ordered
// run behind one whose publish failed (G12).
type Unclaimed struct {
	WorkID     string
	Generation int64
	// Reclaimed: the claim took the row from an expired lease, and the
	// attempt it counted stands for that earlier worker's publish, which
	// may have reached the broker; it is kept.
	Reclaimed bool
}

// Release gives claims of workerID back to the poller without counting an
// attempt: the rows were never published by these claims. Each row goes
// back to 'scheduled', due as it was, with lastError saying why (empty:
// the row keeps its last_error, such as the uncertain: or lost: note that
// makes the next claim look it up in the stream first). Guarded
// like Complete; it returns the work IDs it changed.
func (s *Store) Release(ctx context.Context, items []Unclaimed, workerID, lastError string) ([]string, error) {
	if len(items) == 0 {
		return nil, nil
	}
	ids := make([]string, len(items))
	gens := make([]int64, len(items))
	undo := make([]int32, len(items))
	for i, it := range items {
		ids[i], gens[i] = it.WorkID, it.Generation
		if !it.Reclaimed {
			undo[i] = 1
		}
	}
	rows, err := s.pool.Query(ctx, releaseSQL(s.table), unplanned, ids, workerID, gens, undo, lastError)
	if err != nil {
		return nil, fmt.Errorf("give back %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	released, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("give back %d claims in %s: %w", len(items), s.table.Qualified(), err)
	}
	return released, nil
}

// releaseSQL is Release's statement, planned like completeSQL: $1 work IDs,
// $2 worker, $3 claim generations, $4 attempts to take back, $5 last_error.
func releaseSQL(t Table) string {
	return `UPDATE ` + t.String() + ` AS t SET state = 'scheduled', attempts = t.attempts - u.undo, last_error = coalesce(nullif($5, ''), t.last_error),
			claimed_by = NULL, lease_until = NULL
		FROM unnest($1::text[], $3::bigint[], $4::int[]) AS u(work_id, gen, undo)
		WHERE t.work_id = u.work_id AND t.claim_generation = u.gen AND ` + batchGuard + `
		RETURNING t.work_id`
}

// Fail dead-letters the row with its evidence. false: the claim is gone.
func (s *Store) Fail(ctx context.Context, workID, workerID string, gen int64, lastError string) (bool, error) {
	return s.guarded(ctx, "fail", workID,
		`state = 'failed', last_error = $4, claimed_by = NULL, lease_until = NULL`,
		workerID, gen, lastError)
}

// claimSQL is the claim statement; $1 batch, $2 worker, $3 lease and $4
// deadline margin in microseconds, $5 the own stream's sequence a first
// claim records as the row's lookup_seq (NULL: not known). The CTE's select walks the partial poll
// index in poll_at order and stops after batch due rows; with ordered, a row
// of an aggregate is claimable only while no lower sequence of it blocks
// (see BlockingStates; the partial aggregate index serves that probe).
//
// The walk ends at the first row not due yet: poll_at is compared, beside
// the test of a due row, with one reading of the clock (an InitPlan), a
// bound the index scan stops at. clock_timestamp() itself, volatile, is
// never an index condition, and the walk read every delayed row of the
// backlog whenever the batch was not filled.
//
// Which rows are due is one opaque expression (coalesce) beside the index's
// own predicate: the planner cannot estimate it, so it never expects fewer
// due rows than the batch. Estimated from statistics that lag behind a
// table whose rows change state by the thousand (or from none, on a fresh
// backlog), the separate conditions looked like a handful of rows, and the
// planner read and sorted the whole table for every claim instead (with
// batchGuard, it cut PostgreSQL's cost per claimed row on a fresh backlog:
// docs/benchmarks.md, "Figures that used to live in code comments").
func (s *Store) claimSQL(ordered bool) string {
	if ordered {
		return s.orderedClaimSQL()
	}
	tbl := s.table.String()
	return `WITH c AS (
		SELECT work_id, state AS prev_state, lookup_seq AS prev_lookup FROM ` + tbl + ` AS q
		WHERE poll_at IS NOT NULL AND poll_at <= (SELECT clock_timestamp()) AND coalesce(` + dueSQL("q") + `, false)
		ORDER BY poll_at
		LIMIT $1
		FOR UPDATE SKIP LOCKED)
	` + s.claimUpdateSQL()
}

// dueSQL is the test of a claimable row a (without the order rule): due,
// not held by a live lease, and not too close to its deadline.
func dueSQL(a string) string {
	return a + `.poll_at <= clock_timestamp()
		  AND (` + a + `.state = 'scheduled' OR (` + a + `.state = 'running' AND ` + a + `.lease_until <= clock_timestamp()))
		  AND (` + a + `.expires_at IS NULL OR ` + a + `.expires_at > clock_timestamp() + $4::bigint * interval '1 microsecond')`
}

// claimUpdateSQL moves the rows of the CTE c (work_id, prev_state,
// prev_lookup) to running under this claim. A row's lookup_seq is set by
// its first claim and kept by every later one (coalesce): a message of
// any earlier claim's publish is stored after it too. The claim returns
// the value from before it, which says whether an earlier claim may have
// published the row.
func (s *Store) claimUpdateSQL() string {
	tbl := s.table.String()
	return `UPDATE ` + tbl + ` AS t SET state = 'running', claimed_by = $2, claim_generation = t.claim_generation + 1,
		lease_until = clock_timestamp() + $3::bigint * interval '1 microsecond', attempts = t.attempts + 1,
		lookup_seq = coalesce(t.lookup_seq, $5::bigint)
	FROM c WHERE t.work_id = c.work_id
	RETURNING t.work_id, t.kind, coalesce(t.subject, ''), t.payload, t.headers::text, t.attempts,
		t.claim_generation, coalesce(t.last_error, ''), c.prev_state = 'running',
		coalesce(t.aggregate_type, ''), coalesce(t.aggregate_id, ''), t.aggregate_seq, t.expires_at, t.available_at, c.prev_lookup,
		t.created_at`
}

// orderedClaimSQL is the claim with the order rule (G12): it takes, per
// aggregate, a run of its lowest blocking rows in sequence order, so a
// released aggregate drains at the batch's rate instead of a row a poll.
//
//   - h, the heads: due rows walked in poll_at order, as the unordered
//     claim does, where no lower sequence of the aggregate blocks. One
//     aggregate has at most one head: any other row of it has the head
//     below it, and a head is locked (SKIP LOCKED) before it is taken, so
//     two claims never take the same aggregate's head. "No lower sequence
//     blocks" is read without the aggregate's published history (G16),
//     in three index probes of the candidate's own aggregate: the row right
//     below it (aggregate_idx, one entry) is not blocking (a 'ready' row
//     the watermark covers was published: --on-publish none, G17), no row below it
//     is with the poller (aggregate_held_idx, the aggregate's held rows
//     only) and none is a dead letter (dead_letter_idx, on the parked column). A 'ready' row
//     further down, under published ones, is not seen: the CDC path
//     publishes an aggregate in order, so only explicit sequences
//     committed out of order leave one there.
//   - r, the runs: for each head of an aggregate, the aggregate's next
//     blocking rows in sequence order, up to the first one that is not
//     claimable (ready, failed, delayed, held by a live lease, near its
//     deadline): every row of a run has only its run and its head below it
//     among the blocking rows.
//   - l locks the runs' rows (SKIP LOCKED, so a claim never waits) and each
//     run is cut at its first row that could not be locked, or that is no
//     longer claimable once locked (a concurrent cancel): a run never
//     skips a row.
//   - at most $1 rows in all: heads first, then the runs' rows by their
//     head's poll_at and sequence.
//
// Two claims can never take rows of one aggregate at once (a pipelined
// batch, another worker, another instance): the rows a claim took are
// 'running' under a live lease, so blocking and not claimable, and every
// later row of the aggregate has them below it. The poller publishes a run
// in sequence order, one row at a time (poller.process).
func (s *Store) orderedClaimSQL() string {
	tbl := s.table.String()
	same := func(a, b string) string {
		return a + `.aggregate_type = ` + b + `.aggregate_type AND ` + a + `.aggregate_id = ` + b + `.aggregate_id`
	}
	return `WITH h AS (
		SELECT work_id, state AS prev_state, lookup_seq AS prev_lookup, poll_at, aggregate_type, aggregate_id, aggregate_seq FROM ` + tbl + ` AS q
		WHERE poll_at IS NOT NULL AND poll_at <= (SELECT clock_timestamp()) AND coalesce(` + dueSQL("q") + `
		  AND (q.aggregate_type IS NULL OR (
			coalesce((SELECT p.state NOT IN ` + blockingStatesSQL + ` OR (p.state = '` + StateReady + `' AND ` + s.coveredSQL("p") + `)
				FROM ` + tbl + ` AS p
				WHERE ` + same("p", "q") + ` AND p.aggregate_seq < q.aggregate_seq
				ORDER BY p.aggregate_seq DESC LIMIT 1), true)
			AND NOT EXISTS (SELECT 1 FROM ` + tbl + ` AS b
				WHERE ` + same("b", "q") + ` AND b.aggregate_seq < q.aggregate_seq
				  AND b.poll_at IS NOT NULL AND b.aggregate_type IS NOT NULL)
			AND NOT EXISTS (SELECT 1 FROM ` + tbl + ` AS d
				WHERE ` + same("d", "q") + ` AND d.aggregate_seq < q.aggregate_seq
				  AND d.parked = '` + StateFailed + `' AND d.state = '` + StateFailed + `'))), false)
		ORDER BY poll_at
		LIMIT $1
		FOR UPDATE SKIP LOCKED),
	r AS (
		SELECT h.work_id AS head, h.poll_at, n.work_id, n.aggregate_seq
		FROM h CROSS JOIN LATERAL (
			SELECT b.work_id, b.aggregate_seq FROM ` + tbl + ` AS b
			WHERE ` + same("b", "h") + ` AND b.aggregate_seq > h.aggregate_seq AND b.state IN ` + blockingStatesSQL + `
			  AND b.aggregate_seq < coalesce((
				SELECT x.aggregate_seq FROM ` + tbl + ` AS x
				WHERE ` + same("x", "h") + ` AND x.aggregate_seq > h.aggregate_seq AND x.state IN ` + blockingStatesSQL + `
				  AND NOT coalesce(x.poll_at IS NOT NULL AND ` + dueSQL("x") + `, false)
				ORDER BY x.aggregate_seq LIMIT 1), 9223372036854775807)
			ORDER BY b.aggregate_seq
			LIMIT $1 - 1) AS n
		WHERE h.aggregate_type IS NOT NULL),
	l AS (
		SELECT t.work_id, t.state AS prev_state, t.lookup_seq AS prev_lookup FROM ` + tbl + ` AS t
		WHERE t.work_id IN (SELECT work_id FROM r) AND coalesce(t.poll_at IS NOT NULL AND ` + dueSQL("t") + `, false)
		FOR UPDATE SKIP LOCKED),
	k AS (
		SELECT r.head, min(r.aggregate_seq) AS cut FROM r
		WHERE r.work_id NOT IN (SELECT work_id FROM l)
		GROUP BY r.head),
	c AS (
		SELECT work_id, prev_state, prev_lookup FROM h
		UNION ALL
		(SELECT r.work_id, l.prev_state, l.prev_lookup FROM r JOIN l ON l.work_id = r.work_id LEFT JOIN k ON k.head = r.head
		WHERE k.cut IS NULL OR r.aggregate_seq < k.cut
		ORDER BY r.poll_at, r.aggregate_seq
		LIMIT greatest($1 - (SELECT count(*) FROM h), 0)))
	` + s.claimUpdateSQL()
}

// isBytea says a payload column read without a cast is bytea (migrate
// --payload-type bytea): its bytes are the payload, not text.
func isBytea(f pgconn.FieldDescription) bool { return f.DataTypeOID == pgtype.ByteaOID }
