package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// opRow is everything an operator command may change or must keep.
type opRow struct {
	State         string
	Payload       string
	Attempts      int
	Generation    int64
	LastError     *string
	AvailableAt   time.Time
	RedrivenAt    *time.Time
	RedrivenBy    *string
	RedriveReason *string
	ClaimedBy     *string
}

// String shows the values behind the pointers, so two reads compare equal
// when the row did not change.
func (r opRow) String() string {
	d := func(p any) string {
		switch v := p.(type) {
		case *string:
			if v != nil {
				return *v
			}
		case *time.Time:
			if v != nil {
				return v.String()
			}
		}
		return "NULL"
	}
	return fmt.Sprintf("{%s %s attempts=%d gen=%d last_error=%s available_at=%s redriven=%s/%s/%s claimed_by=%s}",
		r.State, r.Payload, r.Attempts, r.Generation, d(r.LastError), r.AvailableAt, d(r.RedrivenAt), d(r.RedrivenBy), d(r.RedriveReason), d(r.ClaimedBy))
}

func readRow(t *testing.T, pool *pgxpool.Pool, tbl, id string) (opRow, bool) {
	t.Helper()
	var r opRow
	err := pool.QueryRow(context.Background(), `SELECT state, payload::text, attempts, claim_generation, last_error, available_at,
			redriven_at, redriven_by, redrive_reason, claimed_by
		FROM `+tbl+` WHERE work_id = $1`, id).
		Scan(&r.State, &r.Payload, &r.Attempts, &r.Generation, &r.LastError, &r.AvailableAt,
			&r.RedrivenAt, &r.RedrivenBy, &r.RedriveReason, &r.ClaimedBy)
	if err != nil && strings.Contains(err.Error(), "no rows") {
		return r, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return r, true
}

func historyCount(t *testing.T, pool *pgxpool.Pool, hist string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+hist).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func exec(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// seedStates inserts one row per state, each with its own attempts,
// generation and last error, created a minute apart in the order given.
func seedStates(t *testing.T, pool *pgxpool.Pool, tbl string) {
	t.Helper()
	exec(t, pool, `INSERT INTO `+tbl+` (work_id, kind, payload, state, attempts, claim_generation, last_error, claimed_by, lease_until,
			published_at, stream_seq, created_at)
		VALUES
		('failed-1',    'order.created', '{"n": 1}', 'failed',    10, 7, 'rejected: max_payload: 2 MB > 1 MB', NULL, NULL, NULL, NULL, clock_timestamp() - interval '6 minutes'),
		('cancelled-1', 'order.created', '{"n": 2}', 'cancelled',  3, 2, 'uncertain: timeout', NULL, NULL, NULL, NULL, clock_timestamp() - interval '5 minutes'),
		('ready-1',     'order.created', '{"n": 3}', 'ready',      0, 0, NULL, NULL, NULL, NULL, NULL, clock_timestamp() - interval '4 minutes'),
		('scheduled-1', 'order.created', '{"n": 4}', 'scheduled',  1, 0, 'rejected: no_stream: x', NULL, NULL, NULL, NULL, clock_timestamp() - interval '3 minutes'),
		('running-1',   'order.created', '{"n": 5}', 'running',    2, 4, NULL, 'worker-A', clock_timestamp() + interval '1 hour', NULL, NULL, clock_timestamp() - interval '2 minutes'),
		('published-1', 'order.created', '{"n": 6}', 'published', 0, 0, NULL, NULL, NULL, clock_timestamp(), 9, clock_timestamp() - interval '1 minute')`)
}

// Redrive of a failed and a cancelled row: scheduled, attempts 0, same
// work_id, payload and generation, audit columns set, one history row each
// with the evidence; every other state and an unknown ID refused, listed
// with its state and left exactly as it was.
func TestRedriveByWorkID(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	seedStates(t, pool, "outbox")
	before := map[string]opRow{}
	for _, id := range []string{"ready-1", "scheduled-1", "running-1", "published-1"} {
		before[id], _ = readRow(t, pool, "outbox", id)
	}

	res, err := s.Redrive(ctx, store.OpRequest{
		Selection: store.Selection{WorkIDs: []string{"failed-1", "ready-1", "cancelled-1", "scheduled-1", "running-1", "published-1", "nope", "failed-1"}},
		By:        "alice@host", Reason: "INC-42: stream limit raised", Stagger: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	var changed []string
	for _, c := range res.Changed {
		changed = append(changed, c.WorkID)
	}
	// Oldest first: failed-1 was created before cancelled-1.
	if !slices.Equal(changed, []string{"failed-1", "cancelled-1"}) {
		t.Fatalf("changed %v, want [failed-1 cancelled-1]", changed)
	}
	if !res.Changed[1].AvailableAt.After(res.Changed[0].AvailableAt) {
		t.Errorf("available_at not staggered: %v then %v", res.Changed[0].AvailableAt, res.Changed[1].AvailableAt)
	}
	if c := res.Changed[1]; c.PreviousState != "cancelled" || c.PreviousAttempts != 3 || c.PreviousGeneration != 2 || !c.Uncertain() {
		t.Errorf("cancelled-1 result = %+v", c)
	}
	var refused []string
	for _, r := range res.Refused {
		refused = append(refused, r.WorkID+"="+r.State)
	}
	want := []string{"ready-1=ready", "scheduled-1=scheduled", "running-1=running", "published-1=published", "nope="}
	if !slices.Equal(refused, want) {
		t.Fatalf("refused %v, want %v", refused, want)
	}
	if why := res.Refused[0].Why(store.ActionRedrive); !strings.Contains(why, "CDC path") {
		t.Errorf("ready refusal says %q", why)
	}
	if why := res.Refused[2].Why(store.ActionRedrive); !strings.Contains(why, "retry after its lease") || !strings.Contains(why, "until") {
		t.Errorf("running refusal says %q", why)
	}
	if why := res.Refused[4].Why(store.ActionRedrive); why != "not found" {
		t.Errorf("missing refusal says %q", why)
	}

	for id, payload := range map[string]string{"failed-1": `{"n": 1}`, "cancelled-1": `{"n": 2}`} {
		r, ok := readRow(t, pool, "outbox", id)
		if !ok {
			t.Fatalf("%s gone", id)
		}
		// An uncertain row keeps its evidence for the poller's stream
		// lookup (G18); any other last_error is cleared.
		wantErr := id == "cancelled-1"
		if r.State != "scheduled" || r.Attempts != 0 || r.Payload != payload || (r.LastError != nil) != wantErr || r.ClaimedBy != nil {
			t.Errorf("%s = %+v, want scheduled, attempts 0, payload %s, last_error cleared unless uncertain", id, r, payload)
		}
		if wantErr {
			if since, ok := store.RedrivenUncertainSince(*r.LastError); !ok || since.IsZero() || !strings.HasSuffix(*r.LastError, "(uncertain: timeout)") {
				t.Errorf("%s last_error %q, want the redriven uncertain evidence", id, *r.LastError)
			}
		}
		if r.RedrivenAt == nil || r.RedrivenBy == nil || *r.RedrivenBy != "alice@host" || r.RedriveReason == nil || *r.RedriveReason != "INC-42: stream limit raised" {
			t.Errorf("%s audit = %v %v %v", id, r.RedrivenAt, r.RedrivenBy, r.RedriveReason)
		}
	}
	if r, _ := readRow(t, pool, "outbox", "failed-1"); r.Generation != 7 {
		t.Errorf("failed-1 generation %d, want 7 kept (old claims stay fenced)", r.Generation)
	}
	h, err := s.History(ctx, "failed-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Action != store.ActionRedrive || h[0].By != "alice@host" || h[0].Reason != "INC-42: stream limit raised" ||
		h[0].PreviousState != "failed" || h[0].PreviousAttempts != 10 || h[0].PreviousGeneration != 7 ||
		h[0].PreviousError != "rejected: max_payload: 2 MB > 1 MB" {
		t.Fatalf("failed-1 history = %+v", h)
	}
	if r, _ := readRow(t, pool, "outbox", "failed-1"); !h[0].At.Equal(*r.RedrivenAt) {
		t.Errorf("history at %v, row redriven_at %v: want the same instant", h[0].At, *r.RedrivenAt)
	}
	if h, _ := s.History(ctx, "cancelled-1"); len(h) != 1 || h[0].PreviousState != "cancelled" || h[0].PreviousError != "uncertain: timeout" {
		t.Fatalf("cancelled-1 history = %+v", h)
	}
	if n := historyCount(t, pool, "outbox_redrives"); n != 2 {
		t.Errorf("%d history rows, want 2 (none for refused rows)", n)
	}
	for id, b := range before {
		if a, _ := readRow(t, pool, "outbox", id); a.String() != b.String() {
			t.Errorf("refused %s changed: %s -> %s", id, b, a)
		}
	}

	// The redriven row is the poller's again, with the same identity.
	claimed, err := s.Claim(ctx, "B", time.Minute, 10, store.ClaimOptions{})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]store.Claimed{}
	for _, c := range claimed {
		got[c.WorkID] = c
	}
	if c, ok := got["failed-1"]; !ok || c.Attempts != 1 || c.ClaimGeneration != 8 || string(c.Payload) != `{"n": 1}` {
		t.Errorf("claim after redrive: %+v", claimed)
	}
}

// Bulk redrive by filter spreads available_at: oldest row first, each the
// stagger after the one before, so the poller does not take them all at once.
func TestRedriveStaggersAvailableAt(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, created_at)
		SELECT 'f' || g, 'k', jsonb_build_object('g', g), 'failed', 10, 'rejected: x', clock_timestamp() - (100 - g) * interval '1 second'
		FROM generate_series(1, 50) g`)
	var before time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	const stagger = 500 * time.Millisecond
	res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{State: "failed"}, By: "b", Reason: "r", Stagger: stagger})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Changed) != 50 {
		t.Fatalf("changed %d, want 50", len(res.Changed))
	}
	rows, err := pool.Query(ctx, `SELECT available_at FROM outbox ORDER BY created_at`)
	if err != nil {
		t.Fatal(err)
	}
	var at []time.Time
	for rows.Next() {
		var a time.Time
		if err := rows.Scan(&a); err != nil {
			t.Fatal(err)
		}
		at = append(at, a)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if at[0].Before(before) || at[0].Sub(before) > 5*time.Second {
		t.Errorf("first row due at %v, want about now (%v)", at[0], before)
	}
	for i := 1; i < len(at); i++ {
		// clock_timestamp() moves a little per row, never backwards.
		if d := at[i].Sub(at[i-1]); d < stagger || d > stagger+time.Second {
			t.Fatalf("row %d due %v after row %d, want about %v", i, d, i-1, stagger)
		}
	}
	for i, c := range res.Changed {
		if c.WorkID != fmt.Sprintf("f%d", i+1) || !c.AvailableAt.Equal(at[i]) {
			t.Fatalf("result %d = %s due %v, want f%d due %v", i, c.WorkID, c.AvailableAt, i+1, at[i])
		}
	}
}

// Cancel moves scheduled and failed rows, keeps their attempts and
// evidence and records history; ready and running rows are refused with
// the reason, and stay as they were.
func TestCancel(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	seedStates(t, pool, "outbox")
	res, err := s.Cancel(ctx, store.OpRequest{
		Selection: store.Selection{WorkIDs: []string{"scheduled-1", "failed-1", "ready-1", "running-1", "cancelled-1"}},
		By:        "bob", Reason: "customer withdrew the order",
	})
	if err != nil {
		t.Fatal(err)
	}
	var changed []string
	for _, c := range res.Changed {
		changed = append(changed, c.WorkID+"<-"+c.PreviousState)
	}
	sort.Strings(changed)
	if !slices.Equal(changed, []string{"failed-1<-failed", "scheduled-1<-scheduled"}) {
		t.Fatalf("changed %v", changed)
	}
	why := map[string]string{}
	for _, r := range res.Refused {
		why[r.WorkID] = r.Why(store.ActionCancel)
	}
	if len(why) != 3 || !strings.Contains(why["ready-1"], "already on its way through the CDC path") ||
		!strings.Contains(why["running-1"], "a worker holds it, retry after its lease") ||
		!strings.Contains(why["cancelled-1"], "already cancelled") {
		t.Fatalf("refusals: %v", why)
	}
	r, _ := readRow(t, pool, "outbox", "scheduled-1")
	if r.State != "cancelled" || r.Attempts != 1 || r.LastError == nil || *r.LastError != "rejected: no_stream: x" ||
		r.RedrivenBy == nil || *r.RedrivenBy != "bob" || r.RedriveReason == nil || *r.RedriveReason != "customer withdrew the order" {
		t.Errorf("scheduled-1 = %+v", r)
	}
	if r, _ := readRow(t, pool, "outbox", "ready-1"); r.State != "ready" || r.RedrivenAt != nil {
		t.Errorf("ready-1 = %+v", r)
	}
	if r, _ := readRow(t, pool, "outbox", "running-1"); r.State != "running" || r.ClaimedBy == nil || *r.ClaimedBy != "worker-A" {
		t.Errorf("running-1 = %+v", r)
	}
	h, err := s.History(ctx, "scheduled-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 1 || h[0].Action != store.ActionCancel || h[0].PreviousState != "scheduled" || h[0].PreviousAttempts != 1 ||
		h[0].PreviousError != "rejected: no_stream: x" || h[0].By != "bob" {
		t.Fatalf("history = %+v", h)
	}
	// A cancelled row is no longer the poller's.
	if c, err := s.Claim(ctx, "A", time.Minute, 10, store.ClaimOptions{}); err != nil || len(c) != 0 {
		t.Fatalf("claimed %+v after cancel, err %v", c, err)
	}
	// And cancel then redrive: both in history, the redrive's evidence
	// being the cancelled row's.
	if _, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"scheduled-1"}}, By: "carol", Reason: "again"}); err != nil {
		t.Fatal(err)
	}
	h, _ = s.History(ctx, "scheduled-1")
	if len(h) != 2 || h[1].Action != store.ActionRedrive || h[1].PreviousState != "cancelled" || h[1].PreviousAttempts != 1 || h[1].PreviousError != "rejected: no_stream: x" {
		t.Fatalf("history after redrive = %+v", h)
	}
}

// Filters select by state, kind, creation time and count, and never touch
// a row outside the filter.
func TestOpFilters(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at) VALUES
		('a-old',   'a', '{}', 'failed',    clock_timestamp() - interval '3 days'),
		('a-new',   'a', '{}', 'failed',    clock_timestamp() - interval '1 hour'),
		('a-newer', 'a', '{}', 'failed',    clock_timestamp() - interval '1 minute'),
		('b-new',   'b', '{}', 'failed',    clock_timestamp() - interval '1 hour'),
		('a-canc',  'a', '{}', 'cancelled', clock_timestamp() - interval '1 hour'),
		('a-sched', 'a', '{}', 'scheduled', clock_timestamp() - interval '1 hour')`)
	ids := func(res store.OpResult) []string {
		var out []string
		for _, c := range res.Changed {
			out = append(out, c.WorkID)
		}
		return out
	}
	req := func(sel store.Selection) store.OpRequest {
		return store.OpRequest{Selection: sel, By: "op", Reason: "filter test"}
	}

	// Dry run first: the answer, and nothing changed.
	res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{State: "failed", Kind: "a", SinceAgo: 24 * time.Hour}, By: "op", Reason: "dry", DryRun: true})
	if err != nil || !slices.Equal(ids(res), []string{"a-new", "a-newer"}) || !res.DryRun {
		t.Fatalf("dry run: %v %v", ids(res), err)
	}
	if r, _ := readRow(t, pool, "outbox", "a-new"); r.State != "failed" || r.RedrivenAt != nil {
		t.Fatalf("dry run changed a-new: %+v", r)
	}
	if n := historyCount(t, pool, "outbox_redrives"); n != 0 {
		t.Fatalf("dry run wrote %d history rows", n)
	}

	res, err = s.Redrive(ctx, req(store.Selection{State: "failed", Kind: "a", SinceAgo: 24 * time.Hour, Limit: 1}))
	if err != nil || !slices.Equal(ids(res), []string{"a-new"}) {
		t.Fatalf("limit 1: %v %v", ids(res), err)
	}
	var cutoff time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp() - interval '2 days'`).Scan(&cutoff); err != nil {
		t.Fatal(err)
	}
	res, err = s.Redrive(ctx, req(store.Selection{State: "failed", Since: cutoff}))
	if err != nil || !slices.Equal(ids(res), []string{"b-new", "a-newer"}) && !slices.Equal(ids(res), []string{"a-newer", "b-new"}) {
		t.Fatalf("since %v: %v %v", cutoff, ids(res), err)
	}
	res, err = s.Redrive(ctx, req(store.Selection{State: "cancelled", Kind: "a"}))
	if err != nil || !slices.Equal(ids(res), []string{"a-canc"}) {
		t.Fatalf("cancelled: %v %v", ids(res), err)
	}
	res, err = s.Cancel(ctx, req(store.Selection{State: "failed"}))
	if err != nil || !slices.Equal(ids(res), []string{"a-old"}) {
		t.Fatalf("cancel failed: %v %v", ids(res), err)
	}
	want := map[string]string{"a-old": "cancelled", "a-new": "scheduled", "a-newer": "scheduled", "b-new": "scheduled", "a-canc": "scheduled", "a-sched": "scheduled"}
	for id, st := range want {
		if r, _ := readRow(t, pool, "outbox", id); r.State != st {
			t.Errorf("%s is %s, want %s", id, r.State, st)
		}
	}
	if n := historyCount(t, pool, "outbox_redrives"); n != 5 {
		t.Errorf("%d history rows, want 5", n)
	}
	// a-sched never matched a filter: no audit.
	if r, _ := readRow(t, pool, "outbox", "a-sched"); r.RedrivenAt != nil {
		t.Errorf("a-sched audited: %+v", r)
	}
}

func TestOpValidation(t *testing.T) {
	ctx := context.Background()
	s, _ := newPollerStore(t, store.PolicyMark)
	cases := []struct {
		name   string
		action func(context.Context, store.OpRequest) (store.OpResult, error)
		req    store.OpRequest
		want   string
	}{
		{"no reason", s.Redrive, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"x"}}, By: "b", Reason: "  "}, "reason is required"},
		{"ids and filter", s.Redrive, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"x"}, Kind: "k"}, By: "b", Reason: "r"}, "not both"},
		{"filter without state", s.Redrive, store.OpRequest{Selection: store.Selection{Kind: "k"}, By: "b", Reason: "r"}, "needs --state"},
		{"nothing", s.Cancel, store.OpRequest{By: "b", Reason: "r"}, "nothing selected"},
		{"redrive ready", s.Redrive, store.OpRequest{Selection: store.Selection{State: "ready"}, By: "b", Reason: "r"}, "want failed or cancelled or expired"},
		{"cancel running", s.Cancel, store.OpRequest{Selection: store.Selection{State: "running"}, By: "b", Reason: "r"}, "want scheduled or failed"},
	}
	for _, c := range cases {
		_, err := c.action(ctx, c.req)
		if !errors.Is(err, store.ErrBadSelection) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// A redrive that has to wait for another session's lock on its row sees the
// state that session committed, and records that state as the previous one.
func TestRedriveWaitsForLockAndUsesLatestState(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error) VALUES ('w', 'k', '{}', 'failed', 10, 'rejected: a')`)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	// Another operator's cancel, not yet committed.
	if _, err := tx.Exec(ctx, `UPDATE outbox SET state = 'cancelled', last_error = 'rejected: b', attempts = 4 WHERE work_id = 'w'`); err != nil {
		t.Fatal(err)
	}
	done := make(chan store.OpResult, 1)
	errc := make(chan error, 1)
	go func() {
		res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"w"}}, By: "b", Reason: "r"})
		done <- res
		errc <- err
	}()
	testenv.WaitFor(t, 10*time.Second, "the redrive to wait for the row lock", func() (bool, error) {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH c AS%')`).Scan(&waiting)
		return waiting, err
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	res := <-done
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if len(res.Changed) != 1 || res.Changed[0].PreviousState != "cancelled" || res.Changed[0].PreviousAttempts != 4 || res.Changed[0].PreviousError != "rejected: b" {
		t.Fatalf("redrive after wait = %+v, want previous state cancelled, 4 attempts, rejected: b", res)
	}
	if h, _ := s.History(ctx, "w"); len(h) != 1 || h[0].PreviousState != "cancelled" || h[0].PreviousError != "rejected: b" {
		t.Fatalf("history = %+v", h)
	}
}

// A claim that holds the row's lock when a cancel arrives wins: the cancel
// waits, then sees the row running and refuses it; the claim is intact and
// no history row is written.
func TestCancelWaitsForClaimThenRefuses(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('w', 'k', '{}', 'scheduled')`)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	// The poller's claim, as it would run, held open.
	if _, err := tx.Exec(ctx, `UPDATE outbox SET state = 'running', claimed_by = 'A', claim_generation = claim_generation + 1,
		lease_until = clock_timestamp() + interval '1 minute', attempts = attempts + 1 WHERE work_id = 'w'`); err != nil {
		t.Fatal(err)
	}
	type out struct {
		res store.OpResult
		err error
	}
	done := make(chan out, 1)
	go func() {
		res, err := s.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"w"}}, By: "b", Reason: "r"})
		done <- out{res, err}
	}()
	testenv.WaitFor(t, 10*time.Second, "the cancel to wait for the claim's lock", func() (bool, error) {
		var waiting bool
		err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH c AS%')`).Scan(&waiting)
		return waiting, err
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	o := <-done
	if o.err != nil {
		t.Fatal(o.err)
	}
	if len(o.res.Changed) != 0 || len(o.res.Refused) != 1 || o.res.Refused[0].State != "running" {
		t.Fatalf("cancel = %+v, want refused running", o.res)
	}
	r, _ := readRow(t, pool, "outbox", "w")
	if r.State != "running" || r.ClaimedBy == nil || *r.ClaimedBy != "A" || r.Generation != 1 || r.RedrivenAt != nil {
		t.Fatalf("w = %+v, want A's claim intact", r)
	}
	if n := historyCount(t, pool, "outbox_redrives"); n != 0 {
		t.Fatalf("%d history rows for a refused cancel", n)
	}
}

