package store

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DBTX is what the producer's statements run on: the caller's transaction
// (pgx.Tx), a connection or a pool. They never begin or end a transaction of
// their own, so the row commits or rolls back with the caller's business
// change.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// EnqueueRow is one row a producer inserts. Payload and Headers are JSON
// text, already validated; an empty Subject, nil Headers and a zero
// AvailableAt leave the column to its default (NULL, NULL, the database
// clock).
type EnqueueRow struct {
	WorkID, Kind, Subject string
	Payload               string
	Headers               *string
	AvailableAt           time.Time
	// AggregateType and AggregateID order the row within its aggregate
	// (G12); AggregateSeq is its explicit sequence, 0 to take the next from
	// the aggregate's counter. ExpiresAt is the deadline (G13), zero for none.
	AggregateType, AggregateID string
	AggregateSeq               int64
	ExpiresAt                  time.Time
}

// Ordered reports whether r belongs to an aggregate.
func (r EnqueueRow) Ordered() bool { return r.AggregateType != "" }

func (r EnqueueRow) expiresAt() *time.Time {
	if r.ExpiresAt.IsZero() {
		return nil
	}
	return &r.ExpiresAt
}

func (r EnqueueRow) availableAt() *time.Time {
	if r.AvailableAt.IsZero() {
		return nil
	}
	return &r.AvailableAt
}

// EnqueueOne inserts r unless a row with its work_id exists. It reports
// whether it inserted. ON CONFLICT DO NOTHING, rather than letting the
// primary key fail, keeps the caller's transaction usable: the caller decides
// what a repeat means (CompareEnqueued).
//
// On a partitioned table no index makes work_id unique: the row is inserted
// only where <table>_work_id_free($1) says no row has the work_id, after
// waiting for every other enqueue of it to end (migration 0014 says why
// that is sound). The statement is the same round trip.
func EnqueueOne(ctx context.Context, db DBTX, t Table, r EnqueueRow) (bool, error) {
	part, key, err := isPartitioned(ctx, db, t)
	if err != nil {
		return false, err
	}
	if r.Ordered() {
		ok, err := enqueueOrdered(ctx, db, t, r, part)
		if err != nil {
			forgetLayout(key)
		}
		return ok, err
	}
	q := `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at, expires_at)
		VALUES ($1, $2, NULLIF($3::text, ''), $4::text::jsonb, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $7)
		ON CONFLICT (work_id) DO NOTHING`
	if part {
		q = `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at, expires_at)
		SELECT $1, $2, NULLIF($3::text, ''), $4::text::jsonb, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $7
		WHERE ` + t.derived("work_id_free", true) + `($1)`
	}
	tag, err := db.Exec(ctx, q, r.WorkID, r.Kind, r.Subject, r.Payload, r.Headers, r.availableAt(), r.expiresAt())
	if err != nil {
		forgetLayout(key)
		return false, fmt.Errorf("insert %q into %s: %w", r.WorkID, t.Qualified(), err)
	}
	return tag.RowsAffected() == 1, nil
}

// enqueueOrdered inserts a row of an aggregate, taking its sequence from the
// aggregate's counter (<table>_next_seq) in the caller's transaction unless
// r has one. Enqueues of one aggregate serialize on its counter row until
// the caller commits; other aggregates never wait. A repeat takes no number:
// the counter is only called when no row has the work_id, and when a
// concurrent insert of the same work_id won anyway, the number goes back
// (this transaction holds the counter row's lock, so it is still the last).
// A gap would stall every InSequence consumer of the aggregate.
// <table>_give_back_seq acts only for the transaction that took the number
// and only while no row has it (migration 0009), so a producer cannot lower
// another transaction's counter with it.
func enqueueOrdered(ctx context.Context, db DBTX, t Table, r EnqueueRow, partitioned bool) (bool, error) {
	var seq *int64
	var inserted bool
	// On a partitioned table the look for a repeat is <table>_work_id_free,
	// which waits for the other enqueues of the work_id and looks after
	// they ended; then no insert can conflict, and there is no index to
	// name in ON CONFLICT.
	free, conflict := `NOT EXISTS (SELECT 1 FROM `+t.String()+` WHERE work_id = $1)`, `ON CONFLICT (work_id) DO NOTHING`
	if partitioned {
		free, conflict = t.derived("work_id_free", true)+`($1)`, ``
	}
	err := db.QueryRow(ctx, `WITH s AS (
			SELECT CASE WHEN $9::bigint > 0 THEN $9::bigint ELSE `+t.derived("next_seq", true)+`($7, $8) END AS seq
			WHERE `+free+`),
		ins AS (
			INSERT INTO `+t.String()+` (work_id, kind, subject, payload, headers, available_at, expires_at,
				aggregate_type, aggregate_id, aggregate_seq)
			SELECT $1, $2, NULLIF($3::text, ''), $4::text::jsonb, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $10,
				$7, $8, s.seq FROM s
			`+conflict+`
			RETURNING 1)
		SELECT (SELECT seq FROM s), EXISTS (SELECT 1 FROM ins)`,
		r.WorkID, r.Kind, r.Subject, r.Payload, r.Headers, r.availableAt(), r.AggregateType, r.AggregateID, r.AggregateSeq, r.expiresAt()).
		Scan(&seq, &inserted)
	if err != nil {
		return false, fmt.Errorf("insert %q (aggregate %s) into %s: %w", r.WorkID, AggregateKey{Type: r.AggregateType, ID: r.AggregateID}, t.Qualified(), err)
	}
	if !inserted && seq != nil && r.AggregateSeq == 0 {
		if _, err := db.Exec(ctx, `SELECT `+t.derived("give_back_seq", true)+`($1, $2, $3)`, r.AggregateType, r.AggregateID, *seq); err != nil {
			return false, fmt.Errorf("give back sequence %d of aggregate %s of %s: %w", *seq, AggregateKey{Type: r.AggregateType, ID: r.AggregateID}, t.Qualified(), err)
		}
	}
	return inserted, nil
}

