package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// slotState reads the relay's record of its slot.
func (h *harness) slotState() (pending bool, mode string, rows int64, invalidated int) {
	h.t.Helper()
	var m *string
	var r *int64
	err := h.pool.QueryRow(context.Background(), `SELECT backfill_pending, backfill_mode, backfilled_rows, invalidated_count
		FROM outbox_slots WHERE slot_name = $1`, h.opts.Slot).Scan(&pending, &m, &r, &invalidated)
	if err != nil {
		h.t.Fatalf("read outbox_slots: %v", err)
	}
	if m != nil {
		mode = *m
	}
	if r != nil {
		rows = *r
	}
	return pending, mode, rows, invalidated
}

// paths checks, for every row, that the path that delivered it matches its
// attempts: a CDC publish (Outbox-Commit-LSN header) leaves attempts at 0, a
// poller publish (Outbox-Attempt header) makes it 1. A row both streamed and
// handed over would be claimed by the poller (attempts 1) while the stream
// may hold the CDC copy: that mismatch is what the check catches. It returns
// how many rows each path delivered.
func (h *harness) paths(mustPoller, mustCDC map[string]bool) (cdc, polled int) {
	h.t.Helper()
	byID, _ := h.streamMsgs()
	rows, err := h.pool.Query(context.Background(), `SELECT work_id, attempts FROM outbox`)
	if err != nil {
		h.t.Fatal(err)
	}
	var id string
	var attempts int
	_, err = pgx.ForEachRow(rows, []any{&id, &attempts}, func() error {
		m := byID[id]
		if m == nil {
			h.t.Errorf("%s: not in the stream", id)
			return nil
		}
		viaCDC := m.Header.Get("Outbox-Commit-LSN") != ""
		switch {
		case viaCDC && attempts == 0:
			cdc++
			if mustPoller[id] {
				h.t.Errorf("%s was committed before the slot existed but was streamed", id)
			}
		case !viaCDC && attempts == 1 && m.Header.Get("Outbox-Attempt") == "1":
			polled++
			if mustCDC[id] {
				h.t.Errorf("%s was streamed before and yet handed to the poller", id)
			}
		default:
			h.t.Errorf("%s: attempts %d, stored copy via CDC %v (headers %v): delivered by both paths or retried", id, attempts, viaCDC, m.Header)
		}
		return nil
	})
	if err != nil {
		h.t.Fatal(err)
	}
	return cdc, polled
}

func set(ids ...[]string) map[string]bool {
	m := map[string]bool{}
	for _, l := range ids {
		for _, id := range l {
			m[id] = true
		}
	}
	return m
}

