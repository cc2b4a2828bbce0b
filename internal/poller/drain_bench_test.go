package poller_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BenchmarkDrain drains a backlog of scheduled rows (200 B payloads,
// committed 100 per transaction and never analyzed, like outbox-bench's
// poller-backlog case, without the CDC path beside it) with one worker, in
// one batch at a time and pipelined. It reports msg/s:
//
//	go test -run '^$' -bench Drain -benchtime 60000x ./internal/poller/
func BenchmarkDrain(b *testing.B) {
	for _, pipeline := range []int{1, poller.DefaultPipeline} {
		b.Run(fmt.Sprintf("pipeline=%d", pipeline), func(b *testing.B) {
			ctx := context.Background()
			f := newFixture(b)
			rows := max(b.N, 1000)
			for i := 0; i < rows; i += 100 {
				if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
					SELECT 'w' || g, 'bench', jsonb_build_object('n', g, 'pad', repeat('x', 180)), 'scheduled'
					FROM generate_series($1::int, $2::int) g`, i+1, min(i+100, rows)); err != nil {
					b.Fatal(err)
				}
			}
			cfg := poller.Config{PollInterval: 100 * time.Millisecond, Pipeline: pipeline}.WithDefaults()
			p, m := f.poller("bench", cfg)
			b.ResetTimer()
			start := time.Now()
			stop := run(b, p)
			// Counting the table's rows every few ms would cost the server
			// more than the drain: wait for the acks in-process, then for
			// the last completions through the poll index.
			for counter(b, m.Published.WithLabelValues("poller", "ok")) < float64(rows) {
				time.Sleep(10 * time.Millisecond)
			}
			testenv.WaitFor(b, time.Minute, "every row completed", func() (bool, error) {
				n, err := f.count(`poll_at IS NOT NULL`)
				return n == 0, err
			})
			el := time.Since(start)
			stop()
			b.ReportMetric(float64(rows)/el.Seconds(), "msg/s")
		})
	}
}

// BenchmarkDrainReleasedAggregate measures how fast a released aggregate
// drains (G12): b.N rows of one aggregate held behind a dead-lettered row
// (as the CDC path leaves them: 'scheduled', due, held), released by
// cancelling that row, with one worker at the default batch and pipeline.
// The poller publishes the aggregate's rows in sequence order, one in
// flight at a time. It reports rows/s from the cancel to the last
// completion:
//
//	go test -run '^$' -bench DrainReleasedAggregate -benchtime 10000x ./internal/poller/
func BenchmarkDrainReleasedAggregate(b *testing.B) {
	ctx := context.Background()
	f := newFixture(b)
	rows := max(b.N, 100)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('agg-1', 'bench', '{}', 'failed', 10, 'rejected: max_msg_size: too big', 'order', 'agg', 1)`); err != nil {
		b.Fatal(err)
	}
	f.insertHeld("agg", 2, rows+1)
	cfg := poller.Config{Ordered: true}.WithDefaults()
	p, m := f.poller("bench", cfg)
	stop := run(b, p)
	st := store.New(f.pool, table, store.PolicyMark)
	b.ResetTimer()
	start := time.Now()
	if _, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"agg-1"}}, By: "bench", Reason: "release"}); err != nil {
		b.Fatal(err)
	}
	for counter(b, m.Published.WithLabelValues("poller", "ok")) < float64(rows) {
		time.Sleep(10 * time.Millisecond)
	}
	testenv.WaitFor(b, time.Minute, "every row completed", func() (bool, error) {
		n, err := f.count(`poll_at IS NOT NULL`)
		return n == 0, err
	})
	el := time.Since(start)
	stop()
	b.ReportMetric(float64(rows)/el.Seconds(), "rows/s")
	order, _ := f.streamOrder()
	f.wantInOrder(order, "agg", 2, rows+1)
}