// Claims and a bulk cancel racing over the same rows: every row ends either
// claimed (running, never cancelled, no history) or cancelled (with exactly
// one history row from scheduled), never both, never neither.
func TestCancelRacingClaims(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	const n = 400
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at)
		SELECT 'w' || g, 'k', '{}', 'scheduled', clock_timestamp() - g * interval '1 millisecond' FROM generate_series(1, $1::int) g`, n)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		claimed = map[string]bool{}
		stop    = make(chan struct{})
		claimEr error
	)
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := s.Claim(ctx, fmt.Sprintf("worker-%d", w), time.Hour, 7, store.ClaimOptions{})
				if err != nil {
					mu.Lock()
					claimEr = err
					mu.Unlock()
					return
				}
				mu.Lock()
				for _, x := range c {
					if claimed[x.WorkID] {
						claimEr = fmt.Errorf("%s claimed twice", x.WorkID)
					}
					claimed[x.WorkID] = true
				}
				mu.Unlock()
			}
		}()
	}
	var cancelled []store.OpRow
	for range 5 {
		res, err := s.Cancel(ctx, store.OpRequest{Selection: store.Selection{State: "scheduled", Limit: 50}, By: "b", Reason: "race"})
		if err != nil {
			t.Fatal(err)
		}
		cancelled = append(cancelled, res.Changed...)
	}
	close(stop)
	wg.Wait()
	if claimEr != nil {
		t.Fatal(claimEr)
	}
	res, err := s.Cancel(ctx, store.OpRequest{Selection: store.Selection{State: "scheduled"}, By: "b", Reason: "rest"})
	if err != nil {
		t.Fatal(err)
	}
	cancelled = append(cancelled, res.Changed...)
	gotCancelled := map[string]bool{}
	for _, c := range cancelled {
		if c.PreviousState != "scheduled" || gotCancelled[c.WorkID] {
			t.Fatalf("cancelled %+v (twice: %v)", c, gotCancelled[c.WorkID])
		}
		gotCancelled[c.WorkID] = true
	}
	if len(claimed) == 0 || len(gotCancelled) == 0 {
		t.Logf("no overlap exercised: %d claimed, %d cancelled", len(claimed), len(gotCancelled))
	}
	for i := 1; i <= n; i++ {
		id := fmt.Sprintf("w%d", i)
		r, _ := readRow(t, pool, "outbox", id)
		h, err := s.History(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case claimed[id] && gotCancelled[id]:
			t.Fatalf("%s both claimed and cancelled", id)
		case claimed[id]:
			if r.State != "running" || r.ClaimedBy == nil || r.RedrivenAt != nil || len(h) != 0 {
				t.Fatalf("claimed %s = %+v, history %+v", id, r, h)
			}
		case gotCancelled[id]:
			if r.State != "cancelled" || r.ClaimedBy != nil || r.Attempts != 0 || len(h) != 1 || h[0].Action != store.ActionCancel {
				t.Fatalf("cancelled %s = %+v, history %+v", id, r, h)
			}
		default:
			t.Fatalf("%s neither claimed nor cancelled: %+v", id, r)
		}
	}
	t.Logf("%d claimed, %d cancelled", len(claimed), len(gotCancelled))
}

// The uncertain-outcome evidence a redrive returns: the class, and how long
// after the last attempt (estimated from available_at) the republish is due.
func TestRedriveUncertainAge(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error, available_at) VALUES
		('old', 'k', '{}', 'failed', 'uncertain: timeout', clock_timestamp() - interval '10 minutes'),
		('new', 'k', '{}', 'failed', 'uncertain: timeout', clock_timestamp() - interval '10 seconds'),
		('rej', 'k', '{}', 'failed', 'rejected: max_payload', clock_timestamp() - interval '10 minutes')`)
	res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"old", "new", "rej"}}, By: "b", Reason: "r"})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]store.OpRow{}
	for _, c := range res.Changed {
		got[c.WorkID] = c
	}
	if c := got["old"]; !c.Uncertain() || c.SinceLastAttempt < 10*time.Minute || c.SinceLastAttempt > 11*time.Minute {
		t.Errorf("old = uncertain %v since %v", c.Uncertain(), c.SinceLastAttempt)
	}
	if c := got["new"]; !c.Uncertain() || c.SinceLastAttempt < 10*time.Second || c.SinceLastAttempt > time.Minute {
		t.Errorf("new = uncertain %v since %v", c.Uncertain(), c.SinceLastAttempt)
	}
	if got["rej"].Uncertain() {
		t.Errorf("rejected row counted as uncertain")
	}
}

