package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// A table partitioned by created_at (migrate --partition-interval) is
// streamed through its root (publish_via_partition_root): rows committed
// into two partitions (the current one, and one made ahead: created_at two
// hours on) all reach the stream once and are marked, and the slot is
// confirmed past them. The poller path publishes a delayed row from a
// partition too. The running relay makes the partitions ahead.
func TestPartitionedTableStreams(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	s := sharedSetup(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatalf("migrate --partition-interval 1h: %v", err)
	}
	// The furthest partition ahead is gone: the relay's keeper (started by
	// internal/app's run) makes it again.
	var furthest string
	if err := conn.QueryRow(ctx, `SELECT max(c.relname::text) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'outbox'::regclass AND c.relname <> 'outbox_default'`).Scan(&furthest); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `DROP TABLE `+furthest); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, s)
	var viaRoot bool
	h.start()
	testenv.WaitFor(t, 20*time.Second, "the relay to make "+furthest+" again", func() (bool, error) {
		var back bool
		err := h.pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = to_regclass($1) AND inhparent = 'outbox'::regclass)`, furthest).Scan(&back)
		return back, err
	})
	if err := h.pool.QueryRow(ctx, `SELECT pubviaroot FROM pg_publication WHERE pubname = $1`, h.opts.Publication).Scan(&viaRoot); err != nil || !viaRoot {
		t.Fatalf("publication %s: publish_via_partition_root = %v (%v), want true", h.opts.Publication, viaRoot, err)
	}

	ids := h.insertRows("part", 200, 50)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, available_at) VALUES ('part-delayed', 'thing_happened', '{}', clock_timestamp() + interval '1 second')`)
	ids = append(ids, "part-delayed")
	h.exec(`INSERT INTO outbox (work_id, kind, payload, created_at)
		SELECT 'part-ahead-' || i, 'thing_happened', '{}', clock_timestamp() + interval '2 hours' FROM generate_series(1, 50) i`)
	for i := 1; i <= 50; i++ {
		ids = append(ids, fmt.Sprintf("part-ahead-%d", i))
	}
	h.waitPublished(len(ids), 30*time.Second)
	var parts int
	if err := h.pool.QueryRow(ctx, `SELECT count(DISTINCT tableoid) FROM outbox`).Scan(&parts); err != nil {
		t.Fatal(err)
	}
	if parts != 2 {
		t.Fatalf("rows in %d partitions, want 2", parts)
	}
	h.assertExactlyOnce(ids)
	// Every settle found its row through the root: no row is left ready
	// in any partition.
	if n := h.countState("ready"); n != 0 {
		t.Fatalf("%d rows still ready after publishing", n)
	}
	end := ""
	if err := h.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "slot confirmed past the rows", func() (bool, error) {
		var ok bool
		err := h.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`, h.opts.Slot, end).Scan(&ok)
		return ok, err
	})
	lsn, lag := h.slotConfirmed()
	t.Logf("%d rows published from a partitioned table; slot confirmed at %s (%d bytes behind)", len(ids), lsn, lag)
}

// A producer's transaction open across an old partition's end commits
// while prune's detach of that partition waits for it; the relay streams
// its rows, which the CDC path hands off (a delayed row, a rejected one),
// and settles them while the prune holds the partition detached (the test
// holds it there until the slot confirms past the transaction, or 3 s).
// No settle may count as done against a partition out of the table: the
// rows end with the poller (the delayed one published and in the stream,
// the rejected one scheduled with an attempt), never 'ready' behind the
// confirmed position.
func TestPruneRacingSettle(t *testing.T) {
	s := sharedSetup(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	base := time.Now().UTC().Truncate(time.Hour).Add(-5 * time.Hour)
	part := "outbox_p" + base.Format("2006010215")
	if _, err := conn.Exec(ctx, fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox FOR VALUES FROM ('%s') TO ('%s')`,
		part, base.Format(time.RFC3339), base.Add(time.Hour).Format(time.RFC3339))); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, s)
	h.start()

	producer, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Rollback(ctx) //nolint:errcheck
	at := base.Add(30 * time.Minute)
	if _, err := producer.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, created_at, available_at)
		VALUES ('race-delayed', 'thing_happened', '{}', $1, clock_timestamp() + interval '1 second')`, at); err != nil {
		t.Fatal(err)
	}
	if _, err := producer.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload, created_at)
		VALUES ('race-rejected', 'x', 'has space.in it', '{}', $1)`, at); err != nil {
		t.Fatal(err)
	}
	st := store.New(h.pool, tbl, store.PolicyMark)
	st.SetPruneHook(func(stage, _ string) {
		if stage != store.PruneDetached {
			return
		}
		// The detach waited for the producer: its commit is before here.
		var end string
		if err := h.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
			return
		}
		deadline := time.Now().Add(3 * time.Second)
		for time.Now().Before(deadline) {
			var past bool
			if err := h.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
				h.opts.Slot, end).Scan(&past); err == nil && past {
				return
			}
			time.Sleep(20 * time.Millisecond) // polling the slot with a bound, inside the prune's step
		}
	})
	pruned := make(chan error, 1)
	var res store.PruneResult
	go func() {
		var err error
		res, err = st.Prune(ctx, store.PruneRequest{OlderThan: time.Since(base.Add(time.Hour)) - time.Second, Batch: 10, LockTimeout: 10 * time.Second})
		pruned <- err
	}()
	testenv.WaitFor(t, 10*time.Second, "prune's detach waiting for the producer", func() (bool, error) {
		var n int
		err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, 'DETACH PARTITION') > 0`).Scan(&n)
		return n > 0, err
	})
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-pruned; err != nil {
		t.Fatal(err)
	}
	for _, v := range res.Partitions {
		t.Logf("prune: %s kept %q", v.Name, v.Kept)
	}
	testenv.WaitFor(t, 20*time.Second, "the handed-off rows with the poller", func() (bool, error) {
		var delayed, rejected string
		var attempts int
		if err := h.pool.QueryRow(ctx, `SELECT (SELECT state FROM outbox WHERE work_id = 'race-delayed'),
			(SELECT state FROM outbox WHERE work_id = 'race-rejected'), (SELECT attempts FROM outbox WHERE work_id = 'race-rejected')`).
			Scan(&delayed, &rejected, &attempts); err != nil {
			return false, err
		}
		return delayed == "published" && rejected != "ready" && attempts >= 1,
			fmt.Errorf("race-delayed %s, race-rejected %s with %d attempts", delayed, rejected, attempts)
	})
	if _, counts := h.streamMsgs(); counts["race-delayed"] != 1 {
		t.Errorf("race-delayed stored %d times in the stream, want 1", counts["race-delayed"])
	}
}
