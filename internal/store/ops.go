package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// The operator's statements: redrive, cancel and prune. Redrive and cancel
// each change rows and append their history in ONE statement:
//
//	WITH c AS (SELECT ... WHERE <selection> AND state IN (<from>) ORDER BY created_at, work_id FOR UPDATE),
//	     u AS (UPDATE ... FROM c WHERE ... AND t.state IN (<from>) RETURNING ...),
//	     h AS (INSERT INTO <table>_redrives SELECT ... FROM u)
//	SELECT ... FROM u
//
// The lock and the guarded UPDATE are in the same statement, so nothing can
// move a row between the check and the change: a claim either committed
// before the lock (the row is running and no longer matches: refused) or
// waits for the operator's commit (SKIP LOCKED: it skips the row). The
// history row is written from the UPDATE's RETURNING, so it exists exactly
// when the row changed, with what the row looked like under the lock.
//
// Only rows in a state the action may change are locked. Ready rows belong to
// the CDC path's settle statements and running rows to their workers; an
// operator who named them must not make those wait, or deadlock with a settle
// batch that locks the same rows in another order. Rows are locked in
// (created_at, work_id) order by every operator statement, so two operators
// do not deadlock each other either.

// Action is an operator's change of a row's state, as recorded in the
// history table's action column.
type Action string

const (
	// ActionRedrive moves failed, cancelled or expired rows to scheduled.
	ActionRedrive Action = "redrive"
	// ActionCancel moves scheduled or failed rows to cancelled.
	ActionCancel Action = "cancel"
)

// From is the states the action may move a row out of.
func (a Action) From() []string {
	switch a {
	case ActionRedrive:
		return []string{StateFailed, StateCancelled, StateExpired}
	case ActionCancel:
		return []string{StateScheduled, StateFailed}
	}
	return nil
}

// DefaultStagger spreads a redrive's rows (OpRequest.Stagger) when the
// CLI or the console is not told otherwise.
const DefaultStagger = 10 * time.Millisecond

// Selection picks the rows of a redrive or cancel: either WorkIDs, or a
// filter that must name a State.
type Selection struct {
	WorkIDs []string

	State string // filter: required, one of the action's From states
	Kind  string // filter: "" for any kind
	// Since keeps rows created at or after it. The table records no time of
	// failure or cancellation that holds for every row, so the filter uses
	// created_at: when the work was created, never changed.
	Since time.Time
	// SinceAgo is Since relative to the database's clock (24h: rows created
	// in the last 24 hours). Zero: no bound. At most one of Since and
	// SinceAgo is set.
	SinceAgo time.Duration
	Limit    int // filter: at most this many rows, oldest first; 0 for all
}

func (s Selection) filtered() bool {
	return s.State != "" || s.Kind != "" || !s.Since.IsZero() || s.SinceAgo != 0 || s.Limit != 0
}

// OpRequest is one redrive or cancel.
type OpRequest struct {
	Selection
	By     string // who: stored in redriven_by and the history's by
	Reason string // why: required, stored in redrive_reason and the history
	// Stagger spreads a redrive's rows over time: the i-th row (oldest
	// first) becomes due at now + i*Stagger, so a bulk redrive does not hit
	// the broker all at once.
	Stagger time.Duration
	// DryRun runs the statement in a transaction that is rolled back: the
	// result says exactly what would change, and nothing does.
	DryRun bool
	// A redrive of a row whose deadline passed (an expired row, or a failed
	// or cancelled one past it) needs a new deadline, ExpiresAt, or
	// NoDeadline; without either such rows are refused (G13). Either one
	// applies to every redriven row and is recorded in its history row.
	ExpiresAt  time.Time
	NoDeadline bool
	// OutOfOrder lets a redrive send rows of an aggregate whose later
	// sequences are already published (or on their way through the CDC
	// path): receivers get such a row after them (G12). Without it a
	// redrive that would do so changes nothing and returns an
	// *OutOfOrderError naming the rows.
	OutOfOrder bool
}

// Overtaken is a redriven row of an aggregate whose later rows are
// already out: published, or 'ready' on the CDC path.
type Overtaken struct {
	WorkID    string
	Aggregate AggregateKey
	Seq       int64 // the row's sequence
	Latest    int64 // the highest later sequence already out
}

// OutOfOrderError is a redrive refused because it would publish rows after
// later rows of their aggregates (G12); OpRequest.OutOfOrder allows it.
type OutOfOrderError struct {
	Rows []Overtaken
}

func (e *OutOfOrderError) Error() string {
	r := e.Rows[0]
	more := ""
	if len(e.Rows) > 1 {
		more = fmt.Sprintf(" (and %d more rows like it)", len(e.Rows)-1)
	}
	return fmt.Sprintf("redrive refused, nothing changed: %s is sequence %d of aggregate %q/%q, whose sequence %d is already published or on its way%s; "+
		"receivers would get it after later sequences (an InSequence inbox whose gap was skipped, and LatestWins, record it as superseded "+
		"and do not apply it). To send it anyway, redrive again with --out-of-order; to replace its effect, enqueue a new row with the next sequence",
		r.WorkID, r.Seq, r.Aggregate.Type, r.Aggregate.ID, r.Latest, more)
}

