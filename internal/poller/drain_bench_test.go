package poller_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/poller"
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
