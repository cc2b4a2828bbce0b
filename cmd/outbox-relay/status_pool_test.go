package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// status runs on the observer pool (app.OpenObserverPool): a statement that
// waits, here behind a lock an application holds on the outbox table, is cut
// off after app.ObserverStatementTimeout with the reason, rather than
// holding its connection (and the operator's terminal) until the lock goes.
func TestStatusHasAStatementTimeout(t *testing.T) {
	url, pool := migrated(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	type result struct {
		code   int
		stderr string
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		code, _, stderr := run(t, "status", "--database-url", url)
		done <- result{code, stderr}
	}()
	select {
	case r := <-done:
		if r.code == 0 || !strings.Contains(r.stderr, "statement timeout") {
			t.Fatalf("status behind a lock exited %d after %s: %s; want a statement timeout", r.code, time.Since(start), r.stderr)
		}
		t.Logf("status gave up after %s", time.Since(start).Round(time.Millisecond))
	case <-time.After(30 * time.Second):
		tx.Rollback(ctx) //nolint:errcheck // let it finish
		<-done
		t.Fatal("status still waited for the lock after 30 s: no statement timeout")
	}
}
