package relay_test

import (
	"github.com/outbox-relay/outbox-relay/internal/testenv"

	"context"
	"fmt"
	"testing"
	"time"
)

// G14 without a real standby: a physical slot that nobody advances stands
// for a standby that is behind. Rows committed after its position are not
// published on either path; once the slot moves past them (as a standby's
// feedback moves it), they are. A --standby-slot that names no slot holds
// nothing back.
func TestStandbySlotHoldsDeliveryBack(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.exec(`SELECT pg_create_physical_replication_slot('standby_a', true)`)
	t.Cleanup(func() {
		_, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot('standby_a')`)
	})
	h.opts.StandbySlots = []string{"standby_a", "gone_after_failover"}
	h.start()
	cdc := h.insertRows("cdc", 5, 2)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('poller-1', 'k', '{}', 'scheduled')`)
	time.Sleep(3 * time.Second)
	if n := h.streamCount(); n != 0 {
		t.Fatalf("the stream holds %d messages while the standby has flushed none of their commits", n)
	}
	if n := h.countState("published"); n != 0 {
		t.Fatalf("%d rows published while the standby is behind", n)
	}
	// The standby catches up.
	h.exec(`SELECT pg_replication_slot_advance('standby_a', pg_current_wal_lsn())`)
	h.waitPublished(6, 30*time.Second)
	h.assertExactlyOnce(append(cdc, "poller-1"))

	// Rows committed now wait again until the standby flushes them.
	later := h.insertRows("later", 3, 1)
	time.Sleep(time.Second)
	if n := h.countState("published"); n != 6 {
		t.Fatalf("%d published, want the 6 earlier rows only", n)
	}
	h.exec(`SELECT pg_replication_slot_advance('standby_a', pg_current_wal_lsn())`)
	h.waitPublished(9, 30*time.Second)
	h.assertExactlyOnce(append(append(cdc, "poller-1"), later...))
	t.Log(fmt.Sprintf("held %d rows until the standby's slot moved past them", 9))
}

// A fast shutdown of PostgreSQL while a transaction waits for a standby: the
// walsender keeps a shutting-down server open until its client confirms what
// it sent, and the relay cannot read the standby's position any more. The
// relay ends its session instead of waiting, so the shutdown completes at
// once (it used to take the server's 60 s timeout, found by the chaos run's
// failover mode); after the restart the held rows are delivered once the
// standby catches up.
func TestFastShutdownWhileHeldForStandby(t *testing.T) {
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.exec(`SELECT pg_create_physical_replication_slot('standby_b', true)`)
	h.opts.StandbySlots = []string{"standby_b"}
	h.start()
	ids := h.insertRows("held", 5, 1)
	time.Sleep(500 * time.Millisecond)
	if n := h.countState("published"); n != 0 {
		t.Fatalf("%d rows published while the standby is behind", n)
	}
	start := time.Now()
	if err := pg.Restart("fast"); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("fast restart took %v with a transaction held for the standby; want the relay to let go at once", took)
	} else {
		t.Logf("fast restart took %v", took.Round(10*time.Millisecond))
	}
	h.pool.Reset()
	testenv.WaitFor(t, 30*time.Second, "the standby's slot advanced", func() (bool, error) {
		_, err := h.pool.Exec(context.Background(), `SELECT pg_replication_slot_advance('standby_b', pg_current_wal_lsn())`)
		return err == nil, err
	})
	h.waitPublished(5, 30*time.Second)
	h.assertExactlyOnce(ids)
}
