package poller_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func TestMain(m *testing.M) { testenv.Main(m) }

var table = testenv.OutboxTable

type fixture struct {
	t      testing.TB
	dbURL  string
	prefix string
	stream string
	pool   *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	return newFixtureOn(t, testenv.Shared(t).PG.CreateDatabase(t))
}

// newFixtureOn is newFixture on the database at dbURL.
func newFixtureOn(t testing.TB, dbURL string) *fixture {
	t.Helper()
	fx := testenv.NewFixtureOn(t, dbURL, testenv.Shared(t).NATS.URL())
	f := &fixture{t: t, dbURL: dbURL, prefix: fx.Prefix, stream: fx.Stream, pool: fx.Pool, nc: fx.NC, js: fx.JS}
	if _, _, err := natssink.EnsureStream(context.Background(), f.js, natssink.StreamConfig{Name: f.stream, SubjectPrefix: f.prefix, DuplicateWindow: 2 * time.Minute}); err != nil {
		t.Fatal(err)
	}
	return f
}

// poller builds a worker with its own pool and JetStream context.
func (f *fixture) poller(id string, cfg poller.Config) (*poller.Poller, *metrics.Metrics) {
	f.t.Helper()
	return f.pollerWithSink(id, cfg, nil)
}

// pollerWithSink is poller with the JetStream sink wrapped by wrap.
func (f *fixture) pollerWithSink(id string, cfg poller.Config, wrap func(sinks.Sink) sinks.Sink) (*poller.Poller, *metrics.Metrics) {
	f.t.Helper()
	pool, err := pgxpool.New(context.Background(), f.dbURL)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(pool.Close)
	js, err := jetstream.New(f.nc, jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		f.t.Fatal(err)
	}
	cfg.WorkerID, cfg.SubjectPrefix, cfg.Connected = id, f.prefix, f.nc.IsConnected
	m := metrics.New()
	log := zerolog.New(zerolog.NewTestWriter(f.t)).Level(zerolog.WarnLevel)
	var sink sinks.Sink = natssink.New(js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	if wrap != nil {
		sink = wrap(sink)
	}
	return poller.New(cfg, store.New(pool, table, store.PolicyMark), sink, log, m), m
}

// run starts p and returns a stop function that cancels it and checks that
// Run returned nil.
func run(t testing.TB, ps ...*poller.Poller) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	errs := make(chan error, len(ps))
	for _, p := range ps {
		go func() { errs <- p.Run(ctx) }()
	}
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			for range ps {
				if err := <-errs; err != nil {
					t.Errorf("poller Run returned %v, want nil on cancel", err)
				}
			}
		})
	}
	t.Cleanup(stop)
	return stop
}

func counter(t testing.TB, c prometheus.Counter) float64 {
	t.Helper()
	var d dto.Metric
	if err := c.Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.GetCounter().GetValue()
}

