package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/outbox"
)

type storedRow struct {
	kind, state string
	subject     *string
	payload     string
	headers     *string
	delayed     bool
}

func readRow(t *testing.T, db outbox.DB, table, workID string) (storedRow, bool) {
	t.Helper()
	var r storedRow
	err := db.QueryRow(context.Background(), `SELECT kind, state, subject, payload::text, headers::text, available_at > clock_timestamp()
		FROM `+table+` WHERE work_id = $1`, workID).Scan(&r.kind, &r.state, &r.subject, &r.payload, &r.headers, &r.delayed)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false
	}
	if err != nil {
		t.Fatalf("read %s: %v", workID, err)
	}
	return r, true
}

func countRows(t *testing.T, db outbox.DB, table string) int {
	t.Helper()
	var n int
	if err := db.QueryRow(context.Background(), `SELECT count(*) FROM `+table).Scan(&n); err != nil {
		t.Fatalf("count %s: %v", table, err)
	}
	return n
}

func inTx(t *testing.T, pool *pgxpool.Pool, f func(tx pgx.Tx)) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatalf("begin: %v", err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	f(tx)
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit: %v", err)
	}
}

func order(id int) outbox.Message {
	return outbox.Message{
		WorkID:  fmt.Sprintf("order-%d-ack", id),
		Kind:    "order.received",
		Payload: json.RawMessage(fmt.Sprintf(`{"order_id": %d, "total": "29.00"}`, id)),
	}
}

func TestEnqueueStoresTheRowInTheCallersTransaction(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	later := time.Now().Add(time.Hour)
	m := order(103)
	m.Subject = "shop.orders.103"
	m.Headers = map[string]string{"traceparent": "00-abc-def-01"}
	delayed := order(104)
	delayed.AvailableAt = later
	inTx(t, pool, func(tx pgx.Tx) {
		if err := outbox.Enqueue(ctx, tx, m); err != nil {
			t.Fatalf("Enqueue: %v", err)
		}
		if err := outbox.Enqueue(ctx, tx, delayed); err != nil {
			t.Fatalf("Enqueue delayed: %v", err)
		}
		// Not visible outside the transaction before it commits.
		if _, ok := readRow(t, pool, "outbox", m.WorkID); ok {
			t.Fatal("row visible to another session before commit")
		}
	})
	r, ok := readRow(t, pool, "outbox", m.WorkID)
	if !ok {
		t.Fatal("row missing after commit")
	}
	if r.kind != "order.received" || r.state != "ready" || r.subject == nil || *r.subject != "shop.orders.103" ||
		r.payload != `{"total": "29.00", "order_id": 103}` || r.headers == nil || *r.headers != `{"traceparent": "00-abc-def-01"}` || r.delayed {
		t.Errorf("stored %+v (subject %v, headers %v)", r, deref(r.subject), deref(r.headers))
	}
	r, _ = readRow(t, pool, "outbox", delayed.WorkID)
	if r.subject != nil || r.headers != nil || !r.delayed {
		t.Errorf("delayed row: subject %v headers %v delayed %v; want NULL, NULL, available_at in the future", deref(r.subject), deref(r.headers), r.delayed)
	}
}

func deref(s *string) string {
	if s == nil {
		return "<NULL>"
	}
	return *s
}