// OpRow is one row a redrive or cancel changed, with the values it had
// under the lock (the same as its history row's previous_*).
type OpRow struct {
	WorkID             string
	Kind               string
	Subject            string // the subject column; "" when NULL (the default subject)
	PreviousState      string
	PreviousAttempts   int
	PreviousGeneration int64
	PreviousError      string // "" when NULL
	ChangedAt          time.Time
	// AvailableAt is when the poller may take a redriven row.
	AvailableAt time.Time
	// SinceLastAttempt estimates, for a redrive, the time from the row's last
	// publish attempt to AvailableAt. The table does not record when an
	// attempt happened; for a failed row its available_at (when its last
	// attempt became due: the attempt was at or after it) stands in, for a
	// cancelled row the earlier of available_at and the cancel time. The
	// estimate errs long, so a warning based on it errs on the side of
	// warning.
	SinceLastAttempt time.Duration
	// LookupSeq, when HasLookupSeq, is the row's lookup_seq: the poller
	// claimed it before, and any message of it is stored in the own stream
	// after this sequence (G18).
	LookupSeq    uint64
	HasLookupSeq bool
}

// Uncertain says the row's last attempt ended without knowing whether the
// broker stored the message (a timeout, an outage, an expired lease).
func (r OpRow) Uncertain() bool { return ClassUncertain.Of(r.PreviousError) }

// MayBeStored says an earlier attempt may have stored the row's message
// without the table knowing: its last attempt was uncertain, or the poller
// claimed it before and its last attempt was not refused by the broker (a
// known non-effect).
func (r OpRow) MayBeStored() bool {
	return r.Uncertain() || (r.HasLookupSeq && !strings.HasPrefix(r.PreviousError, "rejected"))
}

// Refusal is a work ID a redrive or cancel did not change.
type Refusal struct {
	WorkID string
	// State is the row's state as an operator sees it: "" when no row has
	// this work ID, and 'published' for a 'ready' row the watermark
	// covers (Covered).
	State string
	// Covered: the row is 'ready' in the table and the watermark covers it
	// (--on-publish none, G17): the CDC path published it.
	Covered bool
	// DeadlinePassed: a redrive found its deadline passed and was given
	// no new one. DeadlineInvalid: its deadline is one no message can
	// carry ('infinity', a year past 9999: a row from before migration
	// 0008), and it was given no new one.
	DeadlinePassed, DeadlineInvalid bool
	// LeaseUntil is the running row's lease, for "retry after".
	LeaseUntil time.Time
}

// Why explains, for an operator, why action refused the row.
func (r Refusal) Why(a Action) string {
	if r.State == "" {
		return "not found"
	}
	if r.DeadlinePassed && a == ActionRedrive && slices.Contains(a.From(), r.State) {
		return r.State + ": its deadline passed; redrive it with a new one (--expires-at) or none (--no-deadline)"
	}
	if r.DeadlineInvalid && a == ActionRedrive && slices.Contains(a.From(), r.State) {
		return r.State + ": its deadline is out of range (finite, 0001 to 9999 UTC; the relay would reject it again); redrive it with a new one (--expires-at) or none (--no-deadline)"
	}
	if slices.Contains(a.From(), r.State) {
		// The statement saw another state under the lock, and the row has
		// moved again since: the table is busy with it.
		return r.State + ": it was in another state when the " + string(a) + " ran; check it and run again"
	}
	switch r.State {
	case StateReady:
		return "ready: already on its way through the CDC path"
	case StateRunning:
		s := "running: a worker holds it, retry after its lease"
		if !r.LeaseUntil.IsZero() {
			s += " (until " + r.LeaseUntil.UTC().Format(time.RFC3339) + ")"
		}
		return s
	case StateScheduled:
		return "scheduled: the poller will publish it when due"
	case StatePublished:
		by := ""
		if r.Covered {
			// No stream sequence to point at: the row was left as inserted.
			by = " (covered by the watermark, --on-publish none)"
		}
		if a == ActionRedrive {
			return "published" + by + ": the broker has it (terminal); publish again with a new row and work ID"
		}
		return "published" + by + ": the broker has it (terminal)"
	case StateCancelled:
		return "cancelled: already cancelled"
	case StateExpired:
		return StateExpired + ": its deadline passed before it was published (terminal for cancel; redrive it with a new deadline)"
	}
	return r.State
}

// OpResult is what a redrive or cancel did (or, with DryRun, would do).
type OpResult struct {
	Action  Action
	DryRun  bool
	Changed []OpRow   // in the order they become due
	Refused []Refusal // given work IDs not changed, in the order given
	// OutOfOrder lists the redriven rows whose aggregates' later rows are
	// already out (a dry run's, or a redrive with OutOfOrder).
	OutOfOrder []Overtaken
}

// ErrBadSelection marks a request the store refuses before running SQL.
var ErrBadSelection = errors.New("invalid selection")

