package poller_test

import (
	"context"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/standby"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// A stop (SIGTERM) while a claimed batch waits for a standby that is
// behind (--standby-slot, G14): the wait ends with the caller's context,
// the batch is abandoned and its claims given back. Nothing was published,
// so nothing is lost, and the rows are claimable at once: once the standby
// is back, a new poller publishes each of them once. Before, the wait ran
// under a context that never ended while its leases were renewed, and Run
// did not return until the standby caught up.
func TestStopWhileWaitingForStandby(t *testing.T) {
	const rows = 5
	const lease = 3 * time.Second
	ctx := context.Background()
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	const slot = "poller_standby"
	sb, err := pg.StartStandby(testenv.StandbyOptions{Slot: slot})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sb.Close)
	f := newFixtureOn(t, pg.CreateDatabase(t))
	newPoller := func(id string) *poller.Poller {
		m := metrics.New()
		gate := standby.New(f.pool, []string{slot}, zerolog.New(zerolog.NewTestWriter(t)), m)
		p, _ := f.poller(id, poller.Config{
			Lease: lease, PollInterval: 50 * time.Millisecond, MaxAttempts: 5,
			Standby: gate,
			WALPosition: func(ctx context.Context) (replication.LSN, error) {
				return replication.CurrentFlushLSN(ctx, f.pool)
			},
		})
		return p
	}

	// The standby stops: its slot stays where it flushed, and everything
	// committed from here on is not on it.
	if err := sb.Stop("fast"); err != nil {
		t.Fatal(err)
	}
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
		SELECT 'sb-' || g, 'k', jsonb_build_object('n', g), 'scheduled' FROM generate_series(1, $1) g`, rows); err != nil {
		t.Fatal(err)
	}
	p := newPoller("stopping")
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- p.Run(runCtx) }()
	// Claimed batches wait for the standby (the pipeline's worth of them;
	// rows due a moment later wait unclaimed behind them).
	var claimed int
	testenv.WaitFor(t, 30*time.Second, "the poller claimed rows", func() (bool, error) {
		var err error
		claimed, err = f.count(`state = 'running'`)
		return claimed > 0, err
	})
	// Well past a lease: the batches wait, renewing their leases.
	time.Sleep(lease + lease/2)
	if n, err := f.count(`state = 'running' AND claimed_by = 'stopping'`); err != nil || n < claimed {
		t.Fatalf("%d rows running (%v) after a lease while the standby is behind, want at least %d (still claimed, waiting)", n, err, claimed)
	}
	f.wantStreamMsgs(0)

	cancel()
	start := time.Now()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Run returned %v, want nil on cancel", err)
		}
	case <-time.After(lease):
		t.Fatalf("Run still waits for the standby %v after its context ended, want it to abandon the batch", lease)
	}
	t.Logf("Run returned %v after the cancel", time.Since(start).Round(time.Millisecond))
	f.wantStreamMsgs(0)
	if n, err := f.count(`state = 'scheduled' AND claimed_by IS NULL AND attempts = 0`); err != nil || n != rows {
		t.Fatalf("%d rows given back unclaimed with no attempt counted (%v), want %d", n, err, rows)
	}

	// Claimable at once (not after a lease): the standby comes back and a
	// new poller publishes each row once.
	if err := sb.Start(); err != nil {
		t.Fatal(err)
	}
	stop := run(t, newPoller("after"))
	f.waitPublished(rows)
	stop()
	f.wantStreamMsgs(rows)
}
