package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Delayed delivery: a ready row whose available_at is 3 seconds after its
// commit goes to the poller and is not in the stream before it is due.
func TestDelayedRowWaitsForItsTime(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.start()
	h.exec(`INSERT INTO outbox (work_id, kind, payload, available_at) VALUES ('later', 'x', '{}', clock_timestamp() + interval '3 seconds')`)
	h.insertRows("now", 1, 1)
	testenv.WaitFor(t, 20*time.Second, "the immediate row in the stream", func() (bool, error) { return h.streamCount() >= 1, nil })
	var due time.Time
	if err := h.pool.QueryRow(context.Background(), `SELECT available_at FROM outbox WHERE work_id = 'later'`).Scan(&due); err != nil {
		t.Fatal(err)
	}
	for {
		// Count first, then ask the database clock: a count taken while
		// the row is not yet due holds only the immediate row.
		n := h.streamCount()
		var early bool
		if err := h.pool.QueryRow(context.Background(), `SELECT clock_timestamp() < $1`, due).Scan(&early); err != nil {
			t.Fatal(err)
		}
		if !early {
			break
		}
		if n != 1 {
			t.Fatalf("stream holds %d messages before the delayed row is due, want 1", n)
		}
		time.Sleep(100 * time.Millisecond)
	}
	testenv.WaitFor(t, 20*time.Second, "the delayed row published when due", func() (bool, error) {
		var state string
		err := h.pool.QueryRow(context.Background(), `SELECT state FROM outbox WHERE work_id = 'later'`).Scan(&state)
		return state == "published", err
	})
	byID, _ := h.streamMsgs()
	if m := byID["later"]; m == nil || m.Header.Get("Outbox-Attempt") != "1" || m.Header.Get("Outbox-Commit-LSN") != "" {
		t.Errorf("the delayed row was not published by the poller: %+v", m)
	}
	h.assertExactlyOnce([]string{"later", "now-0"})
}

// Poison on the CDC path (G7): a 2 MB payload, an invalid subject and a 5 KB subject between
// normal rows. The normal rows arrive in order, the bad ones end failed with
// a clear reason, and the slot advances past them.
func TestPoisonRowsDoNotBlock(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.MaxAttempts = 2
	h.start()
	a := h.insertRows("a", 5, 1)
	h.exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('huge', 'x', jsonb_build_object('pad', repeat('x', 2 << 20)))`)
	h.exec(`INSERT INTO outbox (work_id, kind, subject, payload) VALUES ('badsubj', 'x', 'has space.in it', '{}')`)
	// Longer than the broker's control line: published, it would close the
	// relay's NATS connection.
	h.exec(`INSERT INTO outbox (work_id, kind, subject, payload) VALUES ('longsubj', 'x', 'long.' || repeat('s', 5000), '{}')`)
	b := h.insertRows("b", 5, 1)
	ids := append(a, b...)
	h.waitPublished(10, 20*time.Second)
	// In commit order in the stream.
	byID, _ := h.streamMsgs()
	for i := 1; i < len(ids); i++ {
		if byID[ids[i-1]].Sequence >= byID[ids[i]].Sequence {
			t.Errorf("%s (seq %d) not before %s (seq %d)", ids[i-1], byID[ids[i-1]].Sequence, ids[i], byID[ids[i]].Sequence)
		}
	}
	ctx := context.Background()
	testenv.WaitFor(t, 60*time.Second, "the poison rows failed", func() (bool, error) {
		return h.countState("failed") == 3, nil
	})
	for id, want := range map[string]string{"huge": "rejected: max_payload", "badsubj": "rejected: invalid_subject", "longsubj": "rejected: invalid_subject"} {
		var lastErr string
		var attempts int
		if err := h.pool.QueryRow(ctx, `SELECT last_error, attempts FROM outbox WHERE work_id = $1`, id).Scan(&lastErr, &attempts); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(lastErr, want) || attempts != 2 {
			t.Errorf("%s: last_error %q attempts %d, want prefix %q and 2 attempts", id, lastErr, attempts, want)
		}
	}
	// The slot confirmed past the last normal row's transaction.
	testenv.WaitFor(t, 10*time.Second, "slot confirmed past the poison", func() (bool, error) {
		var passed bool
		err := h.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn > $1::pg_lsn FROM pg_replication_slots WHERE slot_name = $2`,
			byID[b[len(b)-1]].Header.Get("Outbox-Commit-LSN"), h.opts.Slot).Scan(&passed)
		return passed, err
	})
	h.assertExactlyOnce(ids)
}