// Validate checks r for action a without touching the database; Redrive
// and Cancel call it too.
func (r *OpRequest) Validate(a Action) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadSelection, fmt.Sprintf(format, args...))
	}
	if strings.TrimSpace(r.Reason) == "" {
		return bad("a reason is required (--reason): it is kept with the row and in its history")
	}
	if !r.ExpiresAt.IsZero() && r.NoDeadline {
		return bad("give a new deadline (--expires-at) or none (--no-deadline), not both")
	}
	if a != ActionRedrive && (!r.ExpiresAt.IsZero() || r.NoDeadline) {
		return bad("--expires-at and --no-deadline go with redrive")
	}
	if !r.ExpiresAt.IsZero() {
		if err := wire.ValidateTime("new deadline --expires-at", r.ExpiresAt); err != nil {
			return bad("%v", err)
		}
	}
	if a != ActionRedrive && r.OutOfOrder {
		return bad("--out-of-order goes with redrive")
	}
	if strings.TrimSpace(r.By) == "" {
		return bad("who is required (--by)")
	}
	from := a.From()
	switch {
	case len(r.WorkIDs) > 0 && r.filtered():
		return bad("give work IDs or a filter (--kind, --state, --since, --limit), not both")
	case len(r.WorkIDs) > 0:
		for _, id := range r.WorkIDs {
			if id == "" {
				return bad("empty work ID")
			}
		}
	case r.State == "":
		if r.filtered() {
			return bad("a filter %s needs --state (%s)", a, strings.Join(from, " or "))
		}
		return bad("nothing selected: give --work-id, or a filter with --state (%s)", strings.Join(from, " or "))
	case !slices.Contains(from, r.State):
		return bad("%s --state %q: want %s", a, r.State, strings.Join(from, " or "))
	}
	if !r.Since.IsZero() && r.SinceAgo != 0 {
		return bad("give Since or SinceAgo, not both")
	}
	if r.SinceAgo < 0 || r.Limit < 0 || r.Stagger < 0 {
		return bad("negative --since, --limit or --stagger")
	}
	return nil
}

// args numbers a statement's parameters as they are added.
type args []any

func (a *args) add(v any) string {
	*a = append(*a, v)
	return "$" + strconv.Itoa(len(*a))
}

// candidates is the locking CTE's query: the selected rows in the action's
// from-states, in the one lock order of every operator statement.
func (s *Store) candidates(a Action, r *OpRequest, p *args) string {
	sel := r.Selection
	from := a.From()
	where := `state = ANY(` + p.add(from) + `::text[])`
	if a == ActionRedrive && r.ExpiresAt.IsZero() && !r.NoDeadline {
		// Kept, a deadline must still lie ahead, and be one a message can
		// carry (a row from before migration 0008 may hold 'infinity').
		where += ` AND (expires_at IS NULL OR (expires_at > clock_timestamp() AND expires_at < '10000-01-01 00:00:00+00'))`
	}
	if len(sel.WorkIDs) > 0 {
		where += ` AND work_id = ANY(` + p.add(sel.WorkIDs) + `::text[])`
	} else {
		where += ` AND state = ` + p.add(sel.State) + `::text`
		if sel.Kind != "" {
			where += ` AND kind = ` + p.add(sel.Kind) + `::text`
		}
		if !sel.Since.IsZero() {
			where += ` AND created_at >= ` + p.add(sel.Since) + `::timestamptz`
		}
		if sel.SinceAgo != 0 {
			where += ` AND created_at >= clock_timestamp() - ` + p.add(micros(sel.SinceAgo)) + `::bigint * interval '1 microsecond'`
		}
	}
	q := `SELECT work_id, kind, state, attempts, claim_generation, last_error, created_at,
			CASE WHEN state = 'cancelled' THEN least(available_at, coalesce(redriven_at, available_at))
			     ELSE available_at END AS last_try
		FROM ` + s.table.String() + ` WHERE ` + where + `
		ORDER BY created_at, work_id`
	if sel.Limit > 0 {
		q += ` LIMIT ` + p.add(int64(sel.Limit)) + `::bigint`
	}
	return q + ` FOR UPDATE`
}

