package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// G12, a released aggregate: 1,000 rows of one aggregate come through the
// CDC path while its first row is dead-lettered, and are held (handed to
// the poller). The operator cancels the dead letter. The poller drains
// the aggregate in runs, in order, while the producer keeps adding rows at
// about 5 a second; once the poller has caught up, the aggregate goes
// back to the CDC path: later rows are published by it (no attempt
// counted) and no longer handed over. The stream holds every row once, in
// sequence order.
func TestReleasedAggregateReturnsToTheCDCPath(t *testing.T) {
	s := sharedSetup(t)
	h := newHarness(t, s)
	h.opts.Ordering = app.OrderingAggregate
	ctx := context.Background()
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('agg-1', 'k', '{}', 'failed', 10, 'rejected: max_msg_size: too big', 'order', 'agg', 1)`)
	h.start()
	const held = 1000
	for i := 2; i <= held+1; i += 100 {
		h.exec(`INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
			SELECT 'agg-' || g, 'k', jsonb_build_object('n', g), 'order', 'agg', g FROM generate_series($1::int, $2::int) g`, i, i+99)
	}
	testenv.WaitFor(t, time.Minute, "the aggregate's rows held", func() (bool, error) {
		n := h.countState("scheduled")
		return n == held, fmt.Errorf("%d scheduled", n)
	})

	st := store.New(h.pool, h.opts.Table, store.PolicyMark)
	if res, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"agg-1"}}, By: "test", Reason: "drop"}); err != nil || len(res.Changed) != 1 {
		t.Fatalf("cancel: %+v, %v", res, err)
	}
	// The producer goes on at about 5 rows a second.
	var last atomic.Int64
	last.Store(held + 1)
	pctx, stopProducer := context.WithCancel(ctx)
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for pctx.Err() == nil {
			n := last.Load() + 1
			if _, err := h.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
				VALUES ('agg-' || $1::bigint, 'k', '{}', 'order', 'agg', $1)`, n); err != nil {
				t.Errorf("insert %d: %v", n, err)
				return
			}
			last.Store(n)
			time.Sleep(200 * time.Millisecond)
		}
	}()
	// Handed back: a row inserted now is published by the CDC path
	// (attempts 0) and a later one too.
	var byCDC int64
	testenv.WaitFor(t, time.Minute, "rows published by the CDC path again", func() (bool, error) {
		n := last.Load()
		var from int64
		err := h.pool.QueryRow(ctx, `SELECT coalesce(min(aggregate_seq), 0) FROM outbox
			WHERE aggregate_id = 'agg' AND aggregate_seq > $1 AND state = 'published' AND attempts = 0`, held+1).Scan(&from)
		if err != nil || from == 0 {
			return false, fmt.Errorf("none yet (%d rows produced, %d scheduled, %d published; %v)", n-held-1, h.countState("scheduled"), h.countState("published"), err)
		}
		byCDC = from
		return n > from+5, nil
	})
	stopProducer()
	<-produced
	n := last.Load()
	h.waitPublished(int(n)-1, time.Minute)
	var handedAfter int
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE aggregate_seq > $1 AND attempts > 0`, byCDC).Scan(&handedAfter); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d rows produced during the drain; the CDC path took the aggregate back from sequence %d", n-held-1, byCDC)
	if handedAfter != 0 {
		t.Errorf("%d rows after sequence %d went through the poller: the aggregate was not handed back for good", handedAfter, byCDC)
	}

	byID, counts := h.streamMsgs()
	type pos struct{ seq, stored uint64 }
	var prev pos
	for i := int64(2); i <= n; i++ {
		id := "agg-" + strconv.FormatInt(i, 10)
		m, ok := byID[id]
		if !ok || counts[id] != 1 {
			t.Fatalf("%s stored %d times", id, counts[id])
		}
		if got := m.Header.Get(wire.HeaderSequence); got != strconv.FormatInt(i, 10) {
			t.Fatalf("%s carries %s %s", id, wire.HeaderSequence, got)
		}
		if m.Sequence <= prev.stored {
			t.Fatalf("sequence %d stored at stream sequence %d, after sequence %d at %d", i, m.Sequence, prev.seq, prev.stored)
		}
		prev = pos{uint64(i), m.Sequence}
	}
}
