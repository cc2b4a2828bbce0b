package store_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func newPollerStore(t *testing.T, policy store.Policy) (*store.Store, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return store.New(pool, tbl, policy), pool
}

// The article's scenario: worker A's lease expires, worker B reclaims the
// row with a newer generation, and every statement A still tries matches
// zero rows; B's completion is the one that counts.
func TestClaimGuardsAgainstExpiredWorker(t *testing.T) {
	ctx := context.Background()
	for _, policy := range []store.Policy{store.PolicyMark, store.PolicyDelete} {
		t.Run(string(policy), func(t *testing.T) {
			s, pool := newPollerStore(t, policy)
			if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, headers, state)
				VALUES ('w1', 'order.created', '{"a": 1}', '{"traceparent": "x"}', 'scheduled'),
				       ('later', 'k', '{}', NULL, 'scheduled')`); err != nil {
				t.Fatal(err)
			}
			// Not due yet: never claimed.
			if _, err := pool.Exec(ctx, `UPDATE outbox SET available_at = clock_timestamp() + interval '1 hour' WHERE work_id = 'later'`); err != nil {
				t.Fatal(err)
			}

			a, err := s.Claim(ctx, "A", 200*time.Millisecond, 10, store.ClaimOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(a) != 1 || a[0].WorkID != "w1" || a[0].Attempts != 1 || a[0].ClaimGeneration != 1 || a[0].Reclaimed {
				t.Fatalf("A claimed %+v, want w1 attempt 1 generation 1", a)
			}
			if string(a[0].Payload) != `{"a": 1}` || !strings.Contains(string(a[0].Headers), "traceparent") || a[0].Kind != "order.created" {
				t.Fatalf("A's row = %+v", a[0])
			}
			// Held by a live lease: B gets nothing.
			if b, err := s.Claim(ctx, "B", time.Minute, 10, store.ClaimOptions{}); err != nil || len(b) != 0 {
				t.Fatalf("B claimed %+v (err %v) while A's lease is live", b, err)
			}
			testenv.WaitFor(t, 10*time.Second, "A's lease to expire on the database clock", func() (bool, error) {
				var expired bool
				err := pool.QueryRow(ctx, `SELECT lease_until < clock_timestamp() FROM outbox WHERE work_id = 'w1'`).Scan(&expired)
				return expired, err
			})
			b, err := s.Claim(ctx, "B", time.Minute, 10, store.ClaimOptions{})
			if err != nil {
				t.Fatal(err)
			}
			if len(b) != 1 || b[0].WorkID != "w1" || b[0].Attempts != 2 || b[0].ClaimGeneration != 2 || !b[0].Reclaimed {
				t.Fatalf("B claimed %+v, want w1 attempt 2 generation 2, reclaimed", b)
			}

			// A (expired, superseded) can do nothing, with its own generation
			// or, as a worker ID check, with B's.
			for _, gen := range []int64{1, 2} {
				done, err := s.Complete(ctx, []store.Completion{{WorkID: "w1", Generation: gen, Seq: 11}}, "A")
				if err != nil || len(done) != 0 {
					t.Fatalf("A complete gen %d: %v, %v; want nothing", gen, done, err)
				}
				if ok, err := s.Renew(ctx, "w1", "A", gen, time.Hour); err != nil || ok {
					t.Fatalf("A renew gen %d: %v, %v", gen, ok, err)
				}
				if ok, err := s.Reschedule(ctx, "w1", "A", gen, time.Hour, "uncertain: A"); err != nil || ok {
					t.Fatalf("A reschedule gen %d: %v, %v", gen, ok, err)
				}
				if ok, err := s.Fail(ctx, "w1", "A", gen, "rejected: A"); err != nil || ok {
					t.Fatalf("A fail gen %d: %v, %v", gen, ok, err)
				}
			}
			// B with a stale generation cannot either.
			if ok, err := s.Fail(ctx, "w1", "B", 1, "x"); err != nil || ok {
				t.Fatalf("B fail with generation 1: %v, %v", ok, err)
			}
			if ok, err := s.Renew(ctx, "w1", "B", 2, time.Minute); err != nil || !ok {
				t.Fatalf("B renew: %v, %v", ok, err)
			}
			done, err := s.Complete(ctx, []store.Completion{{WorkID: "w1", Generation: 2, Seq: 42}, {WorkID: "later", Generation: 0, Seq: 43}}, "B")
			if err != nil || len(done) != 1 || done[0] != "w1" {
				t.Fatalf("B complete: %v, %v; want [w1]", done, err)
			}
			// Done is done: a second completion matches nothing.
			if done, err := s.Complete(ctx, []store.Completion{{WorkID: "w1", Generation: 2, Seq: 44}}, "B"); err != nil || len(done) != 0 {
				t.Fatalf("B second complete: %v, %v", done, err)
			}

			var n int
			if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = 'w1'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if policy == store.PolicyDelete {
				if n != 0 {
					t.Fatalf("delete policy kept w1")
				}
				return
			}
			var state string
			var seq, gen int64
			var attempts int
			var claimedBy *string
			var lease, published *time.Time
			var lastErr *string
			if err := pool.QueryRow(ctx, `SELECT state, stream_seq, claim_generation, attempts, claimed_by, lease_until, published_at, last_error
				FROM outbox WHERE work_id = 'w1'`).Scan(&state, &seq, &gen, &attempts, &claimedBy, &lease, &published, &lastErr); err != nil {
				t.Fatal(err)
			}
			if state != "published" || seq != 42 || gen != 2 || attempts != 2 || claimedBy != nil || lease != nil || published == nil || lastErr != nil {
				t.Fatalf("w1 = %s seq %d gen %d attempts %d claimed_by %v lease %v published %v last_error %v; want published by B with seq 42",
					state, seq, gen, attempts, claimedBy, lease, published, lastErr)
			}
		})
	}
}

// Reschedule and Fail by the live holder move the row and clear the claim;
// a rescheduled row is claimable again only once due.
func TestRescheduleAndFail(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('r', 'k', '{}', 'scheduled')`); err != nil {
		t.Fatal(err)
	}
	c, err := s.Claim(ctx, "A", time.Minute, 10, store.ClaimOptions{})
	if err != nil || len(c) != 1 {
		t.Fatalf("claim: %v, %v", c, err)
	}
	if ok, err := s.Reschedule(ctx, "r", "A", c[0].ClaimGeneration, time.Hour, "rejected: no_stream: x"); err != nil || !ok {
		t.Fatalf("reschedule: %v, %v", ok, err)
	}
	if again, err := s.Claim(ctx, "A", time.Minute, 10, store.ClaimOptions{}); err != nil || len(again) != 0 {
		t.Fatalf("claimed a row rescheduled an hour ahead: %v, %v", again, err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox SET available_at = clock_timestamp() WHERE work_id = 'r'`); err != nil {
		t.Fatal(err)
	}
	c, err = s.Claim(ctx, "A", time.Minute, 10, store.ClaimOptions{})
	if err != nil || len(c) != 1 || c[0].Attempts != 2 || c[0].ClaimGeneration != 2 || c[0].LastError != "rejected: no_stream: x" || c[0].Reclaimed {
		t.Fatalf("second claim: %+v, %v", c, err)
	}
	if ok, err := s.Fail(ctx, "r", "A", 2, "rejected: no_stream: y"); err != nil || !ok {
		t.Fatalf("fail: %v, %v", ok, err)
	}
	var state, lastErr string
	var claimed bool
	if err := pool.QueryRow(ctx, `SELECT state, last_error, claimed_by IS NOT NULL OR lease_until IS NOT NULL FROM outbox WHERE work_id = 'r'`).
		Scan(&state, &lastErr, &claimed); err != nil {
		t.Fatal(err)
	}
	if state != "failed" || lastErr != "rejected: no_stream: y" || claimed {
		t.Fatalf("r = %s %q claimed %v", state, lastErr, claimed)
	}
}

// seqScanOnOutbox finds a scan of the outbox table itself in a text plan,
// not of its companions (outbox_slots, read for the watermark).
var seqScanOnOutbox = regexp.MustCompile(`Seq Scan on outbox\b`)

// The claim must be served by the partial poll index, not a scan of a
// table full of published rows.
func TestClaimUsesPollIndex(t *testing.T) {
	ctx := context.Background()
	_, pool := newPollerStore(t, store.PolicyMark)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq)
		SELECT 'p' || g, 'k', '{}', 'published', clock_timestamp(), g FROM generate_series(1, 20000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
		SELECT 's' || g, 'k', '{}', 'scheduled' FROM generate_series(1, 5) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	plan := store.ExplainClaim(ctx, t, pool, store.Table{Schema: "public", Name: "outbox"}, 100)
	if !strings.Contains(plan, "outbox_poll_idx") || seqScanOnOutbox.MatchString(plan) {
		t.Fatalf("claim plan does not use outbox_poll_idx:\n%s", plan)
	}
	t.Logf("claim plan:\n%s", plan)
}

// A claim changes no indexed column, so with room on the page (fillfactor,
// migration 0007) each claimed version stays on its row's page as a HOT
// update: no new index entry. A claim takes consecutive rows, which share
// pages; at fillfactor 70 most of them moved to other pages.
func TestClaimStaysOnThePage(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
		SELECT 'row-' || g, 'bench.created', jsonb_build_object('n', g, 'pad', repeat('x', 180)), 'scheduled'
		FROM generate_series(1, 300) g`); err != nil {
		t.Fatal(err)
	}
	pages := func() map[string]string {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT work_id, split_part(trim(both '()' from ctid::text), ',', 1) FROM outbox`)
		if err != nil {
			t.Fatal(err)
		}
		m := map[string]string{}
		for rows.Next() {
			var id, page string
			if err := rows.Scan(&id, &page); err != nil {
				t.Fatal(err)
			}
			m[id] = page
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := pages()
	claimed, err := s.Claim(ctx, "w", time.Minute, 300, store.ClaimOptions{})
	if err != nil || len(claimed) != 300 {
		t.Fatalf("claimed %d rows, err %v; want 300", len(claimed), err)
	}
	after := pages()
	moved := 0
	for id, p := range before {
		if after[id] != p {
			moved++
		}
	}
	// A page's free space at fillfactor 50 holds its rows' claimed versions
	// with a row or so to spare, depending on the rows' size (xact_id,
	// migration 0013, added 8 bytes to each and tipped one of 300 over
	// here); at fillfactor 70 most of them move.
	if moved > 3 {
		t.Fatalf("%d of 300 claimed rows moved to another page (a new entry in every index); want at most 3", moved)
	}
}
