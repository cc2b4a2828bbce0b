package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// startRun runs `outbox-relay run args...` in this process until the
// returned stop is called; stop fails the test unless it stopped cleanly.
func startRun(t *testing.T, args ...string) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var out, errOut testenv.LogBuffer
	done := make(chan error, 1)
	go func() { done <- runRun(ctx, args, &out, &errOut) }()
	stopped := false
	stop = func() {
		if stopped {
			return
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run %s ended with %v\nstderr:\n%s", strings.Join(args, " "), err, errOut.String())
			}
		case <-time.After(30 * time.Second):
			t.Errorf("run %s did not stop within 30s", strings.Join(args, " "))
		}
	}
	t.Cleanup(stop)
	return stop
}

// streamIDs counts the messages of stream by Nats-Msg-Id.
func streamIDs(t *testing.T, js jetstream.JetStream, stream string) map[string]int {
	t.Helper()
	ids := map[string]int{}
	for _, m := range streamMessages(t, js, stream) {
		ids[m.Headers().Get(jetstream.MsgIDHeader)]++
	}
	return ids
}

// The procedure of docs/partitions.md, "Converting a plain table to a
// partitioned one", step by step, while a relay serves the plain table:
// the new partitioned table beside it (its own publication and slot), the
// aggregates' counters carried over, producers switched, the old table
// drained by its relay (a delayed row included, which only the poller
// publishes), then the old relay stopped and its table, slot and
// publication dropped. Every row of both tables is on the stream once, and
// an aggregate's sequence goes on across the switch.
func TestConvertPlainToPartitioned(t *testing.T) {
	env := testenv.Shared(t)
	url, pool := migrated(t)
	ctx := context.Background()
	stream, prefix := env.StreamName(t)
	js := createStream(t, env.NATS.URL(), stream, prefix, 2*time.Minute)
	common := []string{"--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix,
		"--poll-interval", "100ms", "--http-addr", ""}

	// Before: producers write the plain table, a relay serves it.
	stopOld := startRun(t, common...)
	var ids []string
	old, err := outbox.New()
	if err != nil {
		t.Fatal(err)
	}
	enqueue := func(p *outbox.Producer, m outbox.Message) {
		t.Helper()
		if err := p.Enqueue(ctx, pool, m); err != nil {
			t.Fatalf("enqueue %s into %s: %v", m.WorkID, p.Table(), err)
		}
		ids = append(ids, m.WorkID)
	}
	msg := func(id string) outbox.Message {
		return outbox.Message{WorkID: id, Kind: "thing_happened", Payload: json.RawMessage(`{}`)}
	}
	for i := range 20 {
		enqueue(old, msg(fmt.Sprintf("old-%d", i)))
	}
	delayed := msg("old-delayed")
	delayed.AvailableAt = time.Now().Add(3 * time.Second)
	enqueue(old, delayed)
	ordered := msg("old-ordered")
	ordered.Aggregate = outbox.Aggregate{Type: "order", ID: "1"}
	enqueue(old, ordered)

	// 1. The new table, partitioned, with its own publication.
	code, out, _ := run(t, "migrate", "--database-url", url, "--table", "outbox_p", "--publication", "outbox_p_relay", "--partition-interval", "1d")
	if code != 0 || !strings.Contains(out, "public.outbox_p is partitioned by created_at every 24h0m0s") {
		t.Fatalf("migrate the new table: exit %d, %q", code, out)
	}
	// 2. The aggregates' counters carried over (ordering, G12).
	mustExec(t, pool, `INSERT INTO outbox_p_aggregates (aggregate_type, aggregate_id, last_seq)
		SELECT aggregate_type, aggregate_id, last_seq FROM outbox_aggregates`)
	// 3. A relay for the new table, with its own slot.
	stopNew := startRun(t, append(common, "--table", "outbox_p", "--slot", "outbox_p_relay", "--publication", "outbox_p_relay")...)
	// 4. Producers switched.
	next, err := outbox.New(outbox.WithTable("outbox_p"))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		enqueue(next, msg(fmt.Sprintf("new-%d", i)))
	}
	nextOrdered := msg("new-ordered")
	nextOrdered.Aggregate = ordered.Aggregate
	enqueue(next, nextOrdered)
	var seq int64
	if err := pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox_p WHERE work_id = 'new-ordered'`).Scan(&seq); err != nil || seq != 2 {
		t.Errorf("the aggregate's next sequence in the new table: %d (%v), want 2", seq, err)
	}
	// 5. The old table drained: nothing it still owes.
	testenv.WaitFor(t, 60*time.Second, "old table drained", func() (bool, error) {
		var owed int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state IN ('ready', 'scheduled', 'running')`).Scan(&owed); err != nil {
			return false, err
		}
		return owed == 0, fmt.Errorf("%d rows owed", owed)
	})
	// 6. The old relay stopped; its slot, publication and table dropped.
	stopOld()
	mustExec(t, pool, `SELECT pg_drop_replication_slot('outbox_relay')`)
	mustExec(t, pool, `DROP PUBLICATION outbox_relay`)
	mustExec(t, pool, `DROP TABLE outbox, outbox_slots, outbox_settings, outbox_redrives, outbox_aggregates`)
	mustExec(t, pool, `DROP FUNCTION outbox_next_seq(text, text), outbox_give_back_seq(text, text, bigint), outbox_refuse_times(), outbox_park()`)
	mustExec(t, pool, `DELETE FROM outbox_relay_migrations WHERE target = 'public.outbox'`)

	testenv.WaitFor(t, 60*time.Second, "new table published", func() (bool, error) {
		var left int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox_p WHERE state <> 'published'`).Scan(&left); err != nil {
			return false, err
		}
		return left == 0, fmt.Errorf("%d rows not published", left)
	})
	stopNew()
	if code, out, _ := run(t, "status", "--database-url", url, "--table", "outbox_p", "--slot", "outbox_p_relay"); code != 0 ||
		!strings.Contains(out, "partitions 3 by created_at every 24h0m0s") || !strings.Contains(out, "DEFAULT partition: ~0 rows") {
		t.Errorf("status of the new table: exit %d, %q; want its partitions", code, out)
	}
	got := streamIDs(t, js, stream)
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("%s stored %d times, want 1", id, got[id])
		}
	}
	if len(got) != len(ids) {
		t.Errorf("stream holds %d ids, want %d", len(got), len(ids))
	}
	var left bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('outbox') IS NOT NULL OR EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = 'outbox_relay')`).Scan(&left); err != nil || left {
		t.Errorf("the old table or slot is left (%v)", err)
	}
}

