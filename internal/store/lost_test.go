package store_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// RequeueLost hands back only the rows of the stream past its last
// sequence, published since it was created, and each of them once when
// two instances run it at once (G19).
func TestRequeueLostHandsBackOnlyLostRowsOnce(t *testing.T) {
	ctx := context.Background()
	pool := outboxPool(t)
	// S: seqs 1..100 published now; stream ends at 60, first seq 10.
	// OTHER: seqs 1..100 (another stream). OLD: S seqs 200..210 published
	// before the stream was created (a stream created again).
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name)
		SELECT 's-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S' FROM generate_series(1, 100) g
		UNION ALL SELECT 'o-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'OTHER' FROM generate_series(1, 100) g
		UNION ALL SELECT 'old-' || g, 'k', '{}'::jsonb, 'published', now() - interval '1 hour', g, 'S' FROM generate_series(200, 210) g`)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	created := time.Now().Add(-time.Minute)
	total := handedBackByTwo(t, func() (store.LostRange, error) {
		return st.RequeueLost(ctx, "S", 60, created, time.Time{}, time.Time{})
	})
	if total != 40 {
		t.Errorf("handed back %d rows in all, want 40 (seqs 61..100 of S, once)", total)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'scheduled' AND stream_name = 'S' AND stream_seq BETWEEN 61 AND 100
		AND last_error LIKE 'lost: broker acknowledged seq % in stream S but the stream ends at 60'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 40 {
		t.Errorf("%d rows scheduled with the lost note, want 40", n)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 60+100+11 {
		t.Errorf("%d rows left published, want %d (S up to 60, OTHER, the old stream's)", n, 60+100+11)
	}
}

// RequeueLost with a createdSince reads only the rows created since then
// (the check at a process's start, bounded for G16): a lost row created
// before it stays published; one created after it is handed back.
func TestRequeueLostBoundedByCreatedSince(t *testing.T) {
	ctx := context.Background()
	pool := outboxPool(t)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq, stream_name)
		VALUES ('recent', 'k', '{}'::jsonb, 'published', now(), now(), 11, 'S'),
		       ('early', 'k', '{}'::jsonb, 'published', now() - interval '2 hours', now(), 12, 'S')`)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	r, err := st.RequeueLost(ctx, "S", 10, time.Now().Add(-3*time.Hour), time.Now().Add(-30*time.Minute), time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if r.Rows != 1 || r.From != 11 || r.To != 11 {
		t.Fatalf("handed back %+v, want the row at seq 11 only", r)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'early'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "published" {
		t.Errorf("the row created before the bound is %s, want published", state)
	}
}

// A session start's check reads the database's clock before the stream's
// state and hands back only the rows recorded published before it: a row
// its own poller published (and recorded) after the state was read sits
// past the end read without being lost. Seen in CI (relay
// TestInvalidatedSlotIsRecreated): the 25 rows a recreated slot handed the
// poller were published while the check ran, and reported lost.
func TestRequeueLostLeavesRowsRecordedAfterTheStateWasRead(t *testing.T) {
	ctx := context.Background()
	pool := outboxPool(t)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name)
		VALUES ('lost', 'k', '{}'::jsonb, 'published', clock_timestamp(), 11, 'S')`)
	bound, err := st.Clock(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Acknowledged after the state was read (at seq 12), recorded after the bound.
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name)
		VALUES ('acked-after', 'k', '{}'::jsonb, 'published', clock_timestamp(), 12, 'S')`)
	r, err := st.RequeueLost(ctx, "S", 10, time.Now().Add(-time.Hour), time.Time{}, bound)
	if err != nil {
		t.Fatal(err)
	}
	if r.Rows != 1 || len(r.IDs) != 1 || r.IDs[0] != "lost" {
		t.Fatalf("handed back %+v, want the row recorded before the bound only", r)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'acked-after'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "published" {
		t.Errorf("the row recorded after the bound is %s, want published", state)
	}
}

