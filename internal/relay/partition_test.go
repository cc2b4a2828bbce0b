package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	s := sharedSetup(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, s.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := store.MigrateWith(ctx, conn, tbl, store.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
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