func TestEnqueueRolledBackLeavesNothing(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := outbox.Enqueue(ctx, tx, order(i)); err != nil {
			t.Fatalf("Enqueue: %v", err)
		}
	}
	if _, err := outbox.EnqueueBatch(ctx, tx, []outbox.Message{order(10), order(11)}); err != nil {
		t.Fatalf("EnqueueBatch: %v", err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := countRows(t, pool, "outbox"); n != 0 {
		t.Errorf("%d rows after rollback, want 0", n)
	}
}

// TestEnqueueRepeat: the same intention again is ErrAlreadyEnqueued, a
// different one under the same work_id is ErrConflict naming what differs;
// neither aborts the caller's transaction.
func TestEnqueueRepeat(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	first := order(103)
	first.Payload = json.RawMessage(`{"order_id":103,"total":"29.00","lines":[1,2]}`)
	if err := outbox.Enqueue(ctx, pool, first); err != nil {
		t.Fatal(err)
	}
	same := first
	// Equal as JSON: other key order and spacing; headers and time are not
	// part of the intention.
	same.Payload = json.RawMessage(`{ "lines": [1, 2], "total": "29.00", "order_id": 103 }`)
	same.Headers = map[string]string{"traceparent": "00-retry-01"}
	changed := first
	changed.Payload = json.RawMessage(`{"order_id":103,"total":"31.00","lines":[1,2]}`)
	changed.Subject = "elsewhere"

	inTx(t, pool, func(tx pgx.Tx) {
		if err := outbox.Enqueue(ctx, tx, same); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
			t.Fatalf("same intention again: %v, want ErrAlreadyEnqueued", err)
		}
		err := outbox.Enqueue(ctx, tx, changed)
		if !errors.Is(err, outbox.ErrConflict) {
			t.Fatalf("changed payload: %v, want ErrConflict", err)
		}
		var ce *outbox.ConflictError
		if !errors.As(err, &ce) || ce.WorkID != first.WorkID || strings.Join(ce.Differs, ",") != "subject,payload" {
			t.Errorf("conflict error %#v", ce)
		}
		for _, want := range []string{`"order-103-ack"`, "subject and payload", `"29.00"`, "new work_id"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q does not mention %s", err, want)
			}
		}
		kind := first
		kind.Kind = "order.cancelled"
		if err := outbox.Enqueue(ctx, tx, kind); !errors.Is(err, outbox.ErrConflict) || !strings.Contains(err.Error(), "different kind") {
			t.Errorf("changed kind: %v", err)
		}
		// The transaction is still usable: no unique violation was raised in it.
		if err := outbox.Enqueue(ctx, tx, order(104)); err != nil {
			t.Fatalf("enqueue after the repeats: %v", err)
		}
	})
	if r, _ := readRow(t, pool, "outbox", first.WorkID); !strings.Contains(r.payload, `"29.00"`) {
		t.Errorf("stored payload changed to %s", r.payload)
	}
	if n := countRows(t, pool, "outbox"); n != 2 {
		t.Errorf("%d rows, want 2", n)
	}
}

// TestEnqueueConcurrentSameWorkID: two transactions enqueue one work_id at
// once; the second waits for the first and then reports what it committed.
func TestEnqueueConcurrentSameWorkID(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		payload string
		want    error
	}{{"same", `{"order_id": 7, "total": "29.00"}`, outbox.ErrAlreadyEnqueued}, {"different", `{"order_id": 7}`, outbox.ErrConflict}} {
		first := order(7)
		first.WorkID += tc.name
		tx1, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := outbox.Enqueue(ctx, tx1, first); err != nil {
			t.Fatal(err)
		}
		second := first
		second.Payload = json.RawMessage(tc.payload)
		done := make(chan error, 1)
		go func() {
			tx2, err := pool.Begin(ctx)
			if err != nil {
				done <- err
				return
			}
			defer tx2.Rollback(ctx) //nolint:errcheck
			done <- outbox.Enqueue(ctx, tx2, second)
		}()
		select {
		case err := <-done:
			t.Fatalf("%s: second enqueue returned %v before the first committed", tc.name, err)
		case <-time.After(200 * time.Millisecond):
		}
		if err := tx1.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if err := <-done; !errors.Is(err, tc.want) {
			t.Errorf("%s: second enqueue: %v, want %v", tc.name, err, tc.want)
		}
	}
}