// --partition-interval: a bad interval is refused before connecting, an
// existing plain table is refused naming the conversion procedure, and
// prune of a partitioned table prints each old partition, dropped or kept
// and why.
func TestPartitionIntervalFlagAndPrune(t *testing.T) {
	url, pool := migrated(t)
	for _, c := range []struct{ flag, want string }{
		{"4m", "at least 5m0s"},
		{"90m30s", "whole minutes"},
		{"0d", "want 1h, 1d, Nd"},
		{"100000d", "at most 366d"},
		{"9000h", "at most 366d"},
		{"1d", `"Converting a plain table to a partitioned one"`},
	} {
		if code, _, errOut := run(t, "migrate", "--database-url", url, "--partition-interval", c.flag); code == 0 || !strings.Contains(errOut, c.want) {
			t.Errorf("--partition-interval %s on the plain table: exit %d, %q; want refused with %q", c.flag, code, errOut, c.want)
		}
	}

	code, out, _ := run(t, "migrate", "--database-url", url, "--table", "parts", "--publication", "parts_relay", "--partition-interval", "1h")
	if code != 0 || !strings.Contains(out, "public.parts is partitioned by created_at every 1h0m0s, 25 intervals created ahead") {
		t.Fatalf("migrate --partition-interval 1h: exit %d, %q", code, out)
	}
	base := time.Now().UTC().Truncate(time.Hour)
	for i, state := range []string{"published", "scheduled"} {
		start := base.Add(-time.Duration(5-i) * time.Hour)
		mustExec(t, pool, fmt.Sprintf(`CREATE TABLE parts_p%s PARTITION OF parts FOR VALUES FROM ('%s') TO ('%s')`,
			start.Format("2006010215"), start.Format(time.RFC3339), start.Add(time.Hour).Format(time.RFC3339)))
		mustExec(t, pool, fmt.Sprintf(`INSERT INTO parts (work_id, kind, payload, state, created_at, published_at)
			VALUES ('%s', 'k', '{}', '%s', '%s', CASE WHEN '%s' = 'published' THEN '%s'::timestamptz END)`,
			state, state, start.Add(time.Minute).Format(time.RFC3339), state, start.Add(time.Minute).Format(time.RFC3339)))
	}
	if code, _, errOut := run(t, "prune", "--database-url", url, "--table", "parts", "--older-than", "3h", "--lock-timeout", "0s"); code == 0 || !strings.Contains(errOut, "--lock-timeout 0s: want more than 0") {
		t.Errorf("prune --lock-timeout 0s: exit %d, %q; want refused", code, errOut)
	}
	code, out, _ = run(t, "prune", "--database-url", url, "--table", "parts", "--older-than", "3h")
	oldest, owed := "parts_p"+base.Add(-5*time.Hour).Format("2006010215"), "parts_p"+base.Add(-4*time.Hour).Format("2006010215")
	for _, want := range []string{
		"dropped " + oldest + " (ends " + base.Add(-4*time.Hour).Format("2006-01-02 15:04") + "): 1 rows",
		"kept " + owed + " (ends " + base.Add(-3*time.Hour).Format("2006-01-02 15:04") + "): 1 rows still owed (1 scheduled)",
		"dropped 1 partitions of public.parts ending before",
	} {
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("prune: exit %d, %q; want %q", code, out, want)
		}
	}
}
