package poller_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// slowSink delays every ack by delay, as a broker under pressure would.
type slowSink struct {
	sinks.Sink
	delay time.Duration
}

type slowFuture struct {
	sinks.Future
	delay time.Duration
}

func (s slowSink) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	f, err := s.Sink.Publish(ctx, m)
	if err != nil {
		return nil, err
	}
	return slowFuture{f, s.delay}, nil
}

func (f slowFuture) Wait(ctx context.Context) (sinks.Ack, error) {
	select {
	case <-time.After(f.delay):
	case <-ctx.Done():
		return sinks.Ack{}, ctx.Err()
	}
	return f.Future.Wait(ctx)
}

func slow(d time.Duration) func(sinks.Sink) sinks.Sink {
	return func(s sinks.Sink) sinks.Sink { return slowSink{s, d} }
}

// A batch whose acks take several leases keeps its claim: the worker renews
// the lease, so a second worker polling all along claims nothing, and the
// row is completed by its first claim (generation 1, one attempt).
func TestLeaseRenewedWhileAcksAreSlow(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('slow', 'k', '{}', 'scheduled')`); err != nil {
		t.Fatal(err)
	}
	cfg := poller.Config{Lease: 600 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: time.Millisecond, MaxAttempts: 5, Batch: 10}
	a, am := f.pollerWithSink("a", cfg, slow(2*time.Second))
	b, bm := f.poller("b", cfg)
	done := make(chan error, 1)
	go func() { _, err := a.Poll(ctx); done <- err }()
	// b polls only once a holds the claim: on a loaded machine b's first
	// poll could otherwise come before a's and take the row itself.
	testenv.WaitFor(t, 10*time.Second, "worker a's claim of 'slow'", func() (bool, error) {
		var n int
		err := f.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = 'slow' AND claimed_by = 'a' AND state = 'running'`).Scan(&n)
		return n == 1, err
	})
	stolen := 0
	for polling := true; polling; {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("worker a: %v", err)
			}
			polling = false
		case <-time.After(50 * time.Millisecond):
			n, err := b.Poll(ctx)
			if err != nil {
				t.Fatalf("worker b: %v", err)
			}
			stolen += n
		}
	}
	var state string
	var gen int64
	var attempts int
	if err := f.pool.QueryRow(ctx, `SELECT state, claim_generation, attempts FROM outbox WHERE work_id = 'slow'`).Scan(&state, &gen, &attempts); err != nil {
		t.Fatal(err)
	}
	renewals := counter(t, am.LeaseRenewals)
	t.Logf("state %s, generation %d, attempts %d, renewals %v, claims by b %d", state, gen, attempts, renewals, stolen)
	if state != "published" || gen != 1 || attempts != 1 || stolen != 0 {
		t.Errorf("got state %s generation %d attempts %d with %d claims by b; want published, 1, 1, 0", state, gen, attempts, stolen)
	}
	if renewals < 2 || counter(t, bm.Claims) != 0 {
		t.Errorf("renewals %v (want at least 2 over a 2s wait with a 600ms lease), claims by b %v", renewals, counter(t, bm.Claims))
	}
}

// A worker whose claim was taken over while it waited (its lease expired
// on the database clock, another worker reclaimed the row at generation 2
// and completed it) learns it at its next renewal: the renewal matches zero
// rows, is counted as stale, and the worker abandons the batch without
// touching the row.
func TestRenewalFindsClaimGone(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('taken', 'k', '{}', 'scheduled')`); err != nil {
		t.Fatal(err)
	}
	cfg := poller.Config{Lease: 900 * time.Millisecond, BackoffMin: time.Millisecond, BackoffMax: time.Millisecond, MaxAttempts: 5, Batch: 10}
	a, am := f.pollerWithSink("a", cfg, slow(3*time.Second))
	b, _ := f.poller("b", cfg)
	done := make(chan error, 1)
	go func() { _, err := a.Poll(ctx); done <- err }()
	// Wait for a's claim, then expire its lease as a stall past the lease
	// would. The UPDATE must hit a's claim: otherwise b's claim below would
	// not race a live worker.
	testenv.WaitFor(t, 10*time.Second, "worker a's claim of 'taken'", func() (bool, error) {
		var n int
		err := f.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = 'taken' AND claimed_by = 'a' AND state = 'running'`).Scan(&n)
		return n == 1, err
	})
	tag, err := f.pool.Exec(ctx, `UPDATE outbox SET lease_until = clock_timestamp() - interval '1 millisecond' WHERE work_id = 'taken' AND claimed_by = 'a' AND state = 'running'`)
	if err != nil {
		t.Fatal(err)
	}
	if tag.RowsAffected() != 1 {
		t.Fatalf("expiring a's lease changed %d rows, want 1 (a's running claim)", tag.RowsAffected())
	}
	if n, err := b.Poll(ctx); err != nil || n != 1 {
		t.Fatalf("worker b poll: %d claimed, %v; want 1", n, err)
	}
	var seqB int64
	if err := f.pool.QueryRow(ctx, `SELECT stream_seq FROM outbox WHERE work_id = 'taken' AND state = 'published' AND claim_generation = 2`).Scan(&seqB); err != nil {
		t.Fatalf("row not completed by b's claim: %v", err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("worker a: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("worker a did not give up its batch")
	}
	var state string
	var gen, seq int64
	if err := f.pool.QueryRow(ctx, `SELECT state, claim_generation, stream_seq FROM outbox WHERE work_id = 'taken'`).Scan(&state, &gen, &seq); err != nil {
		t.Fatal(err)
	}
	if state != "published" || gen != 2 || seq != seqB {
		t.Errorf("row after a gave up: %s generation %d seq %d; want published, 2, %d", state, gen, seq, seqB)
	}
	if n := counter(t, am.StaleCompletions.WithLabelValues("renew")); n != 1 {
		t.Errorf("stale renewals counted %v, want 1", n)
	}
	if n := counter(t, am.Published.WithLabelValues("poller", "ok")) + counter(t, am.Published.WithLabelValues("poller", "duplicate")); n != 0 {
		t.Errorf("worker a recorded %v acks after abandoning its batch, want 0", n)
	}
}

// A database outage makes every poll fail; the log carries a few lines per
// half minute, not one per poll.
func TestPollFailuresAreRateLimited(t *testing.T) {
	pool, err := pgxpool.New(context.Background(), "postgres://nobody@127.0.0.1:1/none?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var buf testenv.LogBuffer
	p := poller.New(poller.Config{WorkerID: "w", Lease: time.Second, PollInterval: 10 * time.Millisecond, Batch: 1},
		store.New(pool, table, store.PolicyMark), nil, zerolog.New(&buf), metrics.New())
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if err := p.Run(ctx); err != nil {
		t.Fatal(err)
	}
	lines := strings.Count(buf.String(), "poll failed")
	t.Logf("%d poll-failure lines in 1.5s", lines)
	if lines < 1 || lines > 5 {
		t.Errorf("%d poll-failure lines, want between 1 and 5", lines)
	}
}
