package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// newPartitionedDB creates a database whose public.outbox is partitioned by
// the hour, with a partition for the hour three hours ago, and returns a
// pool on it and that partition's name.
func newPartitionedDB(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := schema.MigrateWith(ctx, conn, table.Table{Schema: "public", Name: "outbox"}, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatalf("migrate --partition-interval 1h: %v", err)
	}
	start := time.Now().UTC().Add(-3 * time.Hour).Truncate(time.Hour)
	old := "outbox_p" + start.Format("2006010215")
	if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox FOR VALUES FROM ('%s') TO ('%s')`,
		old, start.Format(time.RFC3339), start.Add(time.Hour).Format(time.RFC3339))); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool, old
}

func rowsOf(t *testing.T, pool *pgxpool.Pool, workID string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE work_id = $1`, workID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// On a partitioned table no index makes work_id unique, yet a repeat is
// found in any partition: a row enqueued three hours ago (in that hour's
// partition) makes Enqueue of the same intention ErrAlreadyEnqueued and of
// a different one ErrConflict, in a batch too, and an ordered repeat takes
// no sequence number. A raw INSERT of the repeat is not refused (what the
// SQL-only path loses, docs/consumers.md); Enqueue still compares with the
// first row.
func TestEnqueuePartitionedRepeats(t *testing.T) {
	t.Parallel()
	pool, old := newPartitionedDB(t)
	ctx := context.Background()
	m := order(1)
	if err := outbox.Enqueue(ctx, pool, m); err != nil {
		t.Fatal(err)
	}
	// Three hours ago: into the old partition.
	if _, err := pool.Exec(ctx, `UPDATE outbox SET created_at = created_at - interval '3 hours' WHERE work_id = $1`, m.WorkID); err != nil {
		t.Fatal(err)
	}
	var in string
	if err := pool.QueryRow(ctx, `SELECT tableoid::regclass::text FROM outbox WHERE work_id = $1`, m.WorkID).Scan(&in); err != nil || in != old {
		t.Fatalf("row in %s (%v), want %s", in, err, old)
	}
	if err := outbox.Enqueue(ctx, pool, m); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Errorf("repeat: %v, want ErrAlreadyEnqueued", err)
	}
	changed := m
	changed.Payload = json.RawMessage(`{"order_id": 1, "total": "0.00"}`)
	if err := outbox.Enqueue(ctx, pool, changed); !errors.Is(err, outbox.ErrConflict) {
		t.Errorf("changed repeat: %v, want ErrConflict", err)
	}
	res, err := outbox.EnqueueBatch(ctx, pool, []outbox.Message{order(2), m, order(3)})
	if err != nil || fmt.Sprint(res) != fmt.Sprint([]outbox.Result{outbox.Inserted, outbox.AlreadyEnqueued, outbox.Inserted}) {
		t.Errorf("batch: %v, %v", res, err)
	}
	if res, err := outbox.EnqueueBatch(ctx, pool, []outbox.Message{order(3), changed}); !errors.Is(err, outbox.ErrConflict) || res[0] != outbox.AlreadyEnqueued {
		t.Errorf("batch with a conflict: %v, %v", res, err)
	}
	for _, id := range []string{m.WorkID, order(2).WorkID, order(3).WorkID} {
		if n := rowsOf(t, pool, id); n != 1 {
			t.Errorf("%d rows of %s, want 1", n, id)
		}
	}

	// A large batch: each row holds an advisory lock until the commit
	// (docs/consumers.md says what that costs).
	big := make([]outbox.Message, 1000)
	for i := range big {
		big[i] = order(10000 + i)
	}
	if res, err := outbox.EnqueueBatch(ctx, pool, big); err != nil || len(res) != len(big) || res[999] != outbox.Inserted {
		t.Fatalf("batch of 1000: %v", err)
	}

	// Ordered: the repeat takes no number.
	a := outbox.Aggregate{Type: "order", ID: "7"}
	o1 := order(70)
	o1.Aggregate = a
	if err := outbox.Enqueue(ctx, pool, o1); err != nil {
		t.Fatal(err)
	}
	if err := outbox.Enqueue(ctx, pool, o1); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Errorf("ordered repeat: %v, want ErrAlreadyEnqueued", err)
	}
	o2 := order(71)
	o2.Aggregate = a
	if err := outbox.Enqueue(ctx, pool, o2); err != nil {
		t.Fatal(err)
	}
	var seq int64
	if err := pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox WHERE work_id = $1`, o2.WorkID).Scan(&seq); err != nil || seq != 2 {
		t.Errorf("sequence after an ordered repeat: %d (%v), want 2", seq, err)
	}

	// The SQL-only path: nothing refuses a raw repeat.
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, $2, $3)`, m.WorkID, m.Kind, string(m.Payload)); err != nil {
		t.Fatalf("raw repeat: %v", err)
	}
	if n := rowsOf(t, pool, m.WorkID); n != 2 {
		t.Errorf("%d rows of %s after a raw repeat, want 2 (nothing refuses it)", n, m.WorkID)
	}
	if err := outbox.Enqueue(ctx, pool, m); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Errorf("repeat after a raw repeat: %v, want ErrAlreadyEnqueued", err)
	}
}

