package store_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
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