// opSQL builds the one statement of a redrive or cancel.
func (s *Store) opSQL(a Action, r *OpRequest) (string, args) {
	var p args
	c := s.candidates(a, r, &p)
	by, reason := p.add(r.By), p.add(r.Reason)
	from := p.add(a.From())
	var set string
	deadline := `NULL` // the history's deadline column: NULL when unchanged
	switch a {
	case ActionRedrive:
		// attempts start over, so last_error starts over too: the evidence
		// of the attempts before moves to the history row.
		// An uncertain row keeps the evidence the poller's stream lookup
		// needs (redrivenUncertainSQL, G18).
		set = `state = 'scheduled', attempts = 0, last_error = ` + redrivenUncertainSQL("n.last_error", "n.last_try") + `,
			available_at = clock_timestamp() + n.i * ` + p.add(micros(r.Stagger)) + `::bigint * interval '1 microsecond',`
		switch {
		case r.NoDeadline:
			set += ` expires_at = NULL,`
			deadline = `'none'`
		case !r.ExpiresAt.IsZero():
			set += ` expires_at = ` + p.add(r.ExpiresAt) + `::timestamptz,`
			deadline = `'new: ' || ` + sqlTimeText("t.expires_at")
		}
	case ActionCancel:
		// attempts and last_error stay: a cancelled row keeps its evidence,
		// and a later redrive copies it into history.
		set = `state = 'cancelled',`
	}
	q := `WITH c AS (` + c + `),
	n AS (SELECT c.*, row_number() OVER (ORDER BY created_at, work_id) - 1 AS i FROM c),
	u AS (
		UPDATE ` + s.table.String() + ` AS t SET ` + set + `
			redriven_at = clock_timestamp(), redriven_by = ` + by + `::text, redrive_reason = ` + reason + `::text
		FROM n WHERE t.work_id = n.work_id AND t.state = ANY(` + from + `::text[])
		RETURNING t.work_id, t.kind, n.state AS prev_state, n.attempts AS prev_attempts,
			n.claim_generation AS prev_generation, n.last_error AS prev_error,
			t.redriven_at, t.available_at, n.last_try, ` + deadline + ` AS deadline, coalesce(t.subject, '') AS subject, t.lookup_seq),
	h AS (
		INSERT INTO ` + s.table.Derived("redrives", true) + `
			(work_id, action, at, "by", reason, previous_state, previous_attempts, previous_generation, previous_error, deadline)
		SELECT work_id, ` + p.add(string(a)) + `::text, redriven_at, ` + by + `::text, ` + reason + `::text,
			prev_state, prev_attempts, prev_generation, prev_error, deadline FROM u)
	SELECT work_id, kind, prev_state, prev_attempts, prev_generation, coalesce(prev_error, ''),
		redriven_at, available_at,
		CASE WHEN isfinite(available_at) AND isfinite(last_try) THEN extract(epoch FROM available_at - last_try)::float8 END,
		subject, lookup_seq
	FROM u ORDER BY available_at, work_id`
	return q, p
}

// Redrive moves the selected failed or cancelled rows to scheduled, keeping
// work_id and payload, resetting attempts, recording who, when and why, and
// appending a history row for each, in one statement.
func (s *Store) Redrive(ctx context.Context, r OpRequest) (OpResult, error) {
	return s.op(ctx, ActionRedrive, r)
}

// Cancel moves the selected scheduled or failed rows to cancelled, recording
// who, when and why, and appending a history row for each, in one statement.
// Ready rows (the CDC path's) and running rows (a worker's) are refused.
func (s *Store) Cancel(ctx context.Context, r OpRequest) (OpResult, error) {
	return s.op(ctx, ActionCancel, r)
}

