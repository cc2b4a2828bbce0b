package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The operator console's reads (internal/console). They only read: every
// change the console makes goes through Redrive and Cancel, the CLI's one
// guarded statement. Values are always parameters; the only text built into
// the SQL is the quoted table name and fixed fragments chosen by the code.

// ErrorClasses are the classes a last_error starts with ("rejected: ...",
// "uncertain: ...", "expired: ...", and "duplicate: ..." on a published
// row, see DuplicateNote), as the console's filter offers them;
// ErrorClassNone selects rows without a last_error.
var ErrorClasses = []string{string(ClassRejected), string(ClassUncertain), string(ClassExpired), string(ClassDuplicate)}

// ErrorClassNone filters rows whose last_error is NULL.
const ErrorClassNone = "none"

// Cursor is a position in the (created_at, work_id) order of ListRows: the
// last row of a page. Keyset paging: a page never skips or repeats a row
// because rows before it changed, as OFFSET would.
type Cursor struct {
	CreatedAt time.Time
	WorkID    string
}

// ListFilter selects rows for the console. Zero fields do not filter.
type ListFilter struct {
	State string // one state, or "" for any
	Kind  string
	// ErrorClass is one of ErrorClasses (last_error starts with it and a
	// colon) or ErrorClassNone.
	ErrorClass string
	// MinAge and MaxAge bound the age of created_at on the database clock:
	// MinAge 1h keeps rows created more than an hour ago.
	MinAge, MaxAge time.Duration
	After          *Cursor // rows after this one
	Limit          int     // at most this many; required
	// PayloadChars truncates the payload's text to this many characters
	// (0: the whole payload), so a page of large payloads stays small.
	PayloadChars int
}

// ListedRow is a row as the console shows it: the evidence of its attempts.
type ListedRow struct {
	WorkID          string
	Kind            string
	Subject         string // "" when NULL (the kind decides the subject)
	State           string
	Attempts        int
	ClaimGeneration int64
	LastError       string // "" when NULL
	CreatedAt       time.Time
	AvailableAt     time.Time
	LeaseUntil      *time.Time
	ClaimedBy       string
	PublishedAt     *time.Time
	StreamSeq       *int64 // set once the broker accepted it: "possibly accepted" has evidence
	// Covered: a 'ready' row the newest watermark covers (--on-publish
	// none, G17): published by the CDC path, which wrote nothing to it, so
	// it has no StreamSeq or PublishedAt. ShownState says 'published'.
	Covered       bool
	StreamName    string // the stream holding StreamSeq; "" before migration 0010 or when never published
	ExpiresAt     *time.Time
	RedrivenAt    *time.Time
	RedrivenBy    string
	RedriveReason string
	AggregateType string
	AggregateID   string
	AggregateSeq  *int64
	Payload       string // the payload's text, truncated to PayloadChars
	PayloadChars  int    // the whole payload's length in characters
	Headers       string // the headers' JSON text, "" when NULL
}

// ShownState is the row's state as an operator sees it: 'published' for a
// 'ready' row the watermark covers, else its state.
func (r ListedRow) ShownState() string {
	if r.Covered {
		return StatePublished
	}
	return r.State
}

// ErrBadFilter marks a console filter the store refuses before running SQL.
var ErrBadFilter = errors.New("invalid filter")

const listColumns = `work_id, kind, coalesce(subject, ''), state, attempts, claim_generation, coalesce(last_error, ''),
	created_at, available_at, lease_until, coalesce(claimed_by, ''), published_at, stream_seq, expires_at,
	redriven_at, coalesce(redriven_by, ''), coalesce(redrive_reason, ''),
	coalesce(aggregate_type, ''), coalesce(aggregate_id, ''), aggregate_seq, coalesce(stream_name, '')`

// listedCovered is the Covered column of listColumns' rows, aliased o.
func (s *Store) listedCovered() string {
	return `o.state = 'ready' AND ` + s.coveredSQL("o")
}