func (f *fixture) count(where string) (int, error) {
	var n int
	err := f.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE `+where).Scan(&n)
	return n, err
}

// Eight workers race over 5,000 due rows: every row is published exactly
// once, by exactly one claim.
func TestPollersRace(t *testing.T) {
	const rows, workers = 5000, 8
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state)
		SELECT 'w' || g, 'race', jsonb_build_object('n', g), 'scheduled' FROM generate_series(1, $1) g`, rows); err != nil {
		t.Fatal(err)
	}
	var ps []*poller.Poller
	var ms []*metrics.Metrics
	for i := range workers {
		p, m := f.poller(fmt.Sprintf("worker-%d", i), poller.Config{
			Lease: 30 * time.Second, PollInterval: 10 * time.Millisecond, BackoffMin: 10 * time.Millisecond,
			BackoffMax: 100 * time.Millisecond, MaxAttempts: 10, Batch: 50,
		})
		ps, ms = append(ps, p), append(ms, m)
	}
	start := time.Now()
	stop := run(t, ps...)
	testenv.WaitFor(t, 90*time.Second, "every row published", func() (bool, error) {
		n, err := f.count(`state = 'published'`)
		return n == rows, err
	})
	elapsed := time.Since(start)
	stop()

	var claims float64
	var perWorker []int
	for _, m := range ms {
		c := counter(t, m.Claims)
		claims += c
		perWorker = append(perWorker, int(c))
		if s := counter(t, m.StaleCompletions.WithLabelValues("complete")); s != 0 {
			t.Errorf("stale completions: %v", s)
		}
	}
	t.Logf("%d rows by %d workers in %v; claims per worker %v", rows, workers, elapsed, perWorker)
	if claims != rows {
		t.Errorf("claims = %v, want %d (each row claimed once)", claims, rows)
	}
	if n, err := f.count(`claim_generation <> 1 OR attempts <> 1 OR stream_seq IS NULL OR claimed_by IS NOT NULL OR lease_until IS NOT NULL`); err != nil || n != 0 {
		t.Fatalf("%d rows not claimed exactly once or left with a claim (err %v)", n, err)
	}
	seqByID := map[string]uint64{}
	dbRows, err := f.pool.Query(ctx, `SELECT work_id, stream_seq FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	for dbRows.Next() {
		var id string
		var seq int64
		if err := dbRows.Scan(&id, &seq); err != nil {
			t.Fatal(err)
		}
		seqByID[id] = uint64(seq)
	}
	if err := dbRows.Err(); err != nil {
		t.Fatal(err)
	}

	// The stream holds each work_id once, from generation 1, attempt 1, at
	// the sequence the row recorded.
	cons, err := f.js.OrderedConsumer(ctx, f.stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]int{}
	for len(seen) < rows {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		got := 0
		for msg := range batch.Messages() {
			got++
			id := msg.Headers().Get(jetstream.MsgIDHeader)
			seen[id]++
			if g := msg.Headers().Get(wire.HeaderClaimGeneration); g != "1" {
				t.Errorf("%s: %s = %q, want 1", id, wire.HeaderClaimGeneration, g)
			}
			if a := msg.Headers().Get(wire.HeaderAttempt); a != "1" {
				t.Errorf("%s: %s = %q, want 1", id, wire.HeaderAttempt, a)
			}
			md, err := msg.Metadata()
			if err != nil {
				t.Fatal(err)
			}
			if seqByID[id] != md.Sequence.Stream {
				t.Errorf("%s: stream sequence %d, row recorded %d", id, md.Sequence.Stream, seqByID[id])
			}
		}
		if batch.Error() != nil {
			t.Fatal(batch.Error())
		}
		if got == 0 {
			break
		}
	}
	info, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	si, err := info.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if si.State.Msgs != rows || len(seen) != rows {
		t.Fatalf("stream holds %d messages, %d distinct IDs; want %d", si.State.Msgs, len(seen), rows)
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("%s stored %d times", id, n)
		}
	}
}

// A row whose subject no stream binds is rejected on every attempt and
// dead-lettered after MaxAttempts, without holding up the rows behind it.
func TestNoStreamRowFails(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload, state) VALUES
		('bad', 'k', 'nostream.x', '{}', 'scheduled'),
		('good', 'k', NULL, '{}', 'scheduled')`); err != nil {
		t.Fatal(err)
	}
	p, m := f.poller("w", poller.Config{
		Lease: 30 * time.Second, PollInterval: 10 * time.Millisecond, BackoffMin: 10 * time.Millisecond,
		BackoffMax: 10 * time.Millisecond, MaxAttempts: 3, Batch: 10,
	})
	stop := run(t, p)
	testenv.WaitFor(t, 30*time.Second, "the bad row failed and the good one published", func() (bool, error) {
		n, err := f.count(`(work_id = 'bad' AND state = 'failed') OR (work_id = 'good' AND state = 'published')`)
		return n == 2, err
	})
	stop()
	var attempts int
	var gen int64
	var lastErr string
	if err := f.pool.QueryRow(ctx, `SELECT attempts, claim_generation, last_error FROM outbox WHERE work_id = 'bad'`).Scan(&attempts, &gen, &lastErr); err != nil {
		t.Fatal(err)
	}
	t.Logf("bad: attempts %d, generation %d, last_error %q", attempts, gen, lastErr)
	if attempts != 3 || gen != 3 || !strings.HasPrefix(lastErr, "rejected: no_stream") {
		t.Fatalf("bad row: attempts %d generation %d last_error %q; want 3, 3, rejected: no_stream...", attempts, gen, lastErr)
	}
	if n := counter(t, m.Failures.WithLabelValues("rejected", "no_stream")); n != 3 {
		t.Errorf("failures{rejected,no_stream} = %v, want 3", n)
	}
	if n := counter(t, m.Published.WithLabelValues("poller", "ok")); n != 1 {
		t.Errorf("published{poller,ok} = %v, want 1", n)
	}
}

// A row reclaimed from an expired lease that already used its last attempt
// is failed as uncertain without another publish.
func TestExpiredLeaseAtMaxAttemptsFails(t *testing.T) {
	ctx := context.Background()
	f := newFixture(t)
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, claim_generation, claimed_by, lease_until)
		VALUES ('gone', 'k', '{}', 'running', 3, 3, 'dead-worker', clock_timestamp() - interval '1 second')`); err != nil {
		t.Fatal(err)
	}
	p, m := f.poller("w", poller.Config{Lease: 30 * time.Second, BackoffMin: time.Millisecond, BackoffMax: time.Millisecond, MaxAttempts: 3, Batch: 10})
	n, err := p.Poll(ctx)
	if err != nil || n != 1 {
		t.Fatalf("poll: %d, %v; want 1 claimed", n, err)
	}
	var state, lastErr string
	var attempts int
	if err := f.pool.QueryRow(ctx, `SELECT state, last_error, attempts FROM outbox WHERE work_id = 'gone'`).Scan(&state, &lastErr, &attempts); err != nil {
		t.Fatal(err)
	}
	if state != "failed" || !strings.HasPrefix(lastErr, "uncertain: lease expired after 3 attempts") || attempts != 4 {
		t.Fatalf("gone: %s %q attempts %d", state, lastErr, attempts)
	}
	if c := counter(t, m.Published.WithLabelValues("poller", "ok")); c != 0 {
		t.Errorf("published %v messages, want none", c)
	}
	si, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := si.Info(ctx); err != nil || info.State.Msgs != 0 {
		t.Fatalf("stream holds %v messages (err %v), want 0", info.State.Msgs, err)
	}
}