func (s *Store) op(ctx context.Context, a Action, r OpRequest) (res OpResult, err error) {
	res = OpResult{Action: a, DryRun: r.DryRun}
	if err := r.Validate(a); err != nil {
		return res, err
	}
	r.WorkIDs = dedup(r.WorkIDs)
	what := func() string {
		if len(r.WorkIDs) > 0 {
			return fmt.Sprintf("%s %d work IDs in %s", a, len(r.WorkIDs), s.table.Qualified())
		}
		return fmt.Sprintf("%s %s rows in %s", a, r.State, s.table.Qualified())
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return res, fmt.Errorf("%s: begin: %w", what(), err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // after commit a no-op; the dry run's undo

	if !r.ExpiresAt.IsZero() {
		// A new deadline already passed would expire the rows again at
		// once (G13 decides on the database clock, so this does too).
		var now time.Time
		var future bool
		if err := tx.QueryRow(ctx, `SELECT clock_timestamp(), $1::timestamptz > clock_timestamp()`, r.ExpiresAt).Scan(&now, &future); err != nil {
			return res, fmt.Errorf("%s: read the database clock: %w", what(), err)
		}
		if !future {
			return res, fmt.Errorf("%w: new deadline --expires-at %s is not in the future on the database clock (now %s): the rows would expire again at once; give a later time or a duration from now like 2h",
				ErrBadSelection, wire.FormatTime(r.ExpiresAt), now.UTC().Format(time.RFC3339Nano))
		}
	}

	q, p := s.opSQL(a, &r)
	rows, err := tx.Query(ctx, q, p...)
	if err != nil {
		return res, fmt.Errorf("%s: %w", what(), err)
	}
	res.Changed, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (OpRow, error) {
		var o OpRow
		var since *float64
		var lookup *int64
		err := row.Scan(&o.WorkID, &o.Kind, &o.PreviousState, &o.PreviousAttempts, &o.PreviousGeneration,
			&o.PreviousError, &o.ChangedAt, anyTime{&o.AvailableAt}, &since, &o.Subject, &lookup)
		if lookup != nil && *lookup >= 0 {
			o.LookupSeq, o.HasLookupSeq = uint64(*lookup), true
		}
		if since != nil {
			o.SinceLastAttempt = time.Duration(*since * float64(time.Second))
		}
		return o, err
	})
	if err != nil {
		return res, fmt.Errorf("%s: %w", what(), err)
	}
	if len(r.WorkIDs) > len(res.Changed) {
		// Read after the change, in a statement of its own, so it reports
		// the state a row is in now rather than the one the change's
		// snapshot saw before it waited for a lock.
		if res.Refused, err = s.refusals(ctx, tx, r.WorkIDs, res.Changed); err != nil {
			return res, fmt.Errorf("%s: read refused rows: %w", what(), err)
		}
	}
	if a == ActionRedrive && len(res.Changed) > 0 {
		if res.OutOfOrder, err = s.overtaken(ctx, tx, res.Changed); err != nil {
			return res, fmt.Errorf("%s: read the aggregates' later rows: %w", what(), err)
		}
		if len(res.OutOfOrder) > 0 && !r.OutOfOrder && !r.DryRun {
			return OpResult{Action: a}, &OutOfOrderError{Rows: res.OutOfOrder}
		}
	}
	if r.DryRun {
		return res, nil
	}
	if err := tx.Commit(ctx); err != nil {
		return res, fmt.Errorf("%s: commit %d rows: %w", what(), len(res.Changed), err)
	}
	return res, nil
}

// overtaken returns the changed rows of an aggregate that has a later
// sequence published, or 'ready' (on its way through the CDC path, which
// would publish it before the poller takes the redriven row). Later rows
// still with the poller wait behind the redriven row (G12) and do not
// count. Rows the table no longer holds (--on-publish delete, prune) are
// not seen.
func (s *Store) overtaken(ctx context.Context, tx pgx.Tx, changed []OpRow) ([]Overtaken, error) {
	ids := make([]string, len(changed))
	for i, c := range changed {
		ids[i] = c.WorkID
	}
	rows, err := tx.Query(ctx, `SELECT r.work_id, r.aggregate_type, r.aggregate_id, r.aggregate_seq, l.seq
		FROM `+s.table.String()+` AS r CROSS JOIN LATERAL (
			SELECT o.aggregate_seq AS seq FROM `+s.table.String()+` AS o
			WHERE o.aggregate_type = r.aggregate_type AND o.aggregate_id = r.aggregate_id AND o.aggregate_seq > r.aggregate_seq
			  AND o.state IN ('published', 'ready')
			ORDER BY o.aggregate_seq DESC LIMIT 1) AS l
		WHERE r.work_id = ANY($1::text[]) AND r.aggregate_type IS NOT NULL
		ORDER BY r.aggregate_type, r.aggregate_id, r.aggregate_seq`, ids)
	if err != nil {
		return nil, err
	}
	var out []Overtaken
	var o Overtaken
	_, err = pgx.ForEachRow(rows, []any{&o.WorkID, &o.Aggregate.Type, &o.Aggregate.ID, &o.Seq, &o.Latest}, func() error {
		out = append(out, o)
		return nil
	})
	return out, err
}

func (s *Store) refusals(ctx context.Context, tx pgx.Tx, ids []string, changed []OpRow) ([]Refusal, error) {
	done := make(map[string]bool, len(changed))
	for _, c := range changed {
		done[c.WorkID] = true
	}
	var rest []string
	for _, id := range ids {
		if !done[id] {
			rest = append(rest, id)
		}
	}
	rows, err := tx.Query(ctx, `SELECT o.work_id, o.state, o.lease_until, coalesce(o.expires_at <= clock_timestamp(), false),
			coalesce(o.expires_at >= '10000-01-01 00:00:00+00', false), o.state = 'ready' AND `+s.coveredSQL("o")+`
		FROM `+s.table.String()+` AS o WHERE o.work_id = ANY($1::text[])`, rest)
	if err != nil {
		return nil, err
	}
	found := map[string]Refusal{}
	var r Refusal
	var lease *time.Time
	if _, err := pgx.ForEachRow(rows, []any{&r.WorkID, &r.State, &lease, &r.DeadlinePassed, &r.DeadlineInvalid, &r.Covered}, func() error {
		if lease != nil {
			r.LeaseUntil = *lease
		}
		if r.Covered {
			r.State = StatePublished
		}
		found[r.WorkID] = r
		r = Refusal{}
		return nil
	}); err != nil {
		return nil, err
	}
	out := make([]Refusal, 0, len(rest))
	for _, id := range rest {
		if f, ok := found[id]; ok {
			out = append(out, f)
		} else {
			out = append(out, Refusal{WorkID: id})
		}
	}
	return out, nil
}

func dedup(ids []string) []string {
	seen := make(map[string]bool, len(ids))
	out := ids[:0:0]
	for _, id := range ids {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// PruneRequest is one prune.
type PruneRequest struct {
	// OlderThan: published rows whose published_at is older than this (on
	// the database's clock, fixed when the prune starts) are deleted, and
	// 'ready' rows the watermark covers (--on-publish none, G17) whose
	// created_at is: such a row records no time of publication.
	OlderThan time.Duration
	// Batch rows per statement (and per transaction), so a large prune holds
	// few locks at a time and the table's other users keep going.
	Batch int
	// IncludeCancelled also deletes cancelled rows whose cancellation
	// (redriven_at, or created_at for a row inserted cancelled) is older
	// than OlderThan, and expired rows whose deadline is.
	IncludeCancelled bool
	// DryRun counts what would be deleted.
	DryRun bool
	// LockTimeout bounds the wait for the table's lock to detach a
	// partition (a partitioned table; 0: schema.DefaultLockTimeout).
	LockTimeout time.Duration
}

// PruneResult is what a prune deleted (or would delete).
type PruneResult struct {
	Cutoff time.Time
	// Published counts every published row deleted, Covered those of them
	// that were 'ready' rows the watermark covered (--on-publish none).
	Published int64
	Covered   int64
	Cancelled int64
	Expired   int64
	Batches   int
	// Partitioned: the table is partitioned, and prune dropped whole
	// partitions instead of deleting rows. Partitions are the ones that
	// end before Cutoff (and the DEFAULT partition when it holds rows):
	// those dropped (or, in a dry run, that would be) and those kept, with
	// why.
	Partitioned bool
	Partitions  []PartitionVerdict
}

// Prune deletes published rows (and, if asked, cancelled and expired ones)
// older than the cutoff in batches, each one statement that locks its batch
// with SKIP LOCKED, until none is left. Each batch is read through an index
// (created_idx for published rows, parked_idx for the others), so a prune
// reads the old rows once and never the rest of the table (G16). It never
// touches ready rows in flight (not covered by the watermark), scheduled,
// running or failed rows: both the batch's select and the DELETE say so. A
// ready row the watermark covers is published (G17) and goes by its
// created_at, since nothing records when it was published; the watermark
// only grows, so a row covered when the batch reads it stays covered. The history table is left alone: it is the audit
// trail, and small.
//
// On a partitioned table it deletes no row: it drops whole partitions that
// end before the cutoff and hold none of the rows it would keep on a plain
// table (prunePartitions), and res.Partitions says which it dropped and
// which it kept and why; Batch does not apply.
func (s *Store) Prune(ctx context.Context, r PruneRequest) (PruneResult, error) {
	var res PruneResult
	if r.OlderThan <= 0 {
		return res, fmt.Errorf("%w: prune --older-than must be positive", ErrBadSelection)
	}
	if r.Batch <= 0 {
		return res, fmt.Errorf("%w: prune --batch must be positive", ErrBadSelection)
	}
	// A fixed cutoff: with a moving one, a busy table would keep producing
	// rows that just became old enough and the loop might never end.
	if err := s.pool.QueryRow(ctx, `SELECT clock_timestamp() - $1::bigint * interval '1 microsecond'`, micros(r.OlderThan)).
		Scan(&res.Cutoff); err != nil {
		return res, fmt.Errorf("prune %s: read the database clock: %w", s.table.Qualified(), err)
	}
	layout, err := s.Layout(ctx)
	if err != nil {
		return res, fmt.Errorf("prune %s: %w", s.table.Qualified(), err)
	}
	if layout.Partitioned() {
		res.Partitioned = true
		if r.LockTimeout <= 0 {
			r.LockTimeout = schema.DefaultLockTimeout
		}
		res, err := s.prunePartitions(ctx, r, res, r.LockTimeout)
		return res, s.ownerHint(ctx, "prune", err)
	}
	if r.DryRun {
		return s.pruneCount(ctx, r, res)
	}
	// Published rows in (created_at, work_id) order through created_idx,
	// one batch of that order after another: each statement reads the next
	// Batch index entries and deletes those of them that are old enough, so
	// the rows it skips (not published, or published later) are read once
	// per prune, never the table per batch (G16). A published row's
	// created_at is before its published_at, so created_at < cutoff bounds
	// the walk; a row a producer inserted with a created_at later than its
	// publication is left for a later prune.
	var after *cursor
	for {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("prune %s: stopped after %d rows: %w", s.table.Qualified(), res.Published+res.Cancelled+res.Expired, err)
		}
		pub, covered, next, err := s.pruneBatch(ctx, res.Cutoff, r.Batch, after)
		if err != nil {
			return res, fmt.Errorf("prune %d rows from %s (after %d): %w", r.Batch, s.table.Qualified(), res.Published+res.Cancelled+res.Expired, err)
		}
		res.Batches++
		res.Published += pub
		res.Covered += covered
		if next == nil {
			break
		}
		after = next
	}
	if !r.IncludeCancelled {
		return res, nil
	}
	// Cancelled and expired rows through parked_idx: only those rows.
	q := `WITH b AS MATERIALIZED (
			SELECT work_id FROM ` + s.table.String() + ` WHERE parked IN ('cancelled', 'expired') AND ` + prunableParked + `
			LIMIT $2 FOR UPDATE SKIP LOCKED),
		d AS (
			DELETE FROM ` + s.table.String() + ` AS t USING b
			WHERE t.work_id = b.work_id AND t.state IN ('cancelled', 'expired')
			RETURNING t.state)
		SELECT count(*) FILTER (WHERE state = 'cancelled'), count(*) FILTER (WHERE state = 'expired') FROM d`
	for {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("prune %s: stopped after %d rows: %w", s.table.Qualified(), res.Published+res.Cancelled+res.Expired, err)
		}
		var canc, exp int64
		if err := s.pool.QueryRow(ctx, q, res.Cutoff, int64(r.Batch)).Scan(&canc, &exp); err != nil {
			return res, fmt.Errorf("prune %d cancelled and expired rows from %s (after %d): %w", r.Batch, s.table.Qualified(), res.Cancelled+res.Expired, err)
		}
		res.Batches++
		res.Cancelled += canc
		res.Expired += exp
		// Fewer than a batch: nothing older is left but rows other sessions
		// hold locked right now; the next prune gets them.
		if canc+exp < int64(r.Batch) {
			return res, nil
		}
	}
}

// prunableParked selects, among parked rows, the cancelled ones cancelled
// before the cutoff $1 (redriven_at, or created_at for a row inserted
// cancelled) and the expired ones whose deadline is before it.
const prunableParked = `((state = 'cancelled' AND coalesce(redriven_at, created_at) < $1) OR (state = 'expired' AND expires_at < $1))`

// cursor is a position in (created_at, work_id) order. pgtype keeps the
// infinities an old row may hold (migration 0008).
type cursor struct {
	createdAt pgtype.Timestamptz
	workID    string
}

// pruneBatch deletes the published rows older than cutoff among the next
// batch rows after after (from the start when nil) in (created_at, work_id)
// order, and returns how many, how many of them were ready rows the
// watermark covered, and where the next batch starts: nil when this one
// read the last row created before the cutoff.
func (s *Store) pruneBatch(ctx context.Context, cutoff time.Time, batch int, after *cursor) (deleted, covered int64, _ *cursor, _ error) {
	tbl := s.table.String()
	args := []any{cutoff, int64(batch)}
	from := ``
	if after != nil {
		from = ` AND (created_at, work_id) > ($3::timestamptz, $4::text)`
		args = append(args, after.createdAt, after.workID)
	}
	// The scan is a MATERIALIZED CTE so that its LIMIT runs exactly once,
	// and the lock is taken on the joined row, so that FOR UPDATE SKIP
	// LOCKED locks only rows that are deleted.
	q := `WITH scan AS MATERIALIZED (
			SELECT work_id, created_at FROM ` + tbl + ` WHERE created_at < $1` + from + `
			ORDER BY created_at, work_id LIMIT $2),
		b AS MATERIALIZED (
			SELECT t.work_id FROM ` + tbl + ` AS t JOIN scan USING (work_id)
			WHERE (t.state = 'published' AND t.published_at < $1) OR (t.state = 'ready' AND ` + s.coveredSQL("t") + `)
			FOR UPDATE OF t SKIP LOCKED),
		d AS (
			DELETE FROM ` + tbl + ` AS t USING b
			WHERE t.work_id = b.work_id AND ` + s.publishedSQL("t") + `
			RETURNING t.state),
		last AS (SELECT created_at, work_id FROM scan ORDER BY created_at DESC, work_id DESC LIMIT 1)
		SELECT (SELECT count(*) FROM d), (SELECT count(*) FROM d WHERE state = 'ready'), (SELECT count(*) FROM scan),
			(SELECT created_at FROM last), (SELECT work_id FROM last)`
	var scanned int64
	var next cursor
	var lastID *string
	if err := s.pool.QueryRow(ctx, q, args...).Scan(&deleted, &covered, &scanned, &next.createdAt, &lastID); err != nil {
		return 0, 0, nil, err
	}
	if scanned < int64(batch) || lastID == nil {
		return deleted, covered, nil, nil
	}
	next.workID = *lastID
	return deleted, covered, &next, nil
}

// pruneCount counts what a prune would delete: published rows through
// created_idx, as the prune walks them, and parked rows through parked_idx.
func (s *Store) pruneCount(ctx context.Context, r PruneRequest, res PruneResult) (PruneResult, error) {
	tbl := s.table.String()
	err := s.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE o.state = 'ready') FROM `+tbl+` AS o
		WHERE o.created_at < $1 AND ((o.state = 'published' AND o.published_at < $1) OR (o.state = 'ready' AND `+s.coveredSQL("o")+`))`,
		res.Cutoff).Scan(&res.Published, &res.Covered)
	if err == nil && r.IncludeCancelled {
		err = s.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'cancelled'), count(*) FILTER (WHERE state = 'expired')
			FROM `+tbl+` WHERE parked IN ('cancelled', 'expired') AND `+prunableParked, res.Cutoff).Scan(&res.Cancelled, &res.Expired)
	}
	if err != nil {
		return res, fmt.Errorf("prune %s: count rows older than %s: %w", s.table.Qualified(), res.Cutoff.Format(time.RFC3339), err)
	}
	return res, nil
}