// Identifiers are quoted everywhere, the history table's name included.
func TestOpsQuotedTable(t *testing.T) {
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	tbl, err := store.ParseTable(`Sales-Ops.Order "Events"`)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, connect(t, url), tbl); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s := store.New(pool, tbl, store.PolicyMark)
	exec(t, pool, `INSERT INTO `+tbl.String()+` (work_id, kind, payload, state, published_at, created_at) VALUES
		('f', 'k', '{}', 'failed', NULL, clock_timestamp()), ('p', 'k', '{}', 'published', clock_timestamp() - interval '1 day', clock_timestamp() - interval '2 days')`)
	if res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"f"}}, By: "b", Reason: "r"}); err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive: %+v, %v", res, err)
	}
	if h, err := s.History(ctx, "f"); err != nil || len(h) != 1 {
		t.Fatalf("history: %+v, %v", h, err)
	}
	if res, err := s.Prune(ctx, store.PruneRequest{OlderThan: time.Hour, Batch: 10}); err != nil || res.Published != 1 {
		t.Fatalf("prune: %+v, %v", res, err)
	}
}

// Prune deletes published rows older than the cutoff, in batches, and
// cancelled ones only when asked; ready, scheduled, running and failed rows
// are never touched however old, nor is a row another session holds locked.
func TestPrune(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, created_at)
		SELECT 'pub-old-' || g, 'k', '{}', 'published', clock_timestamp() - interval '2 days', g, clock_timestamp() - interval '3 days'
		FROM generate_series(1, 25) g`)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, created_at, redriven_at, claimed_by, lease_until) VALUES
		('pub-new',       'k', '{}', 'published', clock_timestamp() - interval '1 hour', clock_timestamp() - interval '3 days', NULL, NULL, NULL),
		('canc-old',      'k', '{}', 'cancelled', NULL, clock_timestamp() - interval '1 hour', clock_timestamp() - interval '2 days', NULL, NULL),
		('canc-old-ins',  'k', '{}', 'cancelled', NULL, clock_timestamp() - interval '2 days', NULL, NULL, NULL),
		('canc-new',      'k', '{}', 'cancelled', NULL, clock_timestamp() - interval '3 days', clock_timestamp() - interval '1 hour', NULL, NULL),
		('ready-old',     'k', '{}', 'ready',     NULL, clock_timestamp() - interval '3 days', NULL, NULL, NULL),
		('sched-old',     'k', '{}', 'scheduled', NULL, clock_timestamp() - interval '3 days', NULL, NULL, NULL),
		('running-old',   'k', '{}', 'running',   NULL, clock_timestamp() - interval '3 days', NULL, 'A', clock_timestamp() + interval '1 hour'),
		-- a failed row that was once published by a stale path: still not prunable
		('failed-old',    'k', '{}', 'failed',    clock_timestamp() - interval '2 days', clock_timestamp() - interval '3 days', NULL, NULL, NULL),
		('pub-locked',    'k', '{}', 'published', clock_timestamp() - interval '2 days', clock_timestamp() - interval '3 days', NULL, NULL, NULL)`)

	dry, err := s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 10, IncludeCancelled: true, DryRun: true})
	if err != nil || dry.Published != 26 || dry.Cancelled != 2 {
		t.Fatalf("dry run: %+v, %v; want 26 published, 2 cancelled", dry, err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox WHERE work_id = 'pub-locked' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	res, err := s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	// The batches walk the 33 rows created before the cutoff in
	// (created_at, work_id) order, 10 at a time (created_idx, G16).
	if res.Published != 25 || res.Cancelled != 0 || res.Batches != 4 {
		t.Fatalf("prune = %+v, want 25 published in 4 batches of 10 rows read", res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	exists := func(id string) bool { _, ok := readRow(t, pool, "outbox", id); return ok }
	for _, id := range []string{"pub-new", "canc-old", "canc-old-ins", "canc-new", "ready-old", "sched-old", "running-old", "failed-old", "pub-locked"} {
		if !exists(id) {
			t.Errorf("%s pruned", id)
		}
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id LIKE 'pub-old-%'`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d old published rows left, err %v", left, err)
	}

	res, err = s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 10, IncludeCancelled: true})
	// One batch of the 8 rows left before the cutoff, one of parked rows.
	if err != nil || res.Published != 1 || res.Cancelled != 2 || res.Batches != 2 {
		t.Fatalf("prune with cancelled = %+v, %v; want pub-locked and 2 cancelled", res, err)
	}
	for id, want := range map[string]bool{"pub-locked": false, "canc-old": false, "canc-old-ins": false, "canc-new": true, "pub-new": true,
		"ready-old": true, "sched-old": true, "running-old": true, "failed-old": true} {
		if exists(id) != want {
			t.Errorf("%s exists = %v, want %v", id, !want, want)
		}
	}
	if _, err := s.Prune(ctx, store.PruneRequest{OlderThan: 0, Batch: 10}); !errors.Is(err, store.ErrBadSelection) {
		t.Errorf("prune --older-than 0: %v", err)
	}
}

// A worker's fail that is not committed yet when a redrive of its row runs:
// the redrive does not wait for it (a running row is not a candidate, so it
// is not locked) and refuses the row as running; the worker's fail then
// commits as if no redrive had been tried.
func TestRedriveOfRowBeingFailed(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('w', 'k', '{}', 'scheduled')`)
	c, err := s.Claim(ctx, "A", time.Minute, 1, store.ClaimOptions{})
	if err != nil || len(c) != 1 {
		t.Fatalf("claim: %v %v", c, err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `UPDATE outbox SET state = 'failed', last_error = 'uncertain: timeout', claimed_by = NULL, lease_until = NULL
		WHERE work_id = 'w' AND claim_generation = $1`, c[0].ClaimGeneration); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	res, err := s.Redrive(rctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"w"}}, By: "b", Reason: "r"})
	if err != nil {
		t.Fatalf("redrive waited for the worker or failed: %v", err)
	}
	if len(res.Changed) != 0 || len(res.Refused) != 1 || res.Refused[0].State != "running" {
		t.Fatalf("redrive = %+v, want refused running", res)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r, _ := readRow(t, pool, "outbox", "w")
	if r.State != "failed" || r.Attempts != 1 || r.RedrivenAt != nil || historyCount(t, pool, "outbox_redrives") != 0 {
		t.Fatalf("w = %s, want failed by the worker, no redrive", r)
	}
}

// Bulk redrives while pollers claim: the redriven rows are claimed as soon
// as they are due, and every row ends consistent: either still scheduled
// (attempts 0, generation 0) or running under exactly one claim (attempts 1,
// generation 1), each with exactly one history row holding its dead-letter
// evidence.
func TestRedriveRacingClaims(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	const n = 300
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, created_at)
		SELECT 'w' || g, 'k', jsonb_build_object('g', g), 'failed', 10, 'rejected: x ' || g, clock_timestamp() - g * interval '1 millisecond'
		FROM generate_series(1, $1::int) g`, n)
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		claimed = map[string]int64{}
		stop    = make(chan struct{})
		bad     error
	)
	for w := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := s.Claim(ctx, fmt.Sprintf("worker-%d", w), time.Hour, 5, store.ClaimOptions{})
				mu.Lock()
				if err != nil {
					bad = err
				}
				for _, x := range c {
					if _, dup := claimed[x.WorkID]; dup || x.Attempts != 1 {
						bad = fmt.Errorf("claim %+v: twice or attempts not reset", x)
					}
					claimed[x.WorkID] = x.ClaimGeneration
				}
				mu.Unlock()
				if err != nil {
					return
				}
			}
		}()
	}
	redriven := map[string]bool{}
	// Claims made before the last redrive batch: the pollers raced the
	// redrives, rather than claiming what was left once they were done.
	claimedMidRace := 0
	for {
		mu.Lock()
		beforeBatch := len(claimed)
		mu.Unlock()
		res, err := s.Redrive(ctx, store.OpRequest{Selection: store.Selection{State: "failed", Limit: 40}, By: "b", Reason: "race"})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.Changed) == 0 {
			break
		}
		claimedMidRace = beforeBatch
		if len(redriven) == 0 {
			// Let the pollers claim from the first batch before the rest
			// come, so that claims and redrives interleave on any host.
			testenv.WaitFor(t, 10*time.Second, "a claim of a redriven row", func() (bool, error) {
				mu.Lock()
				defer mu.Unlock()
				return len(claimed) > 0 || bad != nil, bad
			})
		}
		for _, c := range res.Changed {
			if redriven[c.WorkID] || c.PreviousState != "failed" || c.PreviousAttempts != 10 {
				t.Fatalf("redrive returned %+v (again: %v)", c, redriven[c.WorkID])
			}
			redriven[c.WorkID] = true
		}
	}
	close(stop)
	wg.Wait()
	if bad != nil {
		t.Fatal(bad)
	}
	if len(redriven) != n {
		t.Fatalf("redrove %d rows, want %d", len(redriven), n)
	}
	for i := 1; i <= n; i++ {
		id := fmt.Sprintf("w%d", i)
		r, _ := readRow(t, pool, "outbox", id)
		h, err := s.History(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if len(h) != 1 || h[0].PreviousState != "failed" || h[0].PreviousAttempts != 10 || h[0].PreviousError != fmt.Sprintf("rejected: x %d", i) {
			t.Fatalf("%s history = %+v", id, h)
		}
		if r.Payload != fmt.Sprintf(`{"g": %d}`, i) {
			t.Fatalf("%s payload %s", id, r.Payload)
		}
		if gen, ok := claimed[id]; ok {
			if r.State != "running" || r.Attempts != 1 || r.Generation != 1 || gen != 1 || r.ClaimedBy == nil {
				t.Fatalf("claimed %s = %s", id, r)
			}
		} else if r.State != "scheduled" || r.Attempts != 0 || r.Generation != 0 || r.ClaimedBy != nil {
			t.Fatalf("unclaimed %s = %s", id, r)
		}
	}
	t.Logf("%d redriven, %d of them claimed, %d before the last redrive batch", len(redriven), len(claimed), claimedMidRace)
	if claimedMidRace == 0 {
		t.Fatalf("no row was claimed before the last redrive batch (%d claimed in all): the claims did not race the redrives", len(claimed))
	}
}
