package store_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

func claimedIDs(cs []store.Claimed) []string {
	var ids []string
	for _, c := range cs {
		ids = append(ids, c.WorkID)
	}
	slices.Sort(ids)
	return ids
}

// An ordered claim takes, per aggregate, a run of its lowest blocking rows
// in sequence order (G12, a released aggregate drains at the batch's rate):
// the run stops at the first row it may not take (not due, dead-lettered,
// locked by another transaction), skips nothing, and no second claim takes
// a row of an aggregate while a claim holds rows of it.
func TestOrderedClaimTakesARun(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at, aggregate_type, aggregate_id, aggregate_seq)
		SELECT v.id, 'k', '{}', v.state, clock_timestamp() + v.due * interval '1 hour', 'a', v.agg, v.seq
		FROM (VALUES
			('x1', 'x', 1, 'scheduled', -1), ('x2', 'x', 2, 'scheduled', -1), ('x3', 'x', 3, 'scheduled', -1),
			('x4', 'x', 4, 'scheduled', -1), ('x5', 'x', 5, 'scheduled', -1),
			('y1', 'y', 1, 'published', -1), ('y2', 'y', 2, 'scheduled', -1), ('y3', 'y', 3, 'scheduled', 1),
			('y4', 'y', 4, 'scheduled', -1),
			('z1', 'z', 1, 'failed', -1), ('z2', 'z', 2, 'scheduled', -1),
			('w1', 'w', 1, 'scheduled', -1), ('w2', 'w', 2, 'cancelled', -1), ('w3', 'w', 3, 'scheduled', -1),
			('v1', 'v', 1, 'scheduled', -1), ('v2', 'v', 2, 'scheduled', -1), ('v3', 'v', 3, 'scheduled', -1)
		) AS v(id, agg, seq, state, due)`); err != nil {
		t.Fatal(err)
	}
	// Another transaction holds v2 locked (an operator's statement): the
	// run of v stops before it rather than publish v3 ahead of it.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox WHERE work_id = 'v2' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	ordered := store.ClaimOptions{Ordered: true}
	a, err := s.Claim(ctx, "A", time.Minute, 100, ordered)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimedIDs(a), []string{"v1", "w1", "w3", "x1", "x2", "x3", "x4", "x5", "y2"}; !slices.Equal(got, want) {
		t.Fatalf("ordered claim took %v, want %v", got, want)
	}
	for _, c := range a {
		if c.Attempts != 1 || c.ClaimGeneration != 1 {
			t.Errorf("%s: attempt %d generation %d, want 1 and 1", c.WorkID, c.Attempts, c.ClaimGeneration)
		}
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// v1 is running under A's live lease: v2 and v3 wait behind it, and
	// nothing of x, y (y3 not due) or z (dead letter) is claimable.
	if b, err := s.Claim(ctx, "B", time.Minute, 100, ordered); err != nil || len(b) != 0 {
		t.Fatalf("B claimed %v (err %v) while A holds the aggregates' lowest rows", claimedIDs(b), err)
	}

	// A publishes x1 and x2; x3 fails and is rescheduled; x4 and x5 are
	// given back without an attempt and wait behind x3.
	gen := func(id string) int64 {
		for _, c := range a {
			if c.WorkID == id {
				return c.ClaimGeneration
			}
		}
		t.Fatalf("%s not claimed", id)
		return 0
	}
	if done, err := s.Complete(ctx, []store.Completion{{WorkID: "x1", Generation: gen("x1"), Seq: 1}, {WorkID: "x2", Generation: gen("x2"), Seq: 2}}, "A"); err != nil || len(done) != 2 {
		t.Fatalf("complete: %v, %v", done, err)
	}
	if ok, err := s.Reschedule(ctx, "x3", "A", gen("x3"), 0, "uncertain: timeout"); err != nil || !ok {
		t.Fatalf("reschedule: %v, %v", ok, err)
	}
	// B's claim with a stale generation, and a claim of another worker,
	// give back nothing.
	if got, err := s.Release(ctx, []store.Unclaimed{{WorkID: "x4", Generation: gen("x4")}}, "B", "held"); err != nil || len(got) != 0 {
		t.Fatalf("B released A's claim: %v, %v", got, err)
	}
	got, err := s.Release(ctx, []store.Unclaimed{{WorkID: "x4", Generation: gen("x4")}, {WorkID: "x5", Generation: gen("x5")}}, "A", "held: waiting for x3")
	if err != nil || len(got) != 2 {
		t.Fatalf("release: %v, %v", got, err)
	}
	rows, err := pool.Query(ctx, `SELECT work_id, state, attempts, coalesce(last_error, ''), claimed_by IS NULL AND lease_until IS NULL
		FROM outbox WHERE work_id IN ('x3', 'x4', 'x5') ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		attempts int
		lastErr  string
	}{"x3": {1, "uncertain: timeout"}, "x4": {0, "held: waiting for x3"}, "x5": {0, "held: waiting for x3"}}
	for rows.Next() {
		var id, state, le string
		var attempts int
		var unclaimed bool
		if err := rows.Scan(&id, &state, &attempts, &le, &unclaimed); err != nil {
			t.Fatal(err)
		}
		if w := want[id]; state != "scheduled" || attempts != w.attempts || le != w.lastErr || !unclaimed {
			t.Errorf("%s: %s, %d attempts, %q, unclaimed %v; want scheduled, %d, %q, unclaimed", id, state, attempts, le, unclaimed, w.attempts, w.lastErr)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// The next claim takes x's run again from x3, and v's rest once v1 is
	// published.
	if done, err := s.Complete(ctx, []store.Completion{{WorkID: "v1", Generation: gen("v1"), Seq: 3}}, "A"); err != nil || len(done) != 1 {
		t.Fatalf("complete v1: %v, %v", done, err)
	}
	b, err := s.Claim(ctx, "B", time.Minute, 100, ordered)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimedIDs(b), []string{"v2", "v3", "x3", "x4", "x5"}; !slices.Equal(got, want) {
		t.Fatalf("second claim took %v, want %v", got, want)
	}
	for _, c := range b {
		if want := map[string]int{"x3": 2}[c.WorkID]; c.Attempts != max(want, 1) {
			t.Errorf("%s: attempt %d, want %d (a given-back claim is no attempt)", c.WorkID, c.Attempts, max(want, 1))
		}
	}
}

// The batch bounds a claim with runs: heads first, then the runs' rows in
// sequence order, and what is left out is the top of a run, never a row in
// the middle of one.
func TestOrderedClaimRunsFitTheBatch(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at, aggregate_type, aggregate_id, aggregate_seq)
		SELECT 'x' || g, 'k', '{}', 'scheduled', clock_timestamp() - interval '1 hour' + g * interval '1 second', 'a', 'x', g
		FROM generate_series(1, 10) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, available_at)
		VALUES ('u', 'k', '{}', 'scheduled', clock_timestamp() - interval '2 hours')`); err != nil {
		t.Fatal(err)
	}
	c, err := s.Claim(ctx, "A", time.Minute, 4, store.ClaimOptions{Ordered: true})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := claimedIDs(c), []string{"u", "x1", "x2", "x3"}; !slices.Equal(got, want) {
		t.Fatalf("claimed %v, want %v", got, want)
	}
	c, err = s.Claim(ctx, "A", time.Minute, 1, store.ClaimOptions{Ordered: true})
	if err != nil || len(c) != 0 {
		t.Fatalf("claimed %v (err %v) while x1..x3 are held by a live lease", claimedIDs(c), err)
	}
}