// EnqueueRows inserts rows in one statement, skipping every work_id that
// exists, and returns the work_ids it inserted. The caller makes sure no
// work_id appears twice in rows.
//
// On a partitioned table each row goes in only where
// <table>_work_id_free says so (EnqueueOne); the rows are taken in work_id
// order, so that two batches sharing work_ids wait for each other's locks
// in the same order instead of deadlocking.
func EnqueueRows(ctx context.Context, db DBTX, t Table, rows []EnqueueRow) (map[string]bool, error) {
	part, key, err := isPartitioned(ctx, db, t)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(rows))
	kinds := make([]string, len(rows))
	subjects := make([]string, len(rows))
	payloads := make([]string, len(rows))
	headers := make([]*string, len(rows))
	avail := make([]*time.Time, len(rows))
	for i, r := range rows {
		ids[i], kinds[i], subjects[i], payloads[i], headers[i], avail[i] = r.WorkID, r.Kind, r.Subject, r.Payload, r.Headers, r.availableAt()
	}
	q := `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at)
		SELECT w, k, NULLIF(s, ''), p::jsonb, h::jsonb, COALESCE(a, clock_timestamp())
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[]) AS u(w, k, s, p, h, a)
		ON CONFLICT (work_id) DO NOTHING
		RETURNING work_id`
	if part {
		// The function is volatile, so the planner keeps it above the
		// sort: it is called in work_id order.
		q = `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at)
		SELECT w, k, NULLIF(s, ''), p::jsonb, h::jsonb, COALESCE(a, clock_timestamp())
		FROM (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[]) AS u(w, k, s, p, h, a)
			ORDER BY w) AS u
		WHERE ` + t.derived("work_id_free", true) + `(w)
		RETURNING work_id`
	}
	res, err := db.Query(ctx, q, ids, kinds, subjects, payloads, headers, avail)
	if err != nil {
		forgetLayout(key)
		return nil, fmt.Errorf("insert %d rows into %s: %w", len(rows), t.Qualified(), err)
	}
	inserted, err := pgx.CollectRows(res, pgx.RowTo[string])
	if err != nil {
		forgetLayout(key)
		return nil, fmt.Errorf("insert %d rows into %s: %w", len(rows), t.Qualified(), err)
	}
	out := make(map[string]bool, len(inserted))
	for _, id := range inserted {
		out[id] = true
	}
	return out, nil
}

// EnqueueComparison is how a row a producer tried to insert compares with
// the stored row of the same work_id. Found is false when no row exists any
// more (deleted after publishing, or pruned) between the insert and the
// comparison.
type EnqueueComparison struct {
	WorkID                             string
	Found                              bool
	SameKind, SameSubject, SamePayload bool
	// The stored values, for the error message.
	Kind, Subject, Payload string
}

// CompareEnqueued reads, in one statement, the stored rows of rows' work_ids
// and compares kind, subject and payload with what the producer meant to
// insert. Payloads compare as jsonb, so key order and whitespace do not make a
// difference; headers and available_at are not compared, since a retry of the
// same intention may carry a new trace context or time. It runs as its own
// statement after the insert so that, under READ COMMITTED, it sees a row
// that a concurrent transaction committed while the insert waited for it.
func CompareEnqueued(ctx context.Context, db DBTX, t Table, rows []EnqueueRow) ([]EnqueueComparison, error) {
	ids := make([]string, len(rows))
	kinds := make([]string, len(rows))
	subjects := make([]string, len(rows))
	payloads := make([]string, len(rows))
	for i, r := range rows {
		ids[i], kinds[i], subjects[i], payloads[i] = r.WorkID, r.Kind, r.Subject, r.Payload
	}
	part, _, err := isPartitioned(ctx, db, t)
	if err != nil {
		return nil, err
	}
	// On a partitioned table a raw INSERT (not package outbox) can have put
	// a work_id in twice: the first row stands for it.
	join := `LEFT JOIN ` + t.String() + ` o ON o.work_id = u.w`
	if part {
		join = `LEFT JOIN LATERAL (SELECT x.work_id, x.kind, x.subject, x.payload FROM ` + t.String() + ` x WHERE x.work_id = u.w LIMIT 1) o ON true`
	}
	res, err := db.Query(ctx, `SELECT u.w, o.work_id IS NOT NULL,
			COALESCE(o.kind = u.k, false),
			COALESCE(o.subject IS NOT DISTINCT FROM NULLIF(u.s, ''), false),
			COALESCE(o.payload = u.p::jsonb, false),
			COALESCE(o.kind, ''), COALESCE(o.subject, ''), COALESCE(o.payload::text, '')
		FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) WITH ORDINALITY AS u(w, k, s, p, n)
		`+join+`
		ORDER BY u.n`,
		ids, kinds, subjects, payloads)
	if err != nil {
		return nil, fmt.Errorf("compare %d rows with %s: %w", len(rows), t.Qualified(), err)
	}
	out, err := pgx.CollectRows(res, func(r pgx.CollectableRow) (EnqueueComparison, error) {
		var c EnqueueComparison
		err := r.Scan(&c.WorkID, &c.Found, &c.SameKind, &c.SameSubject, &c.SamePayload, &c.Kind, &c.Subject, &c.Payload)
		return c, err
	})
	if err != nil {
		return nil, fmt.Errorf("compare %d rows with %s: %w", len(rows), t.Qualified(), err)
	}
	return out, nil
}
