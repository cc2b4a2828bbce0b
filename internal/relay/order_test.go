package relay_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// insertAggregates commits aggregates 1..nAgg with sequences from..to each,
// interleaved over transactions of a few rows, with sequences from the
// table's counter function. big names a row (aggregate/seq) whose payload
// is padded past the stream's message size.
func insertAggregates(t *testing.T, h *harness, nAgg, from, to int, big string) []string {
	t.Helper()
	ctx := context.Background()
	next := make([]int, nAgg+1)
	for a := range next {
		next[a] = from - 1
	}
	var ids []string
	r := rand.New(rand.NewPCG(uint64(from), 2))
	for left := nAgg * (to - from + 1); left > 0; {
		tx, err := h.pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for range 1 + r.IntN(4) {
			a := 1 + r.IntN(nAgg)
			if next[a] == to {
				continue
			}
			next[a]++
			left--
			id := fmt.Sprintf("order-%d-%d", a, next[a])
			pad := 0
			if fmt.Sprintf("%d/%d", a, next[a]) == big {
				pad = 2048
			}
			if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
				VALUES ($1, 'order_event', jsonb_build_object('pad', repeat('x', $3::int)), 'order', $2, outbox_next_seq('order', $2))`,
				id, strconv.Itoa(a), pad); err != nil {
				_ = tx.Rollback(ctx)
				t.Fatalf("insert %s: %v", id, err)
			}
			ids = append(ids, id)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

// assertAggregateOrder checks that every stored message of an aggregate
// carries its headers and that the stream sequence grows with
// Outbox-Sequence, per aggregate: the receiver sees each aggregate's work
// in order.
func assertAggregateOrder(t *testing.T, h *harness) {
	t.Helper()
	byID, counts := h.streamMsgs()
	type pos struct{ seq, stored uint64 }
	per := map[string][]pos{}
	for id, m := range byID {
		if counts[id] != 1 {
			t.Errorf("%s stored %d times", id, counts[id])
		}
		if m.Header.Get(wire.HeaderAggregateType) != "order" {
			t.Errorf("%s: %s = %q", id, wire.HeaderAggregateType, m.Header.Get(wire.HeaderAggregateType))
		}
		s, err := strconv.ParseUint(m.Header.Get(wire.HeaderSequence), 10, 64)
		if err != nil {
			t.Fatalf("%s: %s: %v", id, wire.HeaderSequence, err)
		}
		agg := m.Header.Get(wire.HeaderAggregateID)
		if want := fmt.Sprintf("order-%s-%d", agg, s); want != id {
			t.Errorf("%s carries aggregate %s sequence %d", id, agg, s)
		}
		per[agg] = append(per[agg], pos{s, m.Sequence})
	}
	for agg, ps := range per {
		for _, a := range ps {
			for _, b := range ps {
				if a.seq < b.seq && a.stored > b.stored {
					t.Errorf("aggregate %s: sequence %d stored at %d, after sequence %d at %d", agg, a.seq, a.stored, b.seq, b.stored)
				}
			}
		}
	}
}

// G12: aggregates 1..20 with sequences 1..10 in interleaved transactions;
// sequence 3 of aggregate 7 is over the stream's maximum message size, so
// the broker refuses it at ack time. It ends failed and aggregate 7's 4..10
// wait (scheduled, held) while every other aggregate flows. The operator
// raises the limit and redrives the row; then 3..10 are stored in order.
// Halfway, the relay is stopped and started again: the held set comes from
// the table.
//
// With --on-publish none (G17) the rows the CDC path published stay
// 'ready': the poller's ordered claim must read aggregate 7's sequence 2
// as published through the watermark, or 3..11 would wait behind it for
// ever.
func TestOrderingHoldsAnAggregateBehindItsRefusedRow(t *testing.T) {
	for _, p := range []store.Policy{store.PolicyMark, store.PolicyNone} {
		t.Run(string(p), func(t *testing.T) { testOrderingHoldsAnAggregate(t, p) })
	}
}

func testOrderingHoldsAnAggregate(t *testing.T, policy store.Policy) {
	t.Parallel() // a database, stream and slot of its own
	s := sharedSetup(t)
	h := newHarness(t, s)
	h.opts.Policy = policy
	h.opts.Ordering = app.OrderingAggregate
	h.opts.MaxAttempts = 2
	ctx := context.Background()
	if _, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: s.stream, Subjects: []string{s.subjectPrefix + ">"},
		MaxMsgSize: 1024, Duplicates: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.js.DeleteStream(context.Background(), s.stream) })
	h.start()
	ids := insertAggregates(t, h, 20, 1, 10, "7/3")

	// The poller claims a head with the rows behind it; when the head
	// fails, those are released (held) a moment later: wait for that too.
	testenv.WaitFor(t, 60*time.Second, "every other row published, 7/3 failed and nothing claimed", func() (bool, error) {
		return h.countState("published") == 192 && h.countState("failed") == 1 && h.countState("running") == 0, fmt.Errorf("published %d, failed %d, scheduled %d, running %d",
			h.countState("published"), h.countState("failed"), h.countState("scheduled"), h.countState("running"))
	})
	var lastErr string
	if err := h.pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE work_id = 'order-7-3'`).Scan(&lastErr); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(lastErr, "rejected: max_msg_size") {
		t.Errorf("order-7-3: last_error %q, want rejected: max_msg_size", lastErr)
	}
	rows, err := h.pool.Query(ctx, `SELECT work_id, state, attempts, coalesce(last_error, '') FROM outbox
		WHERE aggregate_id = '7' AND aggregate_seq > 3 ORDER BY aggregate_seq`)
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for rows.Next() {
		var id, state, le string
		var attempts int
		if err := rows.Scan(&id, &state, &attempts, &le); err != nil {
			t.Fatal(err)
		}
		if state != "scheduled" || !strings.HasPrefix(le, "held: waiting for order-7-") {
			t.Errorf("%s: %s, %q; want scheduled and held", id, state, le)
		}
		held++
	}
	if held != 7 {
		t.Fatalf("%d rows of aggregate 7 held, want 7", held)
	}
	st := store.New(h.pool, h.opts.Table, store.PolicyMark)
	blocked, err := st.BlockedAggregates(ctx, 5)
	if oldest := blocked.Oldest; err != nil || blocked.Total != 1 || blocked.AtLeast || len(oldest) != 1 || oldest[0].WorkID != "order-7-3" || oldest[0].Waiting != 7 {
		t.Fatalf("blocked aggregates: %+v %v; want 1, order-7-3 with 7 waiting", blocked, err)
	}

	// A restart while rows are held: the held set is read back.
	h.stop()
	more := insertAggregates(t, h, 20, 11, 11, "") // each aggregate's 11th row, aggregate 7's too
	h.start()
	testenv.WaitFor(t, 30*time.Second, "the new rows of other aggregates published", func() (bool, error) {
		return h.countState("published") == 192+19, fmt.Errorf("published %d", h.countState("published"))
	})
	var state string
	if err := h.pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'order-7-11'`).Scan(&state); err != nil || state != "scheduled" {
		t.Fatalf("order-7-11 after the restart: %s, %v; want scheduled (held)", state, err)
	}

	// The operator removes the cause and redrives the row.
	stream, err := h.js.Stream(ctx, s.stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := stream.CachedInfo().Config
	cfg.MaxMsgSize = 1 << 20
	if _, err := h.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	res, err := st.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"order-7-3"}}, By: "test", Reason: "limit raised"})
	if err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive: %+v, %v", res, err)
	}
	h.waitPublished(len(ids)+len(more), 60*time.Second)
	assertAggregateOrder(t, h)
	h.assertExactlyOnce(append(ids, more...))
}

// G13 on both paths: a row committed already past its deadline is never
// published and ends expired, never attempted; one with a far deadline is
// published with Outbox-Expires-At; rows whose deadline passes while the
// broker is down are not published when it returns.
// With --on-publish none too (G17).
func TestDeadlines(t *testing.T) {
	for _, p := range []store.Policy{store.PolicyMark, store.PolicyNone} {
		t.Run(string(p), func(t *testing.T) { testDeadlines(t, p) })
	}
}

func testDeadlines(t *testing.T, policy store.Policy) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	h := newHarness(t, setup{dbURL: env.PG.CreateDatabase(t), natsURL: n.URL(), stream: "DEADLINES", subjectPrefix: "deadlines."})
	h.opts.Policy = policy
	h.opts.AckTimeout = time.Second
	h.start()
	ctx := context.Background()
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES
		('late', 'k', '{}', clock_timestamp() - interval '1 second'),
		('far', 'k', '{}', clock_timestamp() + interval '1 day')`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at, state) VALUES
		('late-scheduled', 'k', '{}', clock_timestamp() - interval '1 second', 'scheduled')`)
	testenv.WaitFor(t, 30*time.Second, "far published, late ones expired", func() (bool, error) {
		return h.countState("published") == 1 && h.countState("expired") == 2, nil
	})
	byID, _ := h.streamMsgs()
	var far time.Time
	if err := h.pool.QueryRow(ctx, `SELECT expires_at FROM outbox WHERE work_id = 'far'`).Scan(&far); err != nil {
		t.Fatal(err)
	}
	if got := byID["far"].Header.Get(wire.HeaderExpiresAt); got != far.UTC().Format(time.RFC3339Nano) {
		t.Errorf("far: %s = %q, want %q", wire.HeaderExpiresAt, got, far.UTC().Format(time.RFC3339Nano))
	}
	for _, id := range []string{"late", "late-scheduled"} {
		var le string
		if err := h.pool.QueryRow(ctx, `SELECT last_error FROM outbox WHERE work_id = $1`, id).Scan(&le); err != nil {
			t.Fatal(err)
		}
		if !strings.HasPrefix(le, "expired: deadline ") || !strings.HasSuffix(le, "passed; never attempted") {
			t.Errorf("%s: last_error %q, want expired ... never attempted", id, le)
		}
		if byID[id] != nil {
			t.Errorf("%s was published", id)
		}
	}

	// The broker goes down; rows due to expire 3 s later are committed.
	if err := n.Kill(); err != nil {
		t.Fatal(err)
	}
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at)
		SELECT 'outage-' || g, 'k', '{}', clock_timestamp() + interval '3 seconds' FROM generate_series(1, 20) g`)
	time.Sleep(10 * time.Second)
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the outage rows expired", func() (bool, error) {
		return h.countState("expired") == 22, fmt.Errorf("expired %d, published %d, ready %d, scheduled %d",
			h.countState("expired"), h.countState("published"), h.countState("ready"), h.countState("scheduled"))
	})
	h.insertRows("after", 3, 1)
	h.waitPublished(4, 30*time.Second)
	byID, _ = h.streamMsgs()
	for id := range byID {
		if strings.HasPrefix(id, "outage-") {
			t.Errorf("%s was published after its deadline", id)
		}
	}
}