// G9: rows committed while no slot existed (after the slot was dropped, and
// while the relay was stopped before that) are handed to the poller from the
// slot's exported snapshot; rows committed after the slot's consistent point,
// by a producer writing throughout the restart, are streamed. Each row is
// delivered once and by exactly one path.
func TestBackfillWhenSlotCreated(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.start()
	streamed := h.insertRows("streamed", 20, 5)
	h.waitPublished(len(streamed), 20*time.Second)
	h.stop()

	stopped := h.insertRows("stopped", 30, 10)
	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	noSlot := h.insertRows("noslot", 30, 10)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, available_at) VALUES ('noslot-delayed', 'x', '{}', clock_timestamp() + interval '2 seconds')`)

	// The producer writes across the slot's creation: rows before it, which
	// the snapshot hands to the poller, and rows after it, which stream.
	p := startProducer(t, h.dbURL, "live", 1<<30)
	testenv.WaitFor(t, 30*time.Second, "live rows committed before the slot exists", func() (bool, error) { return p.committed() >= 20, nil })
	h.start()
	atStart := p.committed()
	testenv.WaitFor(t, 30*time.Second, "live rows committed after the slot exists", func() (bool, error) { return p.committed() >= atStart+20, nil })
	live := p.finish()

	all := append(append(append(append([]string{}, streamed...), stopped...), noSlot...), live...)
	all = append(all, "noslot-delayed")
	h.waitPublished(len(all), 60*time.Second)
	h.assertExactlyOnce(all)
	before := set(stopped, noSlot, []string{"noslot-delayed"})
	cdc, polled := h.paths(before, set(streamed))
	pending, mode, rows, _ := h.slotState()
	t.Logf("live rows %d; delivered by CDC %d, by the poller %d; backfill %s handed over %d", len(live), cdc, polled, mode, rows)
	if pending || mode != "snapshot" || rows != int64(polled) {
		t.Errorf("slot record: pending %v mode %q rows %d, want false, snapshot, %d (the rows the poller delivered)", pending, mode, rows, polled)
	}
	if polled < len(before) || cdc < len(streamed) {
		t.Errorf("poller delivered %d (want at least the %d rows committed with no slot), CDC %d", polled, len(before), cdc)
	}
	// The race straddled the slot's creation: live rows on both sides of its
	// consistent point, so both paths had some (paths checked that none went
	// both ways).
	livePolled, liveStreamed := polled-len(before), cdc-len(streamed)
	if livePolled <= 0 || liveStreamed <= 0 {
		t.Errorf("of %d live rows, %d went to the poller (committed before the slot) and %d streamed (after): the race did not straddle the slot's creation", len(live), livePolled, liveStreamed)
	}
}

// The crash window of G9: the relay created the slot, then stopped before its
// backfill committed (here the backfill is held on a row lock and the relay
// is shut down; the e2e suite does the same with kill -9). The next session
// finds the slot with the marker still set and hands every ready row over,
// including rows the slot also streams: each is stored once.
func TestBackfillInterruptedHandsOverEveryReadyRow(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	ctx := context.Background()
	// A first run creates the publication, which later needs a lock the
	// test's table lock would block.
	h.start()
	h.stop()
	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	before := h.insertRows("before", 20, 5)

	lock, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx) //nolint:errcheck
	// A table lock takes no transaction ID, so slot creation (which waits
	// for every transaction holding one) is not held up; the backfill's
	// UPDATE is.
	if _, err := lock.Exec(ctx, `LOCK TABLE outbox IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	h.launch()
	testenv.WaitFor(t, 30*time.Second, "backfill blocked after the slot was created", func() (bool, error) {
		var n int
		err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'WITH moved AS%'`).Scan(&n)
		return n == 1, err
	})
	h.stop()
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	after := h.insertRows("after", 10, 5) // committed after the consistent point: the slot streams them
	if pending, _, _, _ := h.slotState(); !pending || h.countState("ready") != len(before)+len(after) {
		t.Fatalf("after the interrupted backfill: pending %v, %d ready rows; want true and %d", pending, h.countState("ready"), len(before)+len(after))
	}

	h.start()
	all := append(append([]string{}, before...), after...)
	h.waitPublished(len(all), 60*time.Second)
	h.assertExactlyOnce(all)
	pending, mode, rows, _ := h.slotState()
	if pending || mode != "all-ready" || rows != int64(len(all)) {
		t.Errorf("slot record: pending %v mode %q rows %d, want false, all-ready, %d", pending, mode, rows, len(all))
	}
}

// An invalidated slot (wal_status lost, after it held more WAL than
// max_slot_wal_keep_size) is reported, dropped, re-created and backfilled:
// the rows committed while it was lost are delivered.
func TestInvalidatedSlotIsRecreated(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{
		"max_slot_wal_keep_size": "1MB",
		"min_wal_size":           "32MB",
		"max_wal_size":           "64MB",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.start()
	first := h.insertRows("first", 10, 5)
	h.waitPublished(len(first), 20*time.Second)
	h.stop()

	lost := h.insertRows("lost", 25, 5)
	h.exec(`CREATE TABLE filler (pad text)`)
	testenv.WaitFor(t, 60*time.Second, "slot invalidated", func() (bool, error) {
		h.exec(`INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 2000)`)
		h.exec(`SELECT pg_switch_wal()`)
		h.exec(`CHECKPOINT`)
		var status string
		err := h.pool.QueryRow(context.Background(), `SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1`, h.opts.Slot).Scan(&status)
		return status == "lost", err
	})
	h.start()
	later := h.insertRows("later", 5, 5)
	all := append(append(append([]string{}, first...), lost...), later...)
	h.waitPublished(len(all), 60*time.Second)
	h.assertExactlyOnce(all)
	_, polled := h.paths(set(lost), set(first, later))
	pending, mode, rows, invalidated := h.slotState()
	if pending || mode != "snapshot" || rows != int64(len(lost)) || polled != len(lost) || invalidated != 1 {
		t.Errorf("slot record: pending %v mode %q rows %d invalidated %d, poller delivered %d; want false, snapshot, %d, 1, %d",
			pending, mode, rows, invalidated, polled, len(lost), len(lost))
	}
}

// PostgreSQL 18 invalidates a slot no one streamed for longer than
// idle_replication_slot_timeout, at a checkpoint (wal_status then says
// lost, as for WAL removed). The relay reads the reason
// (invalidation_reason idle_timeout), says it at warn with the fix,
// re-creates the slot and hands the rows committed while it was away to
// the poller (G9): every row delivered once. Before, it blamed
// max_slot_wal_keep_size at error, a wrong cause and a wrong fix; and a
// slot invalidated for another reason without wal_status lost (16's
// logical slots on a standby) would have been streamed from.
func TestSlotInvalidatedForIdlenessIsRecreated(t *testing.T) {
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Version: 18, Conf: map[string]string{"idle_replication_slot_timeout": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	parallel(t, h) // a server of its own
	logs := &testenv.LogBuffer{}
	h.logs = logs
	h.start()
	first := h.insertRows("first", 10, 5)
	h.waitPublished(len(first), 20*time.Second)
	h.stop()

	away := h.insertRows("away", 25, 5)
	testenv.WaitFor(t, 30*time.Second, "slot invalidated for idleness", func() (bool, error) {
		h.exec(`CHECKPOINT`)
		var reason *string
		err := h.pool.QueryRow(context.Background(), `SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1`, h.opts.Slot).Scan(&reason)
		return reason != nil && *reason == "idle_timeout", err
	})
	h.start()
	later := h.insertRows("later", 5, 5)
	all := append(append(append([]string{}, first...), away...), later...)
	h.waitPublished(len(all), 60*time.Second)
	h.assertExactlyOnce(all)
	_, polled := h.paths(set(away), set(first, later))
	pending, mode, rows, invalidated := h.slotState()
	if pending || mode != "snapshot" || rows != int64(len(away)) || polled != len(away) || invalidated != 1 {
		t.Errorf("slot record: pending %v mode %q rows %d invalidated %d, poller delivered %d; want false, snapshot, %d, 1, %d",
			pending, mode, rows, invalidated, polled, len(away), len(away))
	}
	if !strings.Contains(logs.String(), `"level":"warn"`) || !strings.Contains(logs.String(), `"reason":"idle_timeout"`) ||
		!strings.Contains(logs.String(), "idle_replication_slot_timeout") {
		t.Errorf("the relay did not say at warn that the slot was invalidated for idleness and how to avoid it")
	}
}
