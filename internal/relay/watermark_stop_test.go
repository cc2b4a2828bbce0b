package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G17 at a clean stop (issue 30, item 5): the watermark covers every row
// acked before the stop returns. 4,000 rows are drained and the relay is
// stopped as soon as the stream holds them all: not one may count as
// unpublished. Then the slot is lost and the relay restarts after the
// stream's 1 s duplicate window has passed: the new slot's backfill hands
// over nothing, and nothing is stored again.
func TestNoneCleanStopCoversEveryAckedRow(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.Policy = store.PolicyNone
	h.opts.DuplicateWindow = time.Second
	h.start()
	ids := h.insertBulk("drained", 3900, 100)
	ids = append(ids, h.insertRows("drained-single", 100, 1)...)
	testenv.WaitFor(t, 60*time.Second, "every row in the stream", func() (bool, error) {
		n := h.streamCount()
		return n == uint64(len(ids)), fmt.Errorf("stream holds %d of %d", n, len(ids))
	})
	h.stop()
	stopped := time.Now()
	if ready, published := h.countState("ready"), h.countState("published"); ready != 0 || published != len(ids) {
		t.Errorf("after the clean stop: %d rows uncovered (ready), %d published; want 0 and %d", ready, published, len(ids))
	}

	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	// Not a wait for a condition: the broker's duplicate window must have
	// passed, so that a repeat would be stored, not dropped.
	time.Sleep(time.Until(stopped.Add(1500 * time.Millisecond)))
	h.start()
	ids = append(ids, h.insertRows("after", 1, 1)...)
	h.waitPublished(len(ids), 60*time.Second)
	pending, mode, rows, _ := h.slotState()
	if pending || mode != "snapshot" || rows != 0 {
		t.Errorf("new slot's backfill: pending %v, mode %q, %d rows handed over; want false, snapshot, 0", pending, mode, rows)
	}
	if n := h.streamCount(); n != uint64(len(ids)) {
		t.Errorf("stream holds %d messages, want %d: %d rows published again after the slot loss", n, len(ids), int(n)-len(ids))
	}
	h.assertExactlyOnce(ids)
}

// G17 when the outbox goes quiet (issue 30, item 5): rows acked just
// before the traffic stops are covered within seconds, with nothing more
// written. Here the last row's commit waits for a synchronous standby that
// does not exist, so it is streamed and acked while invisible; the recorder
// records two watermarks that cannot cover it. Once the commit is let go,
// the watermark covers it within a few seconds, although no row is acked
// any more.
func TestNoneQuietOutboxCoversLastAcked(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{
		"synchronous_standby_names": "ghost",
		// Everyone but the test's producer commits without waiting.
		"synchronous_commit": "local",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.opts.Policy = store.PolicyNone
	// The default: the server learns the relay's position only from its
	// status updates, and no keepalive may be waited for.
	h.opts.StatusInterval = relay.DefaultStatusInterval
	h.start()

	// Plain quiet first: a drained burst is covered within a few seconds.
	warm := h.insertBulk("warm", 500, 50)
	testenv.WaitFor(t, 30*time.Second, "the burst in the stream", func() (bool, error) {
		return h.streamCount() == uint64(len(warm)), nil
	})
	acked := time.Now()
	testenv.WaitFor(t, 3*time.Second, "the burst covered while the outbox is quiet", func() (bool, error) {
		n := h.countState("published")
		return n == len(warm), fmt.Errorf("%d of %d covered", n, len(warm))
	})
	t.Logf("the burst was covered %v after its last ack", time.Since(acked).Round(10*time.Millisecond))

	ctx := context.Background()
	prod, err := pgx.Connect(ctx, h.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close(ctx)
	var pid int
	if err := prod.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Exec(ctx, `SET synchronous_commit = on`); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() {
		_, err := prod.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('late', 'x', '{"a": 1}')`)
		committed <- err
	}()
	testenv.WaitFor(t, 20*time.Second, "the waiting row in the stream", func() (bool, error) {
		return h.streamCount() == uint64(len(warm)+1), nil
	})
	var ackedAt string
	if err := h.pool.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&ackedAt); err != nil {
		t.Fatal(err)
	}
	after, err := pglogrepl.ParseLSN(ackedAt)
	if err != nil {
		t.Fatal(err)
	}
	// Two watermarks taken after the ack are recorded while the row is
	// invisible: neither covers it.
	seen := map[string]bool{}
	testenv.WaitFor(t, 20*time.Second, "two watermarks recorded after the ack", func() (bool, error) {
		var lsn string
		if err := h.pool.QueryRow(ctx, `SELECT coalesce(max(watermark_lsn)::text, '0/0') FROM outbox_slots`).Scan(&lsn); err != nil {
			return false, err
		}
		if l, err := pglogrepl.ParseLSN(lsn); err == nil && l > after {
			seen[lsn] = true
		}
		return len(seen) >= 2, fmt.Errorf("%d recorded after %s", len(seen), after)
	})
	select {
	case err := <-committed:
		t.Fatalf("commit returned early (%v): the trap did not arm", err)
	default:
	}
	if n := h.countState("published"); n != len(warm) {
		t.Fatalf("%d rows covered while the last one is invisible, want %d", n, len(warm))
	}

	// Let the commit go: it is committed locally and becomes visible.
	if _, err := h.pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	<-committed
	released := time.Now()
	testenv.WaitFor(t, 5*time.Second, "the last row covered without further traffic", func() (bool, error) {
		n := h.countState("published")
		return n == len(warm)+1, fmt.Errorf("%d of %d covered", n, len(warm)+1)
	})
	t.Logf("the last row was covered %v after it became visible", time.Since(released).Round(10*time.Millisecond))
	if n := h.streamCount(); n != uint64(len(warm)+1) {
		t.Errorf("stream holds %d, want %d", n, len(warm)+1)
	}
}

// G17 at a clean stop under load: producers keep committing while the relay
// stops. The watermark recorded at the stop covers exactly the rows the
// stream holds: every one of them (the stop streams up to its candidate
// and publishes nothing after it), and none it does not hold (G17's
// safety: a covered row counts as published).
func TestNoneCleanStopUnderLoadCoversExactlyTheStored(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.Policy = store.PolicyNone
	h.start()
	ctx := context.Background()
	done := make(chan struct{})
	produced := make(chan int, 1)
	go func() {
		n := 0
		defer func() { produced <- n }()
		for {
			select {
			case <-done:
				return
			default:
			}
			if _, err := h.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload)
				SELECT 'load-' || ($1::int * 10 + g), 'thing_happened', '{}' FROM generate_series(0, 9) g`, n); err != nil {
				return
			}
			n++
		}
	}()
	testenv.WaitFor(t, 30*time.Second, "rows flowing", func() (bool, error) {
		return h.streamCount() >= 2000, nil
	})
	h.stop()
	close(done)
	n := <-produced
	byID, counts := h.streamMsgs()
	rows, err := h.pool.Query(ctx, `SELECT work_id FROM outbox o WHERE o.state = 'ready' AND `+coveredSQL)
	if err != nil {
		t.Fatal(err)
	}
	covered, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	inCover := map[string]bool{}
	unstored := 0
	for _, id := range covered {
		inCover[id] = true
		if byID[id] == nil {
			unstored++
		}
	}
	uncovered, dups := 0, 0
	for id, c := range counts {
		if !inCover[id] {
			uncovered++
		}
		dups += c - 1
	}
	t.Logf("%d rows committed, %d stored, %d covered", n*10, len(counts), len(covered))
	if unstored != 0 || uncovered != 0 || dups != 0 {
		t.Errorf("after a stop under load: %d covered rows not in the stream, %d stored rows not covered, %d stored twice; want 0, 0, 0", unstored, uncovered, dups)
	}
}

