package e2e

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// TestKill9BetweenSlotCreationAndBackfill is G9's crash window with a real
// kill -9: the relay has created the slot (its exported snapshot is the only
// exact record of which rows the slot will never stream) and dies before the
// backfill commits. The restarted relay finds the slot with the marker still
// set, hands every ready row to the poller, and every row (committed before
// the slot, and after it while the relay was dead) is stored exactly once.
func TestKill9BetweenSlotCreationAndBackfill(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot, publication := uniqueName("e2e_backfill"), "outbox_relay"
	migrate(t, dbURL, publication) // creates the publication, which the table lock below would block
	conn := connectPG(t, dbURL)
	js := connectNATS(t, env.NATS.URL())
	ctx := context.Background()

	insert := func(prefix string, n int) []string {
		var ids []string
		for i := 0; i < n; i += 50 {
			rows := make([]outRow, 0, 50)
			for j := i; j < min(n, i+50); j++ {
				rows = append(rows, outRow{id: fmt.Sprintf("%s-%d", prefix, j), kind: "order", n: j, pad: "p"})
				ids = append(ids, rows[len(rows)-1].id)
			}
			tx, err := conn.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := insertRows(ctx, tx, rows); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return ids
	}
	before := insert("before", 300)

	// A SHARE lock holds the backfill's UPDATE but, taking no transaction
	// ID, does not hold up slot creation.
	lockConn := connectPG(t, dbURL)
	lock, err := lockConn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, `LOCK TABLE outbox IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, runArgs(dbURL, env.NATS.URL(), stream, prefix, slot, publication, "--poll-interval", "100ms")...)
	r.start()
	testenv.WaitFor(t, 60*time.Second, "the relay's backfill waiting on the lock after creating the slot", func() (bool, error) {
		r.requireRunning()
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE 'WITH moved AS%'`).Scan(&n)
		return n == 1, err
	})
	r.kill()
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	st, err := readSlot(ctx, conn, slot)
	if err != nil {
		t.Fatal(err)
	}
	var pending bool
	if err := conn.QueryRow(ctx, `SELECT backfill_pending FROM outbox_slots WHERE slot_name = $1`, slot).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if !st.exists || !pending {
		t.Fatalf("after kill -9: slot exists %v, backfill pending %v; want both (the crash window)", st.exists, pending)
	}
	after := insert("after", 200) // the slot streams these; the fallback hands them over too

	r.start()
	total := len(before) + len(after)
	testenv.WaitFor(t, 90*time.Second, fmt.Sprintf("%d rows published", total), func() (bool, error) {
		r.requireRunning()
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
		return n == total, err
	})
	msgs := readStream(t, js, stream)
	counts := map[string]int{}
	for _, m := range msgs {
		counts[m.header.Get(jetstream.MsgIDHeader)]++
	}
	lost, dups := 0, 0
	for _, id := range append(append([]string{}, before...), after...) {
		switch c := counts[id]; {
		case c == 0:
			lost++
		case c > 1:
			dups += c - 1
		}
	}
	var mode string
	var handed int64
	if err := conn.QueryRow(ctx, `SELECT backfill_pending, backfill_mode, backfilled_rows FROM outbox_slots WHERE slot_name = $1`, slot).
		Scan(&pending, &mode, &handed); err != nil {
		t.Fatal(err)
	}
	t.Logf("figures: rows=%d stream_msgs=%d lost=%d stored_duplicates=%d backfill=%s handed_over=%d", total, len(msgs), lost, dups, mode, handed)
	if lost != 0 || dups != 0 || len(msgs) != total {
		t.Errorf("lost %d, stored duplicates %d, stream holds %d of %d", lost, dups, len(msgs), total)
	}
	if pending || mode != "all-ready" || handed != int64(total) {
		t.Errorf("slot record: pending %v mode %q handed %d, want false, all-ready, %d", pending, mode, handed, total)
	}
}
