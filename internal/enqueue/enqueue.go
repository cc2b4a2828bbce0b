// Package enqueue is the producer's statements on the outbox table: the
// inserts and the comparison of a repeat that package outbox runs in the
// application's transaction. It is apart from the store so that what every
// application links is these statements and the table's name rules, not
// the relay's.
package enqueue

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/table"
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

// Row is one row a producer inserts, already validated. Payload is
// the payload's bytes: JSON text for a jsonb or json column, any bytes for
// bytea (passed to the database as bytes, never as text). Headers is a JSON
// object's text. An empty Subject, nil Headers and a zero AvailableAt leave
// the column to its default (NULL, NULL, the database clock).
type Row struct {
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
func (r Row) Ordered() bool { return r.AggregateType != "" }

func (r Row) expiresAt() *time.Time {
	if r.ExpiresAt.IsZero() {
		return nil
	}
	return &r.ExpiresAt
}

func (r Row) availableAt() *time.Time {
	if r.AvailableAt.IsZero() {
		return nil
	}
	return &r.AvailableAt
}

// Layout is what the producer's statements depend on: whether the
// table is partitioned (migrate --partition-interval) and its payload
// column's type (migrate --payload-type).
type Layout struct {
	Partitioned bool
	// PayloadType is "jsonb", "json" or "bytea". A column of another type
	// (made by hand) is written as jsonb was before --payload-type, and a
	// table that does not exist reads as jsonb (the insert then says it is
	// missing).
	PayloadType string
}

// Binary reports whether the payload column holds bytes (bytea).
func (l Layout) Binary() bool { return l.PayloadType == "bytea" }

// The layouts of the tables producers write to, by database and table
// (dbKey). A table is laid out for good (the conversion procedures make a
// new table), so the answer is kept; a statement that fails forgets it, so
// that a table dropped and made again with another layout under the same
// name costs one failed statement.
var layouts sync.Map // layoutKey -> Layout

// LayoutOf returns t's layout as the producer's statements need it,
// asking the database once per process, database and table (one catalog
// query), as the first enqueue into it would.
func LayoutOf(ctx context.Context, db DBTX, t table.Table) (Layout, error) {
	l, _, err := readLayout(ctx, db, t)
	return l, err
}

func readLayout(ctx context.Context, db DBTX, t table.Table) (Layout, layoutKey, error) {
	k := layoutKey{dbKey(db), t.Qualified()}
	if k.db != "" {
		if v, ok := layouts.Load(k); ok {
			return v.(Layout), k, nil
		}
	}
	var l Layout
	var found bool
	err := db.QueryRow(ctx, `SELECT c.oid IS NOT NULL, coalesce(c.relkind = 'p', false), coalesce(format_type(a.atttypid, NULL), '')
		FROM (SELECT to_regclass($1) AS oid) r
		LEFT JOIN pg_catalog.pg_class c ON c.oid = r.oid
		LEFT JOIN pg_catalog.pg_attribute a ON a.attrelid = r.oid AND a.attname = 'payload' AND a.attnum > 0 AND NOT a.attisdropped`,
		t.String()).Scan(&found, &l.Partitioned, &l.PayloadType)
	if err != nil {
		return Layout{}, k, fmt.Errorf("read the layout of %s: %w", t.Qualified(), err)
	}
	switch l.PayloadType {
	case "json", "bytea":
	default:
		l.PayloadType = "jsonb"
	}
	if found && k.db != "" {
		layouts.Store(k, l)
	}
	return l, k, nil
}

func forgetLayout(k layoutKey) { layouts.Delete(k) }

// payloadSQL is the expression that turns parameter (or column) p into the
// payload column's type: jsonb and json take the JSON text (json keeps it
// byte for byte), bytea the bytes themselves.
func (l Layout) payloadSQL(p string) string {
	switch l.PayloadType {
	case "json":
		return p + `::text::json`
	case "bytea":
		return p + `::bytea`
	}
	return p + `::text::jsonb`
}

// payloadArg is the parameter for one payload: text for jsonb and json, bytes
// for bytea (never NULL: an empty payload is zero bytes).
func (l Layout) payloadArg(p string) any {
	if l.Binary() {
		return payloadBytes(p)
	}
	return p
}

func payloadBytes(p string) []byte {
	if p == "" {
		return []byte{}
	}
	return []byte(p)
}

// payloadArray is the parameter for rows' payloads, and the array type it is
// cast to: text[] for jsonb and json, bytea[] for bytea.
func (l Layout) payloadArray(rows []Row) (any, string) {
	if l.Binary() {
		ps := make([][]byte, len(rows))
		for i, r := range rows {
			ps[i] = payloadBytes(r.Payload)
		}
		return ps, `bytea[]`
	}
	ps := make([]string, len(rows))
	for i, r := range rows {
		ps[i] = r.Payload
	}
	return ps, `text[]`
}

// payloadElem turns an element of payloadArray's array (u.p) into the
// column's type.
func (l Layout) payloadElem(p string) string {
	switch l.PayloadType {
	case "json":
		return p + `::json`
	case "bytea":
		return p
	}
	return p + `::jsonb`
}

// samePayloadSQL compares the stored payload o.payload with u.p, an element
// of payloadArray's array: jsonb as jsonb (key order and whitespace do not
// matter), json as its text (json has no equality; its text is what the
// relay publishes), bytea byte for byte.
func (l Layout) samePayloadSQL() string {
	switch l.PayloadType {
	case "json":
		return `o.payload::text = u.p`
	case "bytea":
		return `o.payload = u.p`
	}
	return `o.payload = u.p::jsonb`
}

// One inserts r unless a row with its work_id exists. It reports
// whether it inserted. ON CONFLICT DO NOTHING, rather than letting the
// primary key fail, keeps the caller's transaction usable: the caller decides
// what a repeat means (Compare).
//
// On a partitioned table no index makes work_id unique: the row is inserted
// only where <table>_work_id_free($1) says no row has the work_id, after
// waiting for every other enqueue of it to end (migration 0014 says why
// that is sound). The statement is the same round trip.
func One(ctx context.Context, db DBTX, t table.Table, r Row) (bool, error) {
	l, key, err := readLayout(ctx, db, t)
	if err != nil {
		return false, err
	}
	if r.Ordered() {
		ok, err := enqueueOrdered(ctx, db, t, r, l)
		if err != nil {
			forgetLayout(key)
		}
		return ok, err
	}
	q := `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at, expires_at)
		VALUES ($1, $2, NULLIF($3::text, ''), ` + l.payloadSQL(`$4`) + `, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $7)
		ON CONFLICT (work_id) DO NOTHING`
	if l.Partitioned {
		q = `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at, expires_at)
		SELECT $1, $2, NULLIF($3::text, ''), ` + l.payloadSQL(`$4`) + `, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $7
		WHERE ` + t.Derived("work_id_free", true) + `($1)`
	}
	tag, err := db.Exec(ctx, q, r.WorkID, r.Kind, r.Subject, l.payloadArg(r.Payload), r.Headers, r.availableAt(), r.expiresAt())
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
func enqueueOrdered(ctx context.Context, db DBTX, t table.Table, r Row, l Layout) (bool, error) {
	var seq *int64
	var inserted bool
	// On a partitioned table the look for a repeat is <table>_work_id_free,
	// which waits for the other enqueues of the work_id and looks after
	// they ended; then no insert can conflict, and there is no index to
	// name in ON CONFLICT.
	free, conflict := `NOT EXISTS (SELECT 1 FROM `+t.String()+` WHERE work_id = $1)`, `ON CONFLICT (work_id) DO NOTHING`
	if l.Partitioned {
		free, conflict = t.Derived("work_id_free", true)+`($1)`, ``
	}
	err := db.QueryRow(ctx, `WITH s AS (
			SELECT CASE WHEN $9::bigint > 0 THEN $9::bigint ELSE `+t.Derived("next_seq", true)+`($7, $8) END AS seq
			WHERE `+free+`),
		ins AS (
			INSERT INTO `+t.String()+` (work_id, kind, subject, payload, headers, available_at, expires_at,
				aggregate_type, aggregate_id, aggregate_seq)
			SELECT $1, $2, NULLIF($3::text, ''), `+l.payloadSQL(`$4`)+`, $5::text::jsonb, COALESCE($6::timestamptz, clock_timestamp()), $10,
				$7, $8, s.seq FROM s
			`+conflict+`
			RETURNING 1)
		SELECT (SELECT seq FROM s), EXISTS (SELECT 1 FROM ins)`,
		r.WorkID, r.Kind, r.Subject, l.payloadArg(r.Payload), r.Headers, r.availableAt(), r.AggregateType, r.AggregateID, r.AggregateSeq, r.expiresAt()).
		Scan(&seq, &inserted)
	if err != nil {
		return false, fmt.Errorf("insert %q (aggregate %s) into %s: %w", r.WorkID, aggregateKey(r.AggregateType, r.AggregateID), t.Qualified(), err)
	}
	if !inserted && seq != nil && r.AggregateSeq == 0 {
		if _, err := db.Exec(ctx, `SELECT `+t.Derived("give_back_seq", true)+`($1, $2, $3)`, r.AggregateType, r.AggregateID, *seq); err != nil {
			return false, fmt.Errorf("give back sequence %d of aggregate %s of %s: %w", *seq, aggregateKey(r.AggregateType, r.AggregateID), t.Qualified(), err)
		}
	}
	return inserted, nil
}

// Rows inserts rows in one statement, skipping every work_id that
// exists, and returns the work_ids it inserted. The caller makes sure no
// work_id appears twice in rows.
//
// On a partitioned table each row goes in only where
// <table>_work_id_free says so (One); the rows are taken in work_id
// order, so that two batches sharing work_ids wait for each other's locks
// in the same order instead of deadlocking.
func Rows(ctx context.Context, db DBTX, t table.Table, rows []Row) (map[string]bool, error) {
	l, key, err := readLayout(ctx, db, t)
	if err != nil {
		return nil, err
	}
	ids := make([]string, len(rows))
	kinds := make([]string, len(rows))
	subjects := make([]string, len(rows))
	headers := make([]*string, len(rows))
	avail := make([]*time.Time, len(rows))
	for i, r := range rows {
		ids[i], kinds[i], subjects[i], headers[i], avail[i] = r.WorkID, r.Kind, r.Subject, r.Headers, r.availableAt()
	}
	payloads, ptype := l.payloadArray(rows)
	q := `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at)
		SELECT w, k, NULLIF(s, ''), ` + l.payloadElem(`p`) + `, h::jsonb, COALESCE(a, clock_timestamp())
		FROM unnest($1::text[], $2::text[], $3::text[], $4::` + ptype + `, $5::text[], $6::timestamptz[]) AS u(w, k, s, p, h, a)
		ON CONFLICT (work_id) DO NOTHING
		RETURNING work_id`
	if l.Partitioned {
		// The function is volatile, so the planner keeps it above the
		// sort: it is called in work_id order.
		q = `INSERT INTO ` + t.String() + ` (work_id, kind, subject, payload, headers, available_at)
		SELECT w, k, NULLIF(s, ''), ` + l.payloadElem(`p`) + `, h::jsonb, COALESCE(a, clock_timestamp())
		FROM (SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::` + ptype + `, $5::text[], $6::timestamptz[]) AS u(w, k, s, p, h, a)
			ORDER BY w) AS u
		WHERE ` + t.Derived("work_id_free", true) + `(w)
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

// Comparison is how a row a producer tried to insert compares with
// the stored row of the same work_id. Found is false when no row exists any
// more (deleted after publishing, or pruned) between the insert and the
// comparison.
type Comparison struct {
	WorkID                             string
	Found                              bool
	SameKind, SameSubject, SamePayload bool
	// The stored values, for the error message; Payload as PostgreSQL
	// prints the column (bytea as \x hex).
	Kind, Subject, Payload string
}

// Compare reads, in one statement, the stored rows of rows' work_ids
// and compares kind, subject and payload with what the producer meant to
// insert. Payloads compare as the column's type allows: jsonb as jsonb, so
// key order and whitespace do not make a difference; json as its text and
// bytea as bytes, since the relay publishes those byte for byte. Headers and
// available_at are not compared, since a retry of the same intention may
// carry a new trace context or time. It runs as its own
// statement after the insert so that, under READ COMMITTED, it sees a row
// that a concurrent transaction committed while the insert waited for it.
func Compare(ctx context.Context, db DBTX, t table.Table, rows []Row) ([]Comparison, error) {
	ids := make([]string, len(rows))
	kinds := make([]string, len(rows))
	subjects := make([]string, len(rows))
	for i, r := range rows {
		ids[i], kinds[i], subjects[i] = r.WorkID, r.Kind, r.Subject
	}
	l, key, err := readLayout(ctx, db, t)
	if err != nil {
		return nil, err
	}
	payloads, ptype := l.payloadArray(rows)
	// On a partitioned table a raw INSERT (not package outbox) can have put
	// a work_id in twice: the first row stands for it.
	join := `LEFT JOIN ` + t.String() + ` o ON o.work_id = u.w`
	if l.Partitioned {
		join = `LEFT JOIN LATERAL (SELECT x.work_id, x.kind, x.subject, x.payload FROM ` + t.String() + ` x WHERE x.work_id = u.w LIMIT 1) o ON true`
	}
	res, err := db.Query(ctx, `SELECT u.w, o.work_id IS NOT NULL,
			COALESCE(o.kind = u.k, false),
			COALESCE(o.subject IS NOT DISTINCT FROM NULLIF(u.s, ''), false),
			COALESCE(`+l.samePayloadSQL()+`, false),
			COALESCE(o.kind, ''), COALESCE(o.subject, ''), COALESCE(o.payload::text, '')
		FROM unnest($1::text[], $2::text[], $3::text[], $4::`+ptype+`) WITH ORDINALITY AS u(w, k, s, p, n)
		`+join+`
		ORDER BY u.n`,
		ids, kinds, subjects, payloads)
	if err != nil {
		forgetLayout(key)
		return nil, fmt.Errorf("compare %d rows with %s: %w", len(rows), t.Qualified(), err)
	}
	out, err := pgx.CollectRows(res, func(r pgx.CollectableRow) (Comparison, error) {
		var c Comparison
		err := r.Scan(&c.WorkID, &c.Found, &c.SameKind, &c.SameSubject, &c.SamePayload, &c.Kind, &c.Subject, &c.Payload)
		return c, err
	})
	if err != nil {
		forgetLayout(key)
		return nil, fmt.Errorf("compare %d rows with %s: %w", len(rows), t.Qualified(), err)
	}
	return out, nil
}

// layoutKey names a table of a database, for the producer's cache of
// table layouts.
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

// aggregateKey writes an aggregate as the relay's messages name it
// (store.AggregateKey).
func aggregateKey(typ, id string) string { return strconv.Quote(typ) + "/" + strconv.Quote(id) }
