package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/poller"
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
	t.Parallel() // a database, stream and slot of its own
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

// G12, a busy released aggregate: the producer adds about 20 rows a second
// (one every 40 ms plus its insert) to an aggregate held behind a dead
// letter, with the default poll and held-refresh intervals (1 s), so a read
// of the held set almost always finds a row just handed over (before the
// per-row check it did not come back within 15 s). After the dead letter is
// cancelled, the aggregate must come back to the CDC path within 15 s: new
// rows are published with no attempt and no claim, and the stream holds
// every sequence once, in order.
//
// At about 20 rows a second the table's answer alone hands it back. Faster
// (a row every 2 ms plus its insert, a few hundred a second), the poller
// must also claim the rows handed over at once (the relay wakes it) rather
// than at its next poll: otherwise rows pile up for a poll interval and the
// aggregate is never found caught up.
func TestBusyReleasedAggregateReturnsToTheCDCPath(t *testing.T) {
	for _, c := range []struct {
		name string
		gap  time.Duration
	}{{"20 rows/s", 40 * time.Millisecond}, {"hundreds of rows/s", 2 * time.Millisecond}} {
		t.Run(c.name, func(t *testing.T) { busyReleasedAggregate(t, c.gap) })
	}
}

func busyReleasedAggregate(t *testing.T, gap time.Duration) {
	t.Parallel() // a database, stream and slot of its own
	s := sharedSetup(t)
	h := newHarness(t, s)
	h.opts.Ordering = app.OrderingAggregate
	h.opts.PollInterval = poller.DefaultPollInterval
	ctx := context.Background()
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('busy-1', 'k', '{}', 'failed', 10, 'rejected: max_msg_size: too big', 'order', 'busy', 1)`)
	h.start()

	var last atomic.Int64
	last.Store(1)
	pctx, stopProducer := context.WithCancel(ctx)
	produced := make(chan struct{})
	producing := time.Now()
	go func() {
		defer close(produced)
		for pctx.Err() == nil {
			n := last.Load() + 1
			if _, err := h.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
				VALUES ('busy-' || $1::bigint, 'k', '{}', 'order', 'busy', $1)`, n); err != nil {
				t.Errorf("insert %d: %v", n, err)
				return
			}
			last.Store(n)
			time.Sleep(gap)
		}
	}()
	defer func() { stopProducer(); <-produced }()
	testenv.WaitFor(t, time.Minute, "the aggregate's rows held", func() (bool, error) {
		n := h.countState("scheduled")
		return n >= 40, fmt.Errorf("%d scheduled", n)
	})

	var cancelledAt time.Time
	if err := h.pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&cancelledAt); err != nil {
		t.Fatal(err)
	}
	st := store.New(h.pool, h.opts.Table, store.PolicyMark)
	if res, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"busy-1"}}, By: "test", Reason: "drop"}); err != nil || len(res.Changed) != 1 {
		t.Fatalf("cancel: %+v, %v", res, err)
	}
	var byCDC int64
	var back time.Duration
	testenv.WaitFor(t, 15*time.Second, "rows of the busy aggregate published by the CDC path again", func() (bool, error) {
		var at time.Time
		err := h.pool.QueryRow(ctx, `SELECT aggregate_seq, published_at FROM outbox
			WHERE aggregate_id = 'busy' AND state = 'published' AND attempts = 0 AND claim_generation = 0
			ORDER BY aggregate_seq LIMIT 1`).Scan(&byCDC, &at)
		if err != nil {
			return false, fmt.Errorf("none yet (%d rows produced, %d scheduled, %d published; %v)", last.Load()-1, h.countState("scheduled"), h.countState("published"), err)
		}
		back = at.Sub(cancelledAt)
		return true, nil
	})
	// And it stays with the CDC path: 40 more rows (2 s of the producer).
	testenv.WaitFor(t, 30*time.Second, "40 more rows produced", func() (bool, error) {
		return last.Load() > byCDC+40, nil
	})
	stopProducer()
	<-produced
	n := last.Load()
	h.waitPublished(int(n)-1, time.Minute)
	t.Logf("%d rows produced (%.0f/s); the CDC path took the aggregate back from sequence %d, %v after the cancel", n-1, float64(n-1)/time.Since(producing).Seconds(), byCDC, back.Round(time.Millisecond))
	var viaPoller int
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE aggregate_seq >= $1 AND (attempts > 0 OR claim_generation > 0)`, byCDC).Scan(&viaPoller); err != nil {
		t.Fatal(err)
	}
	if viaPoller != 0 {
		t.Errorf("%d rows from sequence %d on went through the poller: the aggregate was not handed back for good", viaPoller, byCDC)
	}

	byID, counts := h.streamMsgs()
	if len(byID) != int(n)-1 {
		t.Errorf("the stream holds %d messages, want %d", len(byID), n-1)
	}
	var prevStored uint64
	for i := int64(2); i <= n; i++ {
		id := "busy-" + strconv.FormatInt(i, 10)
		m, ok := byID[id]
		if !ok || counts[id] != 1 {
			t.Fatalf("%s stored %d times", id, counts[id])
		}
		if got := m.Header.Get(wire.HeaderSequence); got != strconv.FormatInt(i, 10) {
			t.Fatalf("%s carries %s %s", id, wire.HeaderSequence, got)
		}
		if m.Sequence <= prevStored {
			t.Fatalf("sequence %d stored at stream sequence %d, before sequence %d's %d", i, m.Sequence, i-1, prevStored)
		}
		prevStored = m.Sequence
	}
}
