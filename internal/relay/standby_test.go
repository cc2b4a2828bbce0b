package relay_test

import (
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"

	"context"
	"fmt"
	"testing"
	"time"
)

// walSent waits until the relay's walsender has sent it the WAL up to the
// current position: the relay holds everything committed so far, and what it
// does with it is its own decision, not a delay in the server.
func (h *harness) walSent() {
	h.t.Helper()
	var target string
	if err := h.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&target); err != nil {
		h.t.Fatal(err)
	}
	testenv.WaitFor(h.t, 30*time.Second, "the relay sent the WAL up to "+target, func() (bool, error) {
		var sent bool
		err := h.pool.QueryRow(context.Background(), `SELECT coalesce(bool_or(r.sent_lsn >= $1::pg_lsn), false)
			FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $2 AND s.database = current_database()`, target, h.opts.Slot).Scan(&sent)
		return sent, err
	})
}

// releaseLatency advances standby slot to the current WAL position and
// returns how long the relay then took to publish the rows it held, until
// published rows are published: the time in which a relay that did not hold
// them would have published them too.
func (h *harness) releaseLatency(slot string, published int) time.Duration {
	h.t.Helper()
	start := time.Now()
	h.exec(`SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot)
	h.waitPublished(published, 30*time.Second)
	return time.Since(start)
}

// standbyKeepsUp advances the physical slot standing for a standby to the
// server's WAL position every 50 ms until the test ends, as a standby that
// keeps up moves it. Advancing it once, to where a transaction ended, is
// not enough: for a transaction larger than the gate the relay waits for
// the server's flushed position read after it filled the gate, which is
// past the transaction's end whenever anything wrote WAL in between (the
// bgwriter's running-xacts record every 15 s, a checkpoint), and such a
// standby would never reach it (a run of go test -p 3 stalled with 0 of
// 8,000 rows published that way).
func (h *harness) standbyKeepsUp(slot string) {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	h.t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			_, _ = h.pool.Exec(ctx, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot)
			select {
			case <-ctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
}

// gatedFor checks, for window, that the relay publishes nothing beyond the
// published rows it was allowed to.
func (h *harness) gatedFor(window time.Duration, published int) {
	h.t.Helper()
	for deadline := time.Now().Add(window); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if n := h.streamCount(); n != uint64(published) {
			h.t.Fatalf("the stream holds %d messages while the standby is behind, want %d", n, published)
		}
		if n := h.countState("published"); n != published {
			h.t.Fatalf("%d rows published while the standby is behind, want %d", n, published)
		}
	}
}

// G14 without a real standby: a physical slot that nobody advances stands
// for a standby that is behind. Rows committed after its position are not
// published on either path; once the slot moves past them (as a standby's
// feedback moves it), they are. A --standby-slot that names no slot holds
// nothing back.
//
// "Not published" is checked only once the relay holds the rows (its
// walsender sent their WAL, the poller claimed its row), and for several
// times as long as the same relay takes to publish a row once the standby
// flushed it (measured first on a warm-up row): a relay that did not hold
// them would have published them within that window.
func TestStandbySlotHoldsDeliveryBack(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.exec(`SELECT pg_create_physical_replication_slot('standby_a', true)`)
	t.Cleanup(func() {
		_, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot('standby_a')`)
	})
	h.opts.StandbySlots = []string{"standby_a", "gone_after_failover"}
	h.start()
	warm := h.insertRows("warm", 1, 1)
	h.walSent()
	latency := h.releaseLatency("standby_a", 1)
	window := max(5*latency, time.Second)
	t.Logf("a gated row was published %v after the standby flushed it; checking holds for %v", latency.Round(time.Millisecond), window)

	cdc := h.insertRows("cdc", 5, 2)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('poller-1', 'k', '{}', 'scheduled')`)
	h.walSent()
	testenv.WaitFor(t, 30*time.Second, "the poller claimed poller-1", func() (bool, error) {
		var state string
		err := h.pool.QueryRow(context.Background(), `SELECT state FROM outbox WHERE work_id = 'poller-1'`).Scan(&state)
		return state != "scheduled", err // running: claimed and held; anything else fails below
	})
	h.gatedFor(window, 1)
	// The standby catches up.
	h.releaseLatency("standby_a", 7)
	h.assertExactlyOnce(append(append(warm, cdc...), "poller-1"))

	// Rows committed now wait again until the standby flushes them.
	later := h.insertRows("later", 3, 1)
	h.walSent()
	h.gatedFor(window, 7)
	h.releaseLatency("standby_a", 10)
	h.assertExactlyOnce(append(append(append(warm, cdc...), "poller-1"), later...))
	t.Log(fmt.Sprintf("gated %d rows until the standby's slot moved past them", 9))
}

// A fast shutdown of PostgreSQL while a transaction waits for a standby: the
// walsender keeps a shutting-down server open until its client confirms what
// it sent, and the relay cannot read the standby's position any more. The
// relay ends its session instead of waiting, so the shutdown completes at
// once (it used to take the server's 60 s timeout, found by the chaos run's
// failover mode); after the restart the gated rows are delivered once the
// standby catches up.
func TestFastShutdownWhileGatedForStandby(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
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
	// Held once the relay has their WAL; a second is many times what a
	// relay takes to publish five rows it holds (TestStandbySlotHoldsDeliveryBack
	// measures that).
	h.walSent()
	h.gatedFor(time.Second, 0)
	start := time.Now()
	if err := pg.Restart("fast"); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Fatalf("fast restart took %v with a transaction gated for the standby; want the relay to let go at once", took)
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

// G15 with --standby-slot: a transaction larger than the in-flight limits,
// held for a standby that is behind (a physical slot nobody advances),
// waits in the stream, not in the relay's memory: the gate stops reading
// at its bound (4 x --max-in-flight events, one stream batch more at
// most) instead of holding the whole transaction. Once the slot moves
// past it, the whole transaction is published, exactly once.
func TestStandbyGateBoundsLargeTransaction(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.exec(`SELECT pg_create_physical_replication_slot('standby_c', true)`)
	t.Cleanup(func() {
		_, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot('standby_c')`)
	})
	h.opts.StandbySlots = []string{"standby_c"}
	h.opts.MaxInFlight = 4
	h.opts.MaxInFlightBytes = 4 << 10
	h.start()
	const rows = 3000
	ids := h.insertRows("big", rows, rows)
	bound := int64(4*h.opts.MaxInFlight + replication.MaxBatch)
	peak := func() int64 {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.relay.GatePeak()
	}
	testenv.WaitFor(t, 30*time.Second, "the relay read the transaction's first events", func() (bool, error) {
		return peak() > 0, nil
	})
	// A relay that reads without the bound holds all 3,000 rows within a
	// fraction of this window.
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if p := peak(); p > bound {
			t.Fatalf("the gate held %d events of a transaction waiting for the standby, want at most %d (G15)", p, bound)
		}
	}
	h.gatedFor(500*time.Millisecond, 0)
	t.Logf("the gate held at most %d events of a %d-row transaction", peak(), rows)
	h.releaseLatency("standby_c", rows)
	h.assertExactlyOnce(ids)
}