// History is one row of the redrive history table.
type History struct {
	WorkID             string
	Action             Action
	At                 time.Time
	By                 string
	Reason             string
	PreviousState      string
	PreviousAttempts   int
	PreviousGeneration int64
	PreviousError      string // "" when NULL
	// Deadline is what a redrive did to the row's deadline: "none", "new:
	// <time>", or "" when it left it (G13).
	Deadline string
}

// History returns the redrive and cancel history of workID, oldest first.
func (s *Store) History(ctx context.Context, workID string) ([]History, error) {
	out, err := s.history(ctx, `WHERE work_id = $1 ORDER BY id`, workID)
	if err != nil {
		return nil, fmt.Errorf("read history of %s in %s: %w", workID, s.table.Qualified(), err)
	}
	return out, nil
}

// history reads history rows; tail is the WHERE/ORDER/LIMIT part.
func (s *Store) history(ctx context.Context, tail string, args ...any) ([]History, error) {
	rows, err := s.pool.Query(ctx, `SELECT work_id, action, at, "by", reason, previous_state, previous_attempts,
			previous_generation, coalesce(previous_error, ''), coalesce(deadline, '')
		FROM `+s.table.Derived("redrives", true)+` `+tail, args...)
	if err == nil {
		var out []History
		out, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (History, error) {
			var h History
			err := r.Scan(&h.WorkID, &h.Action, &h.At, &h.By, &h.Reason, &h.PreviousState, &h.PreviousAttempts,
				&h.PreviousGeneration, &h.PreviousError, &h.Deadline)
			return h, err
		})
		if err == nil {
			return out, nil
		}
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == sqlstateInsufficientPrivilege {
		e := &HistoryGrantError{Table: s.table.Derived("redrives", true), Err: err}
		// Only to name the role in the fix; the error stands without it.
		if s.pool.QueryRow(ctx, `SELECT current_user`).Scan(&e.Role) != nil {
			e.Role = ""
		}
		return nil, e
	}
	return nil, err
}

