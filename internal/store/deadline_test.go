package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// G13 for operators and the poller's store: ExpireDue moves rows past their
// deadline to expired with the evidence of their attempts; a redrive of a
// row whose deadline passed needs a new deadline or none, and the history
// records which; prune removes old expired rows with the cancelled ones.
func TestDeadlinesInTheStore(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, expires_at) VALUES
		('never',     'k', '{}', 'scheduled', 0, NULL,                        clock_timestamp() - interval '1 second'),
		('rejected',  'k', '{}', 'scheduled', 2, 'rejected: max_msg_size: x', clock_timestamp() - interval '1 second'),
		('uncertain', 'k', '{}', 'scheduled', 1, 'uncertain: timeout',        clock_timestamp() - interval '1 second'),
		('future',    'k', '{}', 'scheduled', 0, NULL,                        clock_timestamp() + interval '1 hour'),
		('failed',    'k', '{}', 'failed',    3, 'rejected: no_stream: x',    clock_timestamp() - interval '1 second')`)
	ids, err := s.ExpireDue(ctx)
	if err != nil || len(ids) != 3 {
		t.Fatalf("ExpireDue = %v, %v; want never, rejected, uncertain", ids, err)
	}
	for id, want := range map[string]string{"never": "never attempted", "rejected": "none accepted: 2 attempt(s)", "uncertain": "possibly accepted: 1 attempt(s)"} {
		r, _ := readRow(t, pool, "outbox", id)
		var le string
		if err := pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE work_id = $1`, id).Scan(&le); err != nil {
			t.Fatal(err)
		}
		if r.State != "expired" || !strings.HasPrefix(le, "expired: deadline ") || !strings.Contains(le, want) {
			t.Errorf("%s: %s, %q; want expired with %q", id, r.State, le, want)
		}
	}
	// The claim never takes a row within the margin of its deadline.
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, expires_at) VALUES ('soon', 'k', '{}', 'scheduled', clock_timestamp() + interval '500 milliseconds')`)
	c, err := s.Claim(ctx, "w", time.Minute, 10, store.ClaimOptions{DeadlineMargin: time.Second})
	if err != nil || len(c) != 1 || c[0].WorkID != "future" {
		t.Fatalf("claim = %+v, %v; want only future", c, err)
	}

	// Redrive without a deadline refuses rows whose deadline passed.
	req := store.OpRequest{Selection: store.Selection{WorkIDs: []string{"never", "failed"}}, By: "op", Reason: "retry"}
	res, err := s.Redrive(ctx, req)
	if err != nil || len(res.Changed) != 0 || len(res.Refused) != 2 {
		t.Fatalf("redrive without a deadline: %+v, %v; want both refused", res, err)
	}
	for _, r := range res.Refused {
		if !r.DeadlinePassed || !strings.Contains(r.Why(store.ActionRedrive), "--expires-at") {
			t.Errorf("%s: %q, want the deadline named", r.WorkID, r.Why(store.ActionRedrive))
		}
	}
	req.Selection.WorkIDs = []string{"never"}
	req.NoDeadline = true
	if res, err = s.Redrive(ctx, req); err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive --no-deadline: %+v, %v", res, err)
	}
	deadline := time.Now().Add(2 * time.Hour).UTC().Truncate(time.Microsecond)
	req.Selection.WorkIDs, req.NoDeadline, req.ExpiresAt = []string{"failed"}, false, deadline
	if res, err = s.Redrive(ctx, req); err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive --expires-at: %+v, %v", res, err)
	}
	for id, want := range map[string]string{"never": "none", "failed": "new: " + deadline.Format("2006-01-02T15:04:05.000000Z")} {
		var state, hist string
		var exp *time.Time
		if err := pool.QueryRow(ctx, `SELECT o.state, o.expires_at, h.deadline FROM outbox o JOIN outbox_redrives h USING (work_id)
			WHERE work_id = $1 ORDER BY h.at DESC LIMIT 1`, id).Scan(&state, &exp, &hist); err != nil {
			t.Fatal(err)
		}
		if state != "scheduled" || hist != want || (id == "never") != (exp == nil) || (exp != nil && !exp.Equal(deadline)) {
			t.Errorf("%s: %s, expires_at %v, history deadline %q; want scheduled and %q", id, state, exp, hist, want)
		}
	}
	// Prune removes expired rows whose deadline is older than the cutoff.
	exec(t, pool, `UPDATE outbox SET expires_at = clock_timestamp() - interval '3 days' WHERE state = 'expired'`)
	pr, err := s.Prune(ctx, store.PruneRequest{OlderThan: 48 * time.Hour, Batch: 10, IncludeCancelled: true})
	if err != nil || pr.Expired != 2 {
		t.Fatalf("prune = %+v, %v; want 2 expired rows", pr, err)
	}
}

// insertOld inserts rows as a producer could before migration 0008: with
// its insert guard off for the one statement.
func insertOld(t *testing.T, pool *pgxpool.Pool, sql string) {
	t.Helper()
	exec(t, pool, `ALTER TABLE outbox DISABLE TRIGGER outbox_times_check`)
	exec(t, pool, sql)
	exec(t, pool, `ALTER TABLE outbox ENABLE TRIGGER outbox_times_check`)
}

// Migration 0008 refuses at insert every time the relay could not carry
// (issue 20, items 2 and 4), and accepts the edges of the range.
func TestTimeBoundsAtInsert(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	// The ages clamp each time, not an empty table's NULL into year 0001.
	if c, err := s.Counts(ctx); err != nil || c.OldestEligibleSeconds != 0 {
		t.Fatalf("Counts of an empty table = %+v, %v; want oldest eligible 0", c, err)
	}
	if age, err := s.OldestReadySeconds(ctx); err != nil || age != 0 {
		t.Fatalf("OldestReadySeconds of an empty table = %v, %v; want 0", age, err)
	}
	for _, tt := range []struct{ col, val string }{
		{"available_at", "infinity"}, {"available_at", "-infinity"}, {"available_at", "10000-01-01 00:00:00+00"},
		{"expires_at", "infinity"}, {"expires_at", "-infinity"}, {"expires_at", "12026-11-30 05:04:42+00"},
		{"expires_at", "0044-03-15 12:00:00+00 BC"}, {"created_at", "infinity"},
	} {
		_, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, `+tt.col+`) VALUES ('w', 'k', '{}', $1::text::timestamptz)`, tt.val)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "23514" || !strings.Contains(pgErr.Message, tt.col) {
			t.Errorf("insert %s = %s: %v; want a check violation naming the column", tt.col, tt.val, err)
		}
	}
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, available_at, expires_at) VALUES
		('edge-1', 'k', '{}', '0001-01-01 00:00:00+00', '9999-12-31 23:59:59.999999+00'),
		('edge-2', 'k', '{}', '9999-12-31 23:59:59.999999+00', '0001-01-01 00:00:00+00')`)
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("rows = %d, %v; want the two edge rows", n, err)
	}
}

// Rows from before migration 0008 with infinite or out-of-range times: the
// sweep expires a '-infinity' deadline with evidence (item 1), a claim and
// every console and status read take them (items 2 and 4), cancel frees the
// aggregate an 'infinity' available_at holds (item 4), a plain redrive
// refuses a deadline no message can carry, and a redrive to a deadline that
// already passed is refused with the row untouched (item 3).
func TestDeadlineEdgesInTheStore(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	insertOld(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, available_at, expires_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('neg-deadline', 'k', '{}', 'scheduled', clock_timestamp(), '-infinity', NULL, NULL, NULL),
		('inf-deadline', 'k', '{}', 'scheduled', clock_timestamp(), 'infinity', NULL, NULL, NULL),
		('far-deadline', 'k', '{}', 'cancelled', clock_timestamp(), '12026-01-01 00:00:00+00', NULL, NULL, NULL),
		('neg-ready',    'k', '{}', 'ready',     '-infinity', NULL, NULL, NULL, NULL),
		('inf-avail',    'k', '{}', 'scheduled', 'infinity', NULL, 'order', '1', 1),
		('behind',       'k', '{}', 'scheduled', clock_timestamp(), NULL, 'order', '1', 2)`)

	ids, err := s.ExpireDue(ctx)
	if err != nil || len(ids) != 1 || ids[0] != "neg-deadline" {
		t.Fatalf("ExpireDue = %v, %v; want neg-deadline", ids, err)
	}
	var state, le string
	if err := pool.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM outbox WHERE work_id = 'neg-deadline'`).Scan(&state, &le); err != nil {
		t.Fatal(err)
	}
	if state != "expired" || le != "expired: deadline -infinity passed; never attempted" {
		t.Errorf("neg-deadline: %s, last_error %q; want expired with the deadline and never attempted", state, le)
	}

	// The aggregate is held by inf-avail: behind is not claimable.
	c, err := s.Claim(ctx, "w", time.Minute, 10, store.ClaimOptions{Ordered: true})
	if err != nil || len(c) != 1 || c[0].WorkID != "inf-deadline" || !c[0].ExpiresAt.Equal(wire.Infinity) {
		t.Fatalf("claim = %+v, %v; want inf-deadline alone, its deadline read as infinity", c, err)
	}

	counts, err := s.Counts(ctx)
	if err != nil || counts.OldestEligibleSeconds < 60*60*24*365*2000 {
		t.Errorf("Counts = %+v, %v; want the -infinity ready row as eligible for ages", counts, err)
	}
	rows, err := s.ListRows(ctx, store.ListFilter{State: "scheduled", Limit: 10})
	if err != nil || len(rows) != 2 {
		t.Fatalf("ListRows(scheduled) = %+v, %v; want inf-avail and behind", rows, err)
	}
	r, ok, err := s.Row(ctx, "inf-avail")
	if err != nil || !ok || !r.AvailableAt.Equal(wire.Infinity) {
		t.Fatalf("Row(inf-avail) = %+v, %v, %v; want available_at infinity", r, ok, err)
	}
	if r, _, err := s.Row(ctx, "neg-ready"); err != nil || !r.AvailableAt.Equal(wire.NegInfinity) {
		t.Fatalf("Row(neg-ready) = %+v, %v; want available_at -infinity", r, err)
	}

	res, err := s.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"inf-avail"}}, By: "op", Reason: "never due"})
	if err != nil || len(res.Changed) != 1 || !res.Changed[0].AvailableAt.Equal(wire.Infinity) {
		t.Fatalf("cancel inf-avail = %+v, %v; want it cancelled", res, err)
	}
	c, err = s.Claim(ctx, "w", time.Minute, 10, store.ClaimOptions{Ordered: true})
	if err != nil || len(c) != 1 || c[0].WorkID != "behind" {
		t.Fatalf("claim after the cancel = %+v, %v; want behind, its aggregate freed", c, err)
	}

	// A kept deadline no message can carry is refused; a new one works.
	req := store.OpRequest{Selection: store.Selection{WorkIDs: []string{"far-deadline"}}, By: "op", Reason: "retry"}
	res, err = s.Redrive(ctx, req)
	if err != nil || len(res.Refused) != 1 || !res.Refused[0].DeadlineInvalid ||
		!strings.Contains(res.Refused[0].Why(store.ActionRedrive), "out of range") {
		t.Fatalf("redrive keeping 12026 = %+v, %v; want refused, out of range", res, err)
	}

	// A new deadline in the past (database clock) is refused; nothing moves.
	for _, past := range []time.Time{time.Now().Add(-time.Minute), time.Date(1970, 1, 1, 0, 0, 0, 0, time.UTC)} {
		req.ExpiresAt = past
		res, err = s.Redrive(ctx, req)
		if !errors.Is(err, store.ErrBadSelection) || !strings.Contains(err.Error(), "not in the future on the database clock") || len(res.Changed) != 0 {
			t.Errorf("redrive --expires-at %s = %+v, %v; want refused", past, res, err)
		}
	}
	req.ExpiresAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC)
	if _, err = s.Redrive(ctx, req); !errors.Is(err, store.ErrBadSelection) || !strings.Contains(err.Error(), "out of range") {
		t.Errorf("redrive --expires-at year 10000: %v; want refused, out of range", err)
	}
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'far-deadline'`).Scan(&state); err != nil || state != "cancelled" {
		t.Fatalf("far-deadline after the refused redrives: %s, %v; want cancelled, untouched", state, err)
	}
	req.ExpiresAt = time.Now().Add(time.Hour)
	if res, err = s.Redrive(ctx, req); err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive --expires-at in an hour = %+v, %v", res, err)
	}

	pr, err := s.Prune(ctx, store.PruneRequest{OlderThan: time.Second, Batch: 10, IncludeCancelled: true})
	if err != nil || pr.Expired != 1 {
		t.Fatalf("prune = %+v, %v; want the -infinity expired row", pr, err)
	}
}