// republish's record (RecordRepublished) and the relay's hand-back of lost
// rows (RequeueLost) on the same rows, in both orders, each statement
// waiting on the rows' locks behind the other: the second sees the first's
// row and its guard decides. Whichever goes first, every row ends either
// pointing at the republished message (published, the new sequence) or
// handed back to the poller with its lost: note (which the poller looks up
// in the stream before it publishes: poller TestPollerLooksUpRowsHandedBackAsLost),
// never published and pointing at the sequence the broker lost.
func TestRecordRepublishedAgainstRequeueLost(t *testing.T) {
	for _, requeueFirst := range []bool{true, false} {
		name := "record first"
		if requeueFirst {
			name = "requeue first"
		}
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			pool := outboxPool(t)
			// Rows published at seqs 51..60 of S; the broker lost them (its
			// stream ends at 50) and republish stored them again at 51..60,
			// after the relay read the stream's end.
			exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name)
				SELECT 'r-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S' FROM generate_series(51, 60) g`)
			st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
			var items []store.Republished
			for g := 51; g <= 60; g++ {
				items = append(items, store.Republished{WorkID: fmt.Sprintf("r-%d", g), LostSeq: uint64(g), Stream: "S", Seq: uint64(g + 100)})
			}
			lock, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer lock.Rollback(ctx)
			if _, err := lock.Exec(ctx, `SELECT 1 FROM outbox FOR UPDATE`); err != nil {
				t.Fatal(err)
			}
			var requeued store.LostRange
			var recorded []string
			var wg sync.WaitGroup
			requeue := func() {
				defer wg.Done()
				var err error
				if requeued, err = st.RequeueLost(ctx, "S", 50, time.Now().Add(-time.Hour), time.Time{}, time.Time{}); err != nil {
					t.Error(err)
				}
			}
			record := func() {
				defer wg.Done()
				var err error
				if recorded, err = st.RecordRepublished(ctx, items); err != nil {
					t.Error(err)
				}
			}
			first, second := record, requeue
			if requeueFirst {
				first, second = requeue, record
			}
			waiting := func(n int) {
				testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("%d statements waiting on the rows' locks", n), func() (bool, error) {
					var w int
					err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&w)
					return w == n, err
				})
			}
			wg.Add(2)
			go first()
			waiting(1)
			go second()
			waiting(2)
			if err := lock.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			wg.Wait()

			var pointed, handedBack, bad int
			rows, err := pool.Query(ctx, `SELECT state, stream_seq, coalesce(last_error, '') FROM outbox`)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var state, note string
				var seq int64
				if err := rows.Scan(&state, &seq, &note); err != nil {
					t.Fatal(err)
				}
				switch {
				case state == "published" && seq > 100 && strings.HasPrefix(note, "republished: "):
					pointed++
				case state == "scheduled" && store.ClassLost.Of(note):
					handedBack++
				default:
					bad++
					t.Errorf("row in state %s at seq %d, note %q", state, seq, note)
				}
			}
			if rows.Err() != nil {
				t.Fatal(rows.Err())
			}
			t.Logf("requeued %d, recorded %d: %d point at the republished message, %d handed back", requeued.Rows, len(recorded), pointed, handedBack)
			if requeueFirst && (handedBack != 10 || len(recorded) != 0) {
				t.Errorf("requeue first: %d handed back, %d recorded; want 10 and 0 (the record's guard sees the rows scheduled)", handedBack, len(recorded))
			}
			if !requeueFirst && (len(recorded) != 10 || requeued.Rows != 10 || handedBack != 10) {
				// The relay read the stream's end (50) before the republish:
				// the new sequences are past it, so it hands them back, and
				// the poller's lookup finds them.
				t.Errorf("record first: %d recorded, %d requeued, %d handed back; want 10 each", len(recorded), requeued.Rows, handedBack)
			}
			if bad != 0 || pointed+handedBack != 10 {
				t.Errorf("%d rows in no safe state", bad)
			}
		})
	}
}

// outboxPool is a pool on a fresh database with the outbox migrated.
func outboxPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), testenv.Shared(t).PG.CreateOutboxDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// The rows recorded where a stream lost its tail and took new messages
// since: TopRecorded names the highest sequence with two rows and the rows
// at the highest one; RecordedBetween reads a range; RequeueLostRows hands
// back each row given only while it is still recorded published at the
// sequence given, each once when two callers run at once (a row republished
// meanwhile points elsewhere and stays).
func TestRequeueLostRowsOnlyWhereStillRecorded(t *testing.T) {
	ctx := context.Background()
	pool := outboxPool(t)
	// S: lost-51..60 at seqs 51..60, new-51..55 stored since at 51..55 and
	// recorded, kept-1..50 below; moved-58 was republished at 70 meanwhile.
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name, lookup_seq)
		SELECT 'kept-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S', NULL FROM generate_series(1, 50) g
		UNION ALL SELECT 'lost-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S', 90 FROM generate_series(51, 60) g
		UNION ALL SELECT 'new-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S', NULL FROM generate_series(51, 55) g
		UNION ALL SELECT 'old-1', 'k', '{}'::jsonb, 'published', now() - interval '1 hour', 55, 'S', NULL`)
	exec(t, pool, `UPDATE outbox SET stream_seq = 70 WHERE work_id = 'lost-58'`)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	created := time.Now().Add(-time.Minute)
	top, twice, err := st.TopRecorded(ctx, "S", 0, 60, created, time.Time{})
	if err != nil {
		t.Fatal(err)
	}
	if twice != 55 || len(top) != 1 || top[0] != (store.Recorded{WorkID: "lost-60", Seq: 60}) {
		t.Errorf("TopRecorded: %v, twice %d; want lost-60 at 60 and 55 (old-1 is of the stream's earlier life)", top, twice)
	}
	rows, err := st.RecordedBetween(ctx, "S", 50, 60, created, time.Time{}, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(rows) != 14 || rows[0].Seq != 60 {
		t.Errorf("RecordedBetween(50, 60]: %d rows from %v, want 14 (lost-51..60 but 58, new-51..55), the highest first", len(rows), rows[:min(len(rows), 1)])
	}
	var lost []store.Recorded
	for g := 51; g <= 60; g++ {
		lost = append(lost, store.Recorded{WorkID: fmt.Sprintf("lost-%d", g), Seq: uint64(g)})
	}
	total := handedBackByTwo(t, func() (store.LostRange, error) { return st.RequeueLostRows(ctx, "S", lost, 50) })
	if total != 9 {
		t.Errorf("handed back %d rows in all, want 9 (lost-51..60 but lost-58, once)", total)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'scheduled' AND work_id LIKE 'lost-%' AND lookup_seq = 50
		AND last_error LIKE 'lost: broker acknowledged seq % in stream S but holds another message there now'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 9 {
		t.Errorf("%d rows scheduled with the note and looked up from 50, want 9", n)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 50+5+1+1 {
		t.Errorf("%d rows left published, want %d (kept, new, old-1, lost-58)", n, 50+5+1+1)
	}
}

// handedBackByTwo runs hand twice at once, as two instances checking at the
// same moment, and returns how many rows the two handed back in all.
func handedBackByTwo(t *testing.T, hand func() (store.LostRange, error)) int {
	t.Helper()
	var mu sync.Mutex
	total := 0
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := hand()
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			total += r.Rows
			mu.Unlock()
		}()
	}
	wg.Wait()
	return total
}