func scanListed(row pgx.CollectableRow) (ListedRow, error) {
	var r ListedRow
	err := row.Scan(&r.WorkID, &r.Kind, &r.Subject, &r.State, &r.Attempts, &r.ClaimGeneration, &r.LastError,
		anyTime{&r.CreatedAt}, anyTime{&r.AvailableAt}, anyTimePtr{&r.LeaseUntil}, &r.ClaimedBy, anyTimePtr{&r.PublishedAt}, &r.StreamSeq, anyTimePtr{&r.ExpiresAt},
		anyTimePtr{&r.RedrivenAt}, &r.RedrivenBy, &r.RedriveReason, &r.AggregateType, &r.AggregateID, &r.AggregateSeq, &r.StreamName,
		&r.Covered, &r.Payload, &r.PayloadChars, &r.Headers)
	return r, err
}

// where builds the filter's FROM and WHERE clauses from fixed fragments,
// adding every value as a parameter; the rows are aliased o. Each state is
// read through the index that holds its rows, so a page costs its rows, not
// the table (G16). A 'ready' row the watermark covers (--on-publish none,
// G17) is published: the filter 'published' selects it, 'ready' does not.
func (s *Store) where(f ListFilter, p *args) (from, w string, err error) {
	tbl := s.table.String()
	from, w = tbl+` AS o`, `true`
	switch f.State {
	case "":
	case StateScheduled, StateRunning:
		// poll_idx holds exactly these rows.
		w += ` AND poll_at IS NOT NULL AND state = ` + p.add(f.State) + `::text`
	case StateFailed, StateCancelled, StateExpired:
		// parked_idx, in the page's order.
		w += ` AND parked = ` + p.add(f.State) + `::text AND state = parked`
	case StateReady:
		// No index finds ready rows (migration 0012): they are looked for
		// among the newest RecentRows rows, where the CDC path leaves them.
		from = `(SELECT * FROM ` + tbl + ` ORDER BY created_at DESC, work_id DESC LIMIT ` + p.add(int64(RecentRows)) + `::bigint) AS o`
		w += ` AND state = 'ready' AND NOT ` + s.coveredSQL("o")
	case StatePublished:
		// The walk of created_idx the published filter always was (no
		// index holds the published rows), now also keeping covered ready
		// rows.
		w += ` AND ` + s.publishedSQL("o")
	default:
		w += ` AND state = ` + p.add(f.State) + `::text`
	}
	if f.Kind != "" {
		w += ` AND kind = ` + p.add(f.Kind) + `::text`
	}
	switch {
	case f.ErrorClass == "":
	case f.ErrorClass == ErrorClassNone:
		w += ` AND last_error IS NULL`
	default:
		known := false
		for _, c := range ErrorClasses {
			known = known || c == f.ErrorClass
		}
		if !known {
			return "", "", fmt.Errorf("%w: error class %q: want one of %v or %s", ErrBadFilter, f.ErrorClass, ErrorClasses, ErrorClassNone)
		}
		// starts_with, not LIKE: no value is ever read as a pattern.
		w += ` AND starts_with(last_error, ` + p.add(f.ErrorClass+":") + `::text)`
	}
	if f.MinAge < 0 || f.MaxAge < 0 {
		return "", "", fmt.Errorf("%w: negative age", ErrBadFilter)
	}
	if f.MinAge > 0 {
		// A sub-select, run once: clock_timestamp() itself is volatile, and
		// a volatile bound cannot start or stop an index scan.
		w += ` AND created_at <= (SELECT clock_timestamp() - ` + p.add(micros(f.MinAge)) + `::bigint * interval '1 microsecond')`
	}
	if f.MaxAge > 0 {
		w += ` AND created_at >= (SELECT clock_timestamp() - ` + p.add(micros(f.MaxAge)) + `::bigint * interval '1 microsecond')`
	}
	if f.After != nil {
		w += ` AND (created_at, work_id) > (` + p.add(f.After.CreatedAt) + `::timestamptz, ` + p.add(f.After.WorkID) + `::text)`
	}
	return from, w, nil
}