// Two transactions enqueueing one work_id at once on a partitioned table:
// the second waits for the first and then sees what it did. Committed, the
// second gets ErrAlreadyEnqueued and one row exists; rolled back, the
// second inserts. Under REPEATABLE READ the second, whose snapshot cannot
// see the first's row, fails with a serialization failure instead of
// inserting a second row.
func TestEnqueuePartitionedConcurrentRepeats(t *testing.T) {
	t.Parallel()
	pool, _ := newPartitionedDB(t)
	ctx := context.Background()
	for _, c := range []struct {
		name   string
		commit bool
		iso    pgx.TxIsoLevel
	}{
		{"commit", true, pgx.ReadCommitted},
		{"rollback", false, pgx.ReadCommitted},
		{"repeatable read", true, pgx.RepeatableRead},
	} {
		m := order(100)
		m.WorkID = "concurrent-" + c.name
		first, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		// A failed case must not leave a transaction open: the pool's
		// Close would wait for it.
		defer first.Rollback(ctx) //nolint:errcheck
		if err := outbox.Enqueue(ctx, first, m); err != nil {
			t.Fatal(err)
		}
		second, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: c.iso})
		if err != nil {
			t.Fatal(err)
		}
		defer second.Rollback(ctx) //nolint:errcheck
		// A first statement: under REPEATABLE READ it takes the snapshot.
		if _, err := second.Exec(ctx, `SELECT 1`); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- outbox.Enqueue(ctx, second, m) }()
		select {
		case err := <-done:
			t.Errorf("%s: the second enqueue returned %v while the first was open; want it to wait", c.name, err)
			return
		case <-time.After(500 * time.Millisecond):
		}
		if c.commit {
			err = first.Commit(ctx)
		} else {
			err = first.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		err = <-done
		var pgErr *pgconn.PgError
		switch {
		case c.iso == pgx.RepeatableRead:
			if !errors.As(err, &pgErr) || pgErr.Code != "40001" {
				t.Errorf("%s: second enqueue: %v, want a serialization failure", c.name, err)
			}
		case c.commit && !errors.Is(err, outbox.ErrAlreadyEnqueued):
			t.Errorf("%s: second enqueue: %v, want ErrAlreadyEnqueued", c.name, err)
		case !c.commit && err != nil:
			t.Errorf("%s: second enqueue: %v, want inserted", c.name, err)
		}
		if err == nil || errors.Is(err, outbox.ErrAlreadyEnqueued) {
			if err := second.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		} else {
			_ = second.Rollback(ctx)
		}
		if n := rowsOf(t, pool, m.WorkID); n != 1 {
			t.Errorf("%s: %d rows of %s, want 1", c.name, n, m.WorkID)
		}
	}
}
