package app_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// 20,000 blocked aggregates (G12) made the table metrics time out: the
// blocked-aggregates statement joined every held aggregate back to the
// table and took minutes, so no gauge was ever set (G16). One collection,
// on the observer pool, under the shortest limit it is given (the context
// of max(interval, 5 s)): the gauges are set well within it, the count
// stops at the first store.BlockedLookAt held aggregates.
func TestTableMetricsWithManyBlockedAggregates(t *testing.T) {
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateOutboxDatabase(t)
	obs, err := app.DB{URL: url}.ObserverPool(ctx, "outbox-relay test")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(obs.Close)
	testenv.InsertBlockedAggregates(t, obs, testenv.OutboxTable, 20000)

	m := metrics.New()
	logs := &testenv.LogBuffer{}
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	start := time.Now()
	go func() {
		defer close(done)
		app.TableStats(sctx, store.New(obs, testenv.OutboxTable, store.PolicyMark), m, time.Second, zerolog.New(logs))
	}()
	t.Cleanup(func() { cancel(); <-done })
	const limit = 5 * time.Second
	gauge := func(g prometheus.Gauge) float64 {
		var d dto.Metric
		if err := g.Write(&d); err != nil {
			t.Fatal(err)
		}
		return d.GetGauge().GetValue()
	}
	testenv.WaitFor(t, limit, "the table metrics set", func() (bool, error) {
		return gauge(m.RowsByState.WithLabelValues("failed")) > 0, fmt.Errorf("not yet; logs: %s", logs.String())
	})
	took := time.Since(start)
	if got, want := gauge(m.BlockedAggregates), float64(store.BlockedLookAt); got != want {
		t.Errorf("outbox_relay_blocked_aggregates = %v, want %v (the first %d held aggregates, all blocked)", got, want, store.BlockedLookAt)
	}
	for state, want := range map[string]float64{"failed": 6666, "running": 6667, "scheduled": 6667 + 20000} {
		if got := gauge(m.RowsByState.WithLabelValues(state)); got != want {
			t.Errorf("outbox_relay_rows{state=%q} = %v, want %v", state, got, want)
		}
	}
	// Published is the planner's estimate on a table this size.
	if got := gauge(m.RowsByState.WithLabelValues("published")); got < 19800 || got > 20200 {
		t.Errorf("outbox_relay_rows{state=\"published\"} = %v, want about 20000", got)
	}
	t.Logf("figures: the table metrics of 20,000 blocked aggregates read in %s (limit %s)", took.Round(time.Millisecond), limit)
}
