package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Issue 30 item 2: a watermark from another cluster covers nothing here.
// A relay under --on-publish none publishes rows on the shared cluster and
// records a watermark; its <table>_slots is copied (as pg_dump | psql does)
// into a fresh cluster, whose transaction ids and WAL positions are lower.
// 500 rows committed there before its relay starts, and 20 after, all reach
// the stream; the copied watermark is ignored, said so at start, and this
// cluster's own watermarks are recorded.
func TestNoneWatermarkFromAnotherCluster(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	src := newHarness(t, setup{dbURL: env.PG.CreateDatabase(t), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	src.opts.Policy = store.PolicyNone
	src.start()
	first := src.insertRows("src", 50, 10)
	src.waitPublished(len(first), 30*time.Second)
	src.stop()

	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.opts.Policy = store.PolicyNone
	logs := &testenv.LogBuffer{}
	h.logs = logs
	ctx := context.Background()
	var slot, snap, lsn string
	var at time.Time
	if err := src.pool.QueryRow(ctx, `SELECT slot_name, watermark_snapshot::text, watermark_lsn::text, watermark_at FROM outbox_slots
		WHERE watermark_lsn IS NOT NULL`).Scan(&slot, &snap, &lsn, &at); err != nil {
		t.Fatalf("read the source's watermark: %v", err)
	}
	// The copy holds exactly what pg_dump writes of the table's rows.
	var cols string
	if err := src.pool.QueryRow(ctx, `SELECT string_agg(quote_ident(attname), ', ' ORDER BY attnum) FROM pg_attribute
		WHERE attrelid = 'outbox_slots'::regclass AND attnum > 0 AND NOT attisdropped`).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	var values string
	if err := src.pool.QueryRow(ctx, `SELECT string_agg(format('(%s)', (SELECT string_agg(coalesce(quote_literal(v.value), 'NULL'), ', ')
		FROM json_each_text(row_to_json(s)) v)), ', ') FROM outbox_slots s`).Scan(&values); err != nil {
		t.Fatal(err)
	}
	h.exec(`INSERT INTO outbox_slots (` + cols + `) VALUES ` + values)
	var ahead bool
	if err := h.pool.QueryRow(ctx, `SELECT pg_snapshot_xmax($1::pg_snapshot) > pg_current_xact_id() AND $2::pg_lsn > pg_current_wal_lsn()`, snap, lsn).Scan(&ahead); err != nil || !ahead {
		t.Fatalf("the copied watermark (%s at %s) is not ahead of the fresh cluster (%v): the test proves nothing", snap, lsn, err)
	}

	before := h.insertRows("dst-before", 500, 50)
	h.start()
	after := h.insertRows("dst-after", 20, 1)
	all := append(append(append([]string{}, first...), before...), after...)
	testenv.WaitFor(t, 60*time.Second, "every row of both clusters in the stream", func() (bool, error) {
		n := h.streamCount()
		return n == uint64(len(all)), fmt.Errorf("stream holds %d of %d", n, len(all))
	})
	h.assertExactlyOnce(all)
	testenv.WaitFor(t, 30*time.Second, "a watermark of this cluster recorded", func() (bool, error) {
		var mine bool
		err := h.pool.QueryRow(ctx, `SELECT coalesce(bool_or(watermark_lsn <= pg_current_wal_lsn()), false) FROM outbox_slots`).Scan(&mine)
		return mine, err
	})
	if !strings.Contains(logs.String(), "ignoring the watermark") {
		t.Errorf("no log line said the copied watermark is ignored:\n%s", logs.String())
	}
}

// Issue 30 item 3: a slot the relay did not create is not trusted. The
// slot is dropped and re-created by hand while rows commit, then advanced
// by hand past rows committed while the relay was stopped: each time the
// relay replaces it with a slot of its own and hands the rows the hand-made
// slot would skip to the poller (G9), saying why. Under --on-publish none
// no skipped row is counted published, and every row reaches the stream.
func TestSlotNotCreatedByRelayIsReplaced(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.Policy = store.PolicyNone
	logs := &testenv.LogBuffer{}
	h.logs = logs
	h.start()
	first := h.insertRows("first", 20, 5)
	h.waitPublished(len(first), 30*time.Second)
	h.stop()

	gap := h.insertRows("gap", 30, 5)
	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	h.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, h.opts.Slot)
	h.start()
	recreated := h.insertRows("recreated", 10, 5)
	all := append(append(append([]string{}, first...), gap...), recreated...)
	testenv.WaitFor(t, 30*time.Second, "every row in the stream after the slot was re-created by hand", func() (bool, error) {
		n := h.streamCount()
		return n == uint64(len(all)), fmt.Errorf("stream holds %d of %d", n, len(all))
	})
	h.waitPublished(len(all), 30*time.Second)
	h.stop()

	skipped := h.insertBulk("skipped", 200, 20)
	h.exec(`SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, h.opts.Slot)
	h.start()
	later := h.insertRows("later", 5, 1)
	all = append(append(all, skipped...), later...)
	testenv.WaitFor(t, 30*time.Second, "every row in the stream after the slot was advanced by hand", func() (bool, error) {
		n := h.streamCount()
		return n == uint64(len(all)), fmt.Errorf("stream holds %d of %d (published by the watermark or the poller: %d)", n, len(all), h.countState("published"))
	})
	h.waitPublished(len(all), 30*time.Second)
	h.assertExactlyOnce(all)
	for _, want := range []string{"was not created by this relay", "re-created by hand", "advanced"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("no log line says %q", want)
		}
	}
}
