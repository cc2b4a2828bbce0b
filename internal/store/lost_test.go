package store_test

import (
	"context"
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
	pool, err := pgxpool.New(ctx, testenv.Shared(t).PG.CreateOutboxDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	// S: seqs 1..100 published now; stream ends at 60, first seq 10.
	// OTHER: seqs 1..100 (another stream). OLD: S seqs 200..210 published
	// before the stream was created (a stream created again).
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, stream_name)
		SELECT 's-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'S' FROM generate_series(1, 100) g
		UNION ALL SELECT 'o-' || g, 'k', '{}'::jsonb, 'published', now(), g, 'OTHER' FROM generate_series(1, 100) g
		UNION ALL SELECT 'old-' || g, 'k', '{}'::jsonb, 'published', now() - interval '1 hour', g, 'S' FROM generate_series(200, 210) g`)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	created := time.Now().Add(-time.Minute)
	var mu sync.Mutex
	total := 0
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r, err := st.RequeueLost(ctx, "S", 60, created, time.Time{})
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
	pool, err := pgxpool.New(ctx, testenv.Shared(t).PG.CreateOutboxDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq, stream_name)
		VALUES ('recent', 'k', '{}'::jsonb, 'published', now(), now(), 11, 'S'),
		       ('early', 'k', '{}'::jsonb, 'published', now() - interval '2 hours', now(), 12, 'S')`)
	st := store.New(pool, testenv.OutboxTable, store.PolicyMark)
	r, err := st.RequeueLost(ctx, "S", 10, time.Now().Add(-3*time.Hour), time.Now().Add(-30*time.Minute))
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