func TestEnqueueBatch(t *testing.T) {
	t.Parallel()
	pool, qc := newDB(t, table.Table{})
	ctx := context.Background()
	const n = 1000
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = order(i)
		if i%10 == 0 {
			msgs[i].Headers = map[string]string{"traceparent": fmt.Sprintf("00-%d-01", i)}
		}
		if i%100 == 0 {
			msgs[i].AvailableAt = time.Now().Add(time.Hour)
		}
	}
	// The table's layout is read once per database and table; Prepare
	// does it ahead.
	before := qc.n.Load()
	if p, err := outbox.New(); err != nil || p.Prepare(ctx, pool) != nil {
		t.Fatalf("prepare: %v", err)
	}
	if q := qc.n.Load() - before; q != 1 {
		t.Errorf("prepare took %d statements, want 1", q)
	}
	before = qc.n.Load()
	res, err := outbox.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		t.Fatalf("EnqueueBatch: %v", err)
	}
	if q := qc.n.Load() - before; q != 1 {
		t.Errorf("fresh batch of %d took %d statements, want 1", n, q)
	}
	for i, r := range res {
		if r != outbox.Inserted {
			t.Fatalf("result %d = %v, want inserted", i, r)
		}
	}
	if c := countRows(t, pool, "outbox"); c != n {
		t.Fatalf("%d rows, want %d", c, n)
	}
	r, _ := readRow(t, pool, "outbox", msgs[100].WorkID)
	if r.headers == nil || *r.headers != `{"traceparent": "00-100-01"}` || !r.delayed {
		t.Errorf("row 100: headers %s, delayed %v", deref(r.headers), r.delayed)
	}

	// Again, with new ones, repeats and two conflicts mixed in.
	again := []outbox.Message{order(5000), msgs[1], msgs[2], order(5001), msgs[3]}
	again[2].Payload = json.RawMessage(`{"order_id": 2, "total": "0.00"}`)
	again[4].Kind = "order.other"
	before = qc.n.Load()
	res, err = outbox.EnqueueBatch(ctx, pool, again)
	if q := qc.n.Load() - before; q != 2 {
		t.Errorf("batch with repeats took %d statements, want 2", q)
	}
	want := []outbox.Result{outbox.Inserted, outbox.AlreadyEnqueued, outbox.Conflicted, outbox.Inserted, outbox.Conflicted}
	if fmt.Sprint(res) != fmt.Sprint(want) {
		t.Errorf("results %v, want %v", res, want)
	}
	if !errors.Is(err, outbox.ErrConflict) {
		t.Fatalf("err = %v, want ErrConflict", err)
	}
	for _, w := range []string{`message 2: work_id "order-2-ack"`, "different payload", `message 4: work_id "order-3-ack"`, "different kind"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not mention %q", err, w)
		}
	}
	if c := countRows(t, pool, "outbox"); c != n+2 {
		t.Errorf("%d rows, want %d", c, n+2)
	}

	// Refused whole before the database: an invalid message, a work_id twice.
	before = qc.n.Load()
	bad := []outbox.Message{order(6000), {WorkID: "x", Kind: "k", Payload: json.RawMessage(`{`)}, order(6000)}
	res, err = outbox.EnqueueBatch(ctx, pool, bad)
	if !errors.Is(err, outbox.ErrInvalid) || res != nil {
		t.Fatalf("invalid batch: %v, %v", res, err)
	}
	for _, w := range []string{"message 1:", "not valid JSON", `message 2: work_id "order-6000-ack" already appears at message 0`} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("error %q does not mention %q", err, w)
		}
	}
	if q := qc.n.Load() - before; q != 0 {
		t.Errorf("invalid batch sent %d statements", q)
	}
	if res, err := outbox.EnqueueBatch(ctx, pool, nil); err != nil || len(res) != 0 {
		t.Errorf("empty batch: %v, %v", res, err)
	}
}

// TestConcurrentProducers: many goroutines enqueue overlapping work_ids;
// every work_id ends up stored once and each call says truthfully whether it
// inserted.
func TestConcurrentProducers(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	const workers, ids = 8, 200
	var (
		mu       sync.Mutex
		inserted = map[string]int{}
		wg       sync.WaitGroup
	)
	for w := range workers {
		wg.Go(func() {
			for i := range ids {
				m := order((i*7 + w) % ids)
				err := outbox.Enqueue(ctx, pool, m)
				switch {
				case err == nil:
					mu.Lock()
					inserted[m.WorkID]++
					mu.Unlock()
				case errors.Is(err, outbox.ErrAlreadyEnqueued):
				default:
					t.Errorf("worker %d: %v", w, err)
					return
				}
			}
		})
	}
	wg.Wait()
	if len(inserted) != ids {
		t.Errorf("%d work_ids reported inserted, want %d", len(inserted), ids)
	}
	for id, n := range inserted {
		if n != 1 {
			t.Errorf("%s reported inserted %d times", id, n)
		}
	}
	if c := countRows(t, pool, "outbox"); c != ids {
		t.Errorf("%d rows, want %d", c, ids)
	}
}

func TestProducerWithTable(t *testing.T) {
	t.Parallel()
	table := table.Table{Schema: "shop data", Name: `Out"box`}
	pool, _ := newDB(t, table)
	ctx := context.Background()
	p, err := outbox.New(outbox.WithTable(`shop data.Out"box`))
	if err != nil {
		t.Fatal(err)
	}
	if p.Table() != `shop data.Out"box` {
		t.Errorf("Table() = %q", p.Table())
	}
	if err := p.Enqueue(ctx, pool, order(1)); err != nil {
		t.Fatalf("Enqueue: %v", err)
	}
	if err := p.Enqueue(ctx, pool, order(1)); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Fatalf("repeat: %v", err)
	}
	if res, err := p.EnqueueBatch(ctx, pool, []outbox.Message{order(1), order(2)}); err != nil || res[0] != outbox.AlreadyEnqueued || res[1] != outbox.Inserted {
		t.Fatalf("batch: %v, %v", res, err)
	}
	if n := countRows(t, pool, table.String()); n != 2 {
		t.Errorf("%d rows in %s, want 2", n, table.String())
	}
	// The default producer writes to public.outbox, which does not exist here.
	if err := outbox.Enqueue(ctx, pool, order(3)); err == nil || !strings.Contains(err.Error(), "public.outbox") {
		t.Errorf("default table: %v", err)
	}
	if _, err := outbox.New(outbox.WithTable("a.b.c")); err == nil {
		t.Error("WithTable(a.b.c) accepted")
	}
}
