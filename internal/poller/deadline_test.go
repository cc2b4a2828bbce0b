package poller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/poller"
)

// The poller asks a claimed row's deadline again just before it publishes
// it (G13): here the time it would take a batch to wait after its claim (a
// standby, a lookup, a slow broker) is put on the clock the check reads,
// DeadlineNow, 20 s ahead. The row with 10 s left passed the claim (1 s
// margin) and is given back unpublished, to expire at its deadline; the
// row without a deadline and the one with an hour left are published.
// Without the check the first is published (the chaos run's pg-latency
// window: rows stored 0.4 s past their deadline).
func TestPollerAsksTheDeadlineAgainAtPublish(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, expires_at) VALUES
		('soon', 'k', '{}', 'scheduled', clock_timestamp() + interval '10 seconds'),
		('later', 'k', '{}', 'scheduled', clock_timestamp() + interval '1 hour'),
		('none', 'k', '{}', 'scheduled', NULL)`); err != nil {
		t.Fatal(err)
	}
	// An aggregate's run (ordered): its first row too close, the second
	// waits behind it.
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, expires_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('agg-1', 'k', '{}', 'scheduled', clock_timestamp() + interval '10 seconds', 'order', 'o1', 1),
		('agg-2', 'k', '{}', 'scheduled', NULL, 'order', 'o1', 2)`); err != nil {
		t.Fatal(err)
	}
	for _, ordered := range []bool{true, false} {
		p, _ := f.poller("w", poller.Config{
			Lease: 30 * time.Second, PollInterval: 10 * time.Millisecond, MaxAttempts: 3, Batch: 10, Ordered: ordered,
			DeadlineMargin: time.Second, DeadlineNow: func() time.Time { return time.Now().Add(20 * time.Second) },
		}.WithDefaults())
		if _, err := p.Poll(ctx); err != nil {
			t.Fatal(err)
		}
	}
	var state, note string
	if err := f.pool.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM outbox WHERE work_id = 'soon'`).Scan(&state, &note); err != nil {
		t.Fatal(err)
	}
	if state != "scheduled" || !strings.Contains(note, "--deadline-margin") {
		t.Errorf("soon: %s (%q), want scheduled again, held for its deadline", state, note)
	}
	ids := map[string]int{}
	c, err := f.js.OrderedConsumer(ctx, f.stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for {
		m, err := c.Next(jetstream.FetchMaxWait(500 * time.Millisecond))
		if err != nil {
			break
		}
		ids[m.Headers().Get("Nats-Msg-Id")]++
	}
	if ids["soon"] != 0 || ids["agg-1"] != 0 || ids["later"] != 1 || ids["none"] != 1 {
		t.Errorf("stream holds %v: want later and none once, soon and agg-1 not at all", ids)
	}
}
