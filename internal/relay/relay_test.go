package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Mina's order 103 and its acknowledgement, committed together: the stream
// holds exactly one message with the committed payload byte for byte, the
// design's subject and headers, and the row is marked with its sequence.
func TestOrder103(t *testing.T) {
	env := testenv.Shared(t)
	s := setup{dbURL: env.PG.CreateDatabase(t), natsURL: env.NATS.URL(), stream: "OUTBOX", subjectPrefix: "outbox."}
	h := newHarness(t, s)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = h.js.DeleteStream(ctx, "OUTBOX")
	})
	h.start()

	h.exec(`CREATE TABLE orders (id int PRIMARY KEY, customer_id int, total numeric(10,2), status text)`)
	ctx := context.Background()
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO orders VALUES (103, 1, 29.00, 'pending')`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, headers) VALUES ('order-103-ack', 'order_received',
		'{"order_id":103,"customer_id":1,"total":"29.00","message":"Order received; payment still pending"}',
		'{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitPublished(1, 20*time.Second)

	byID, counts := h.streamMsgs()
	if len(counts) != 1 || counts["order-103-ack"] != 1 {
		t.Fatalf("stream holds %v, want exactly one order-103-ack", counts)
	}
	m := byID["order-103-ack"]
	var payloadText, state string
	var seq int64
	var publishedAt *time.Time
	if err := h.pool.QueryRow(ctx, `SELECT payload::text, state, stream_seq, published_at FROM outbox WHERE work_id = 'order-103-ack'`).
		Scan(&payloadText, &state, &seq, &publishedAt); err != nil {
		t.Fatal(err)
	}
	if got, want := string(m.Data), payloadText; got != want {
		t.Errorf("data = %q, want the committed payload %q", got, want)
	}
	if got, want := m.Subject, "outbox.order_received"; got != want {
		t.Errorf("subject = %q, want %q", got, want)
	}
	for k, want := range map[string]string{
		jetstream.MsgIDHeader: "order-103-ack",
		wire.HeaderKind:       "order_received",
		"traceparent":         "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
	} {
		if got := m.Header.Get(k); got != want {
			t.Errorf("header %s = %q, want %q", k, got, want)
		}
	}
	if _, err := pglogrepl.ParseLSN(m.Header.Get(wire.HeaderCommitLSN)); err != nil {
		t.Errorf("header %s = %q: %v", wire.HeaderCommitLSN, m.Header.Get(wire.HeaderCommitLSN), err)
	}
	if _, err := time.Parse(time.RFC3339Nano, m.Header.Get(wire.HeaderCommitTime)); err != nil {
		t.Errorf("header %s = %q: %v", wire.HeaderCommitTime, m.Header.Get(wire.HeaderCommitTime), err)
	}
	if state != "published" || uint64(seq) != m.Sequence || publishedAt == nil {
		t.Errorf("row state=%s stream_seq=%d published_at=%v, want published, %d, set", state, seq, publishedAt, m.Sequence)
	}
}

// G2: a rolled-back insert is never published, even when the rows around it
// are.
func TestRollbackNeverPublished(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.start()
	ctx := context.Background()
	before := h.insertRows("before", 3, 3)
	tx, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('phantom', 'x', '{}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	after := h.insertRows("after", 3, 1)
	h.waitPublished(6, 20*time.Second)
	h.assertExactlyOnce(append(before, after...))
}

// The delete policy removes each row once the broker acked it.
func TestOnPublishDelete(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.Policy = "delete"
	h.start()
	ids := h.insertRows("d", 50, 10)
	testenv.WaitFor(t, 20*time.Second, "rows deleted", func() (bool, error) {
		var n int
		err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox`).Scan(&n)
		return err == nil && n == 0 && h.streamCount() == 50, err
	})
	h.assertExactlyOnce(ids)
}

// A graceful stop confirms the slot past everything acked, and a restart
// publishes only what came after.
func TestStopConfirmsAndRestartResumes(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.start()
	first := h.insertRows("a", 100, 10)
	h.waitPublished(100, 20*time.Second)
	h.stop()
	// The last transaction's commit record starts at its messages'
	// Outbox-Commit-LSN; a graceful stop confirms past it.
	byID, _ := h.streamMsgs()
	lastCommit, err := pglogrepl.ParseLSN(byID[first[len(first)-1]].Header.Get(wire.HeaderCommitLSN))
	if err != nil {
		t.Fatal(err)
	}
	confirmed, _ := h.slotConfirmed()
	if c, _ := pglogrepl.ParseLSN(confirmed); c <= lastCommit {
		t.Errorf("after a graceful stop the slot is confirmed at %s, not past the last transaction's commit at %s", confirmed, lastCommit)
	}
	second := h.insertRows("b", 100, 10)
	h.start()
	h.waitPublished(200, 20*time.Second)
	h.assertExactlyOnce(append(first, second...))
}

// An idle relay with a long status interval still stops at once and sends
// its final confirmation (a receive waiting for the next status update must
// not hold the shutdown).
func TestIdleStopIsPromptWithLongStatusInterval(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.opts.StatusInterval = 25 * time.Second
	h.start()
	ids := h.insertRows("idle", 10, 10)
	h.waitPublished(10, 20*time.Second)
	started := time.Now()
	h.stop()
	if took := time.Since(started); took > 5*time.Second {
		t.Errorf("stop took %s with a 25s status interval, want well under it", took)
	}
	byID, _ := h.streamMsgs()
	lastCommit, err := pglogrepl.ParseLSN(byID[ids[len(ids)-1]].Header.Get(wire.HeaderCommitLSN))
	if err != nil {
		t.Fatal(err)
	}
	confirmed, _ := h.slotConfirmed()
	if c, _ := pglogrepl.ParseLSN(confirmed); c <= lastCommit {
		t.Errorf("slot confirmed at %s after the stop, not past the last commit at %s", confirmed, lastCommit)
	}
}