// ListRows returns up to f.Limit rows matching f in (created_at, work_id)
// order, after f.After.
func (s *Store) ListRows(ctx context.Context, f ListFilter) ([]ListedRow, error) {
	if f.Limit <= 0 {
		return nil, fmt.Errorf("%w: a limit is required", ErrBadFilter)
	}
	var p args
	from, w, err := s.where(f, &p)
	if err != nil {
		return nil, err
	}
	payload := `payload::text`
	if f.PayloadChars > 0 {
		payload = `left(payload::text, ` + p.add(int64(f.PayloadChars)) + `::int)`
	}
	q := `SELECT ` + listColumns + `, ` + s.listedCovered() + `, ` + payload + `, length(payload::text), coalesce(headers::text, '')
		FROM ` + from + ` WHERE ` + w + `
		ORDER BY created_at, work_id LIMIT ` + p.add(int64(f.Limit)) + `::bigint`
	rows, err := s.pool.Query(ctx, q, p...)
	if err != nil {
		return nil, fmt.Errorf("list rows of %s: %w", s.table.Qualified(), err)
	}
	out, err := pgx.CollectRows(rows, scanListed)
	if err != nil {
		return nil, fmt.Errorf("list rows of %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// ListWorkIDs returns the work IDs of up to limit rows matching f, oldest
// first, and whether more match: the console turns a filter into the exact
// work IDs its preview shows, so the action changes no row the operator did
// not see.
func (s *Store) ListWorkIDs(ctx context.Context, f ListFilter, limit int) (ids []string, more bool, err error) {
	if limit <= 0 {
		return nil, false, fmt.Errorf("%w: a limit is required", ErrBadFilter)
	}
	var p args
	from, w, err := s.where(f, &p)
	if err != nil {
		return nil, false, err
	}
	rows, err := s.pool.Query(ctx, `SELECT work_id FROM `+from+` WHERE `+w+`
		ORDER BY created_at, work_id LIMIT `+p.add(int64(limit)+1)+`::bigint`, p...)
	if err != nil {
		return nil, false, fmt.Errorf("select work IDs of %s: %w", s.table.Qualified(), err)
	}
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, false, fmt.Errorf("select work IDs of %s: %w", s.table.Qualified(), err)
	}
	if len(ids) > limit {
		return ids[:limit], true, nil
	}
	return ids, false, nil
}

// Row returns one row with its whole payload; false when there is none.
func (s *Store) Row(ctx context.Context, workID string) (ListedRow, bool, error) {
	rows, err := s.pool.Query(ctx, `SELECT `+listColumns+`, `+s.listedCovered()+`, payload::text, length(payload::text), coalesce(headers::text, '')
		FROM `+s.table.String()+` AS o WHERE work_id = $1`, workID)
	if err != nil {
		return ListedRow{}, false, fmt.Errorf("read row %q of %s: %w", workID, s.table.Qualified(), err)
	}
	out, err := pgx.CollectRows(rows, scanListed)
	if err != nil {
		return ListedRow{}, false, fmt.Errorf("read row %q of %s: %w", workID, s.table.Qualified(), err)
	}
	if len(out) == 0 {
		return ListedRow{}, false, nil
	}
	return out[0], true, nil
}

// RecentFailures groups the rows dead-lettered within window by the class
// and reason at the head of last_error, as Counts.FailedByReason does for
// all of them. The table records no time of failure: a failed row's
// available_at (when its last attempt became due; the attempt, and so the
// failure, came at or after it) stands in, which can only leave out a row
// whose last attempt waited longer than window for a worker. It reads the
// dead letters only (parked_idx).
func (s *Store) RecentFailures(ctx context.Context, window time.Duration) (map[string]int64, error) {
	rows, err := s.pool.Query(ctx, `SELECT coalesce(`+ClassAndReasonSQL("last_error")+`, 'unknown'), count(*)
		FROM `+s.table.String()+`
		WHERE parked = 'failed' AND available_at >= clock_timestamp() - $1::bigint * interval '1 microsecond'
		GROUP BY 1`, micros(window))
	if err != nil {
		return nil, fmt.Errorf("recent failures in %s: %w", s.table.Qualified(), err)
	}
	out := map[string]int64{}
	var reason string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&reason, &n}, func() error { out[reason] = n; return nil }); err != nil {
		return nil, fmt.Errorf("recent failures in %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// RecentHistory returns the newest limit rows of the redrive and cancel
// history, newest first.
func (s *Store) RecentHistory(ctx context.Context, limit int) ([]History, error) {
	out, err := s.history(ctx, `ORDER BY id DESC LIMIT $1`, int64(limit))
	if err != nil {
		return nil, fmt.Errorf("read recent history of %s: %w", s.table.Qualified(), err)
	}
	return out, nil
}

// Pool is the store's pool, for the catalog reads that go with the table's
// (the console's slot lag and standby positions).
func (s *Store) Pool() *pgxpool.Pool { return s.pool }