// HistoryGrantError is a read of <table>_redrives that the role may not
// make: a relay role granted by sql/roles.sql before it granted the
// history, which the console of `run --console` reads.
type HistoryGrantError struct {
	Role  string // current_user, "" when it could not be read
	Table string // <table>_redrives, quoted
	Err   error
}

// Grant is the statement that gives the role the read.
func (e *HistoryGrantError) Grant() string {
	role := "the role"
	if e.Role != "" {
		role = pgx.Identifier{e.Role}.Sanitize()
	}
	return "GRANT SELECT ON " + e.Table + " TO " + role
}

func (e *HistoryGrantError) Error() string {
	return "the database role may not read the redrive and cancel history " + e.Table + ": " + e.Grant() +
		" (`outbox-relay migrate --print-grants` prints every role's grants)"
}

func (e *HistoryGrantError) Unwrap() error { return e.Err }

// OldestReadySeconds is the age, on the database's clock, of the oldest row
// still in 'ready' by its created_at (0 when there is none), leaving out the
// ready rows the watermark covers (--on-publish none, G17): those are
// published and settled, and under none nearly every row is one, so
// counting them would make the age grow for ever. Unless it was
// committed before the slot existed (the backfill's to hand over), such a
// row's transaction is not settled, so the slot's confirmed position is at
// or before it: a relay that restarts now replays at least that far back.
// It looks at the newest RecentRows rows only (see Counts.ReadyAtLeast): a
// lower bound when the ready rows reach further back, which the callers use
// as one (replay.Estimate takes the largest of its lower bounds).
func (s *Store) OldestReadySeconds(ctx context.Context) (float64, error) {
	var age float64
	err := s.pool.QueryRow(ctx, `SELECT coalesce(extract(epoch FROM clock_timestamp() - min(`+clamped("created_at")+`)), 0)::float8
		FROM (`+s.recentSQL("state, created_at, xact_id")+`) r WHERE state = 'ready' AND NOT `+s.coveredSQL("r"), int64(RecentRows)).Scan(&age)
	if err != nil {
		return 0, fmt.Errorf("oldest ready row in %s: %w", s.table.Qualified(), err)
	}
	return age, nil
}

// ownerHint adds to err, when PostgreSQL refused it for want of privilege
// (42501: only a table's owner may detach or drop its partitions), the
// role that owns the table and what to do, which "must be owner of table"
// does not say.
func (s *Store) ownerHint(ctx context.Context, what string, err error) error {
	var pgErr *pgconn.PgError
	if err == nil || !errors.As(err, &pgErr) || pgErr.Code != sqlstateInsufficientPrivilege {
		return err
	}
	o, oerr := schema.ReadOwnership(ctx, s.pool, s.table)
	if oerr != nil || !o.Exists || o.Owner == o.User {
		return err
	}
	return fmt.Errorf("%w: role %q may not do this; run %s as the table's owner %q (connect as that role, or SET ROLE %s in a session that may)",
		err, o.User, what, o.Owner, pgx.Identifier{o.Owner}.Sanitize())
}
