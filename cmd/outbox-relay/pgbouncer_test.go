package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Every command through PgBouncer in transaction mode (Debian's 1.18: no
// prepared statements there, no replication), the slot's session direct:
// two migrates at once, rows committed before the slot existed (the
// poller's), rows committed under load while run streams (the CDC path's),
// dead-lettered rows redriven and published again, status, and prune. The
// producers write through the pooler too. Every row is in the stream once.
// With the statements prepared as before, the first command fails on a
// prepared statement the pooler lent to another client ("already exists",
// "does not exist"); with migrate's session lock, its lock stays on a server
// connection the relay then uses.
func TestThroughPgBouncerTransactionMode(t *testing.T) {
	t.Parallel() // a database, pooler and stream of its own
	env := testenv.Shared(t)
	ctx := context.Background()
	direct := env.PG.CreateDatabase(t)
	u, err := url.Parse(direct)
	if err != nil {
		t.Fatal(err)
	}
	bouncer := testenv.StartPgBouncer(t, env.PG)
	pooled := bouncer.URL(strings.TrimPrefix(u.Path, "/"))
	stream, prefix := env.StreamName(t)
	common := []string{"--database-url", pooled, "--database-pooler", "transaction", "--nats-url", env.NATS.URL(),
		"--stream", stream, "--subject-prefix", prefix}

	var wg sync.WaitGroup
	codes := make([]int, 2)
	for i := range codes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			codes[i], _, _ = run(t, append([]string{"migrate"}, common...)...)
		}()
	}
	wg.Wait()
	if codes[0] != 0 || codes[1] != 0 {
		t.Fatalf("two migrates at once through the pooler exited %v, want 0 and 0", codes)
	}
	// No lock stays behind on a server connection the pooler lends to the
	// next client (a session lock taken through it is released, if ever,
	// on whichever connection the unlock happens to reach). In this
	// database only: the parallel tests beside it migrate theirs.
	admin, err := pgxpool.New(ctx, direct)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(admin.Close)
	var held int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
		WHERE l.locktype = 'advisory' AND d.datname = current_database()`).Scan(&held); err != nil || held != 0 {
		t.Fatalf("%d advisory locks held after the migrates (%v), want none", held, err)
	}
	// The producers' pool: through the pooler, unprepared, as an
	// application behind PgBouncer 1.18 must be.
	producers, err := pgxpool.New(ctx, pooled+"&default_query_exec_mode=exec")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(producers.Close)
	var versions, dupVersions int
	if err := producers.QueryRow(ctx, `SELECT count(*), count(*) - count(DISTINCT version) FROM outbox_relay_migrations WHERE target = 'public.outbox'`).Scan(&versions, &dupVersions); err != nil || versions < 19 || dupVersions != 0 {
		t.Fatalf("migrations recorded %d (%d twice), %v: want every one once", versions, dupVersions, err)
	}
	insert := func(sql string) {
		t.Helper()
		if _, err := producers.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	insert(`INSERT INTO outbox (work_id, kind, payload) SELECT 'early-' || i, 'k', '{}' FROM generate_series(1, 200) i`)
	insert(`INSERT INTO outbox (work_id, kind, payload, state, last_error) SELECT 'dead-' || i, 'k', '{}', 'failed', 'rejected: test' FROM generate_series(1, 20) i`)

	const underLoad = 1500
	runArgs := append([]string{"run", "--replication-database-url", direct, "--slot", "pooled_slot"}, common...)
	logs := runOne(t, runArgs, func() {
		var load sync.WaitGroup
		for w := range 3 {
			load.Add(1)
			go func() {
				defer load.Done()
				for i := w; i < underLoad; {
					n := 1 + rand.IntN(5)
					tx, err := producers.Begin(ctx)
					if err != nil {
						t.Error(err)
						return
					}
					for j := 0; j < n && i < underLoad; j++ {
						if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'k', '{"n": 1}')`, fmt.Sprintf("load-%d", i)); err != nil {
							t.Error(err)
							_ = tx.Rollback(ctx)
							return
						}
						i += 3
					}
					if err := tx.Commit(ctx); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		if code, out, _ := run(t, append([]string{"redrive", "--state", "failed", "--reason", "through the pooler"}, common...)...); code != 0 || !strings.Contains(out, "20") {
			t.Errorf("redrive through the pooler exited %d, stdout %q; want the 20 dead-lettered rows redriven", code, out)
		}
		if code, out, _ := run(t, append([]string{"status"}, common...)...); code != 0 || !strings.Contains(out, stream) {
			t.Errorf("status through the pooler exited %d, stdout %q", code, out)
		}
		load.Wait()
		testenv.WaitFor(t, 90*time.Second, "every row published", func() (bool, error) {
			var n int
			err := producers.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == 200+20+underLoad, err
		})
	})

	// A clean stop on PostgreSQL 15 creates a temporary slot: made through
	// the pooler, it would live on with the server connection, holding WAL.
	var temporary int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_replication_slots WHERE temporary`).Scan(&temporary); err != nil || temporary != 0 {
		t.Errorf("%d temporary slots left after the stop (%v), want none", temporary, err)
	}

	ids := streamIDs(t, connect(t, env.NATS.URL()), stream)
	want := map[string]bool{}
	for i := 1; i <= 200; i++ {
		want[fmt.Sprintf("early-%d", i)] = true
	}
	for i := 1; i <= 20; i++ {
		want[fmt.Sprintf("dead-%d", i)] = true
	}
	for i := range underLoad {
		want[fmt.Sprintf("load-%d", i)] = true
	}
	for id := range want {
		if ids[id] != 1 {
			t.Errorf("%s is in the stream %d times, want once", id, ids[id])
		}
	}
	if len(ids) != len(want) {
		t.Errorf("the stream holds %d work IDs, want %d", len(ids), len(want))
	}
	if strings.Contains(logs, `"level":"error"`) {
		t.Errorf("run logged an error through the pooler:\n%s", logs)
	}

	time.Sleep(1100 * time.Millisecond)
	if code, out, _ := run(t, append([]string{"prune", "--older-than", "1s"}, common...)...); code != 0 || !strings.Contains(out, fmt.Sprintf("pruned %d published rows", len(want))) {
		t.Errorf("prune through the pooler exited %d, stdout %q; want every published row pruned", code, out)
	}
}