// G17 at a clean stop, for a row acked before it is visible (issue 30,
// item 5): a commit waiting for a synchronous standby is streamed and acked
// while every snapshot still lists its transaction as running, also the
// stop's own. The stop's watermark covers it all the same (the relay
// streamed and settled that transaction before the stop's position), and
// it shows as published the moment it becomes visible, with the relay
// gone. A transaction still open at the stop (listed as running too, never
// streamed) stays uncovered once it commits: G17's safety.
func TestNoneCleanStopCoversARowAckedWhileInvisible(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{
		"synchronous_standby_names": "ghost",
		// Everyone but the test's waiting producer commits without waiting.
		"synchronous_commit": "local",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.opts.Policy = store.PolicyNone
	h.start()
	ids := h.insertBulk("visible", 200, 50)
	testenv.WaitFor(t, 30*time.Second, "the visible rows in the stream", func() (bool, error) {
		return h.streamCount() == uint64(len(ids)), nil
	})

	ctx := context.Background()
	waiting, err := pgx.Connect(ctx, h.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer waiting.Close(ctx)
	var pid int
	if err := waiting.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := waiting.Exec(ctx, `SET synchronous_commit = on`); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() {
		_, err := waiting.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('acked-invisible', 'x', '{}')`)
		committed <- err
	}()
	ids = append(ids, "acked-invisible")
	testenv.WaitFor(t, 20*time.Second, "the waiting row in the stream", func() (bool, error) {
		return h.streamCount() == uint64(len(ids)), nil
	})
	open, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback(ctx) //nolint:errcheck // committed below; a no-op then
	if _, err := open.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('open-at-stop', 'x', '{}')`); err != nil {
		t.Fatal(err)
	}

	h.stop()
	select {
	case err := <-committed:
		t.Fatalf("commit returned early (%v): the trap did not arm", err)
	default:
	}
	if _, err := h.pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	<-committed
	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// No relay runs now: what counts is what the stop recorded.
	if got := h.countState("published"); got != len(ids) {
		t.Errorf("after the stop, the waiting row visible: %d rows covered, want %d (the row acked while invisible is not covered)", got, len(ids))
	}
	if got := h.countState("ready"); got != 1 {
		t.Errorf("%d rows uncovered, want 1 (the row of the transaction open at the stop, never streamed)", got)
	}
	if n := h.streamCount(); n != uint64(len(ids)) {
		t.Errorf("stream holds %d, want %d", n, len(ids))
	}
}
