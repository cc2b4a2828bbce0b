package relay_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// harness is one relay running in this process against real servers.
type harness struct {
	t       testing.TB
	dbURL   string
	natsURL string
	opts    app.Options
	pool    *pgxpool.Pool
	nc      *nats.Conn
	js      jetstream.JetStream
	// logs, when set, receives the relay's log lines too.
	logs io.Writer

	mu     sync.Mutex
	relay  *relay.Relay
	cancel context.CancelFunc
	done   chan error
}

type setup struct {
	dbURL, natsURL        string
	stream, subjectPrefix string
}

// newHarness migrates a fresh table and returns a harness; start runs the
// relay.
func newHarness(t testing.TB, s setup) *harness {
	t.Helper()
	h := &harness{t: t, dbURL: s.dbURL, natsURL: s.natsURL}
	h.opts = app.Options{
		DatabaseURL:      s.dbURL,
		NATSURL:          s.natsURL,
		Table:            testenv.OutboxTable,
		Slot:             slotFor(t),
		Publication:      "outbox_relay",
		Stream:           s.stream,
		SubjectPrefix:    s.subjectPrefix,
		Policy:           store.PolicyMark,
		DuplicateWindow:  2 * time.Minute,
		AckTimeout:       2 * time.Second,
		MaxInFlight:      256,
		MaxInFlightBytes: 1 << 20,
		StatusInterval:   200 * time.Millisecond,
		DrainTimeout:     5 * time.Second,
		PollInterval:     100 * time.Millisecond,
		BackoffMin:       10 * time.Millisecond,
		BackoffMax:       50 * time.Millisecond,
		Lease:            5 * time.Second,
	}
	fx := testenv.NewFixtureOn(t, s.dbURL, s.natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	h.pool, h.nc, h.js = fx.Pool, fx.NC, fx.JS
	return h
}

func sharedSetup(t testing.TB) setup {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	return setup{dbURL: env.PG.CreateDatabase(t), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix}
}

func (h *harness) start() {
	h.t.Helper()
	done := h.launch()
	testenv.WaitFor(h.t, 30*time.Second, "relay streaming", func() (bool, error) {
		select {
		case err := <-done:
			done <- err
			return false, fmt.Errorf("relay exited: %v", err)
		default:
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.relay != nil && h.relay.Role() == relay.RoleActive, nil
	})
}

// launch starts the relay without waiting for it to stream.
func (h *harness) launch() chan error {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	o := h.opts
	o.Started = func(r *relay.Relay) { h.mu.Lock(); h.relay = r; h.mu.Unlock() }
	w := io.Writer(zerolog.NewTestWriter(h.t))
	if h.logs != nil {
		w = io.MultiWriter(w, h.logs)
	}
	log := zerolog.New(w).Level(zerolog.InfoLevel).With().Timestamp().Logger()
	go func() { done <- app.Run(ctx, o, log) }()
	h.mu.Lock()
	h.cancel, h.done = cancel, done
	h.mu.Unlock()
	h.t.Cleanup(h.stop)
	return done
}

// stop shuts the relay down gracefully and returns what Run returned.
func (h *harness) stop() {
	h.mu.Lock()
	cancel, done := h.cancel, h.done
	h.cancel, h.done = nil, nil
	h.mu.Unlock()
	if cancel == nil {
		return
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			h.t.Errorf("relay returned %v", err)
		}
	case <-time.After(30 * time.Second):
		h.t.Errorf("relay did not stop within 30s")
	}
}

func (h *harness) exec(sql string, args ...any) {
	h.t.Helper()
	if _, err := h.pool.Exec(context.Background(), sql, args...); err != nil {
		h.t.Fatalf("%s: %v", sql, err)
	}
}

// insertRows commits n rows named prefix-i in transactions of perTx rows.
func (h *harness) insertRows(prefix string, n, perTx int) []string {
	h.t.Helper()
	ctx := context.Background()
	var ids []string
	for i := 0; i < n; i += perTx {
		tx, err := h.pool.Begin(ctx)
		if err != nil {
			h.t.Fatalf("begin: %v", err)
		}
		for j := i; j < min(n, i+perTx); j++ {
			id := fmt.Sprintf("%s-%d", prefix, j)
			if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'thing_happened', $2)`,
				id, fmt.Sprintf(`{"n": %d}`, j)); err != nil {
				h.t.Fatalf("insert %s: %v", id, err)
			}
			ids = append(ids, id)
		}
		if err := tx.Commit(ctx); err != nil {
			h.t.Fatalf("commit: %v", err)
		}
	}
	return ids
}

// streamMsgs reads every message of the stream, keyed by Nats-Msg-Id, with
// the number of times each ID is stored.
func (h *harness) streamMsgs() (byID map[string]*jetstream.RawStreamMsg, counts map[string]int) {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	st, err := h.js.Stream(ctx, h.opts.Stream)
	if err != nil {
		h.t.Fatalf("stream %s: %v", h.opts.Stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	byID, counts = map[string]*jetstream.RawStreamMsg{}, map[string]int{}
	if info.State.Msgs == 0 {
		return
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		h.t.Fatal(err)
	}
	for got := uint64(0); got < info.State.Msgs; {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			h.t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				h.t.Fatal(err)
			}
			id := m.Headers().Get(jetstream.MsgIDHeader)
			counts[id]++
			byID[id] = &jetstream.RawStreamMsg{Subject: m.Subject(), Sequence: md.Sequence.Stream, Header: m.Headers(), Data: m.Data()}
			n++
		}
		if batch.Error() != nil && !errors.Is(batch.Error(), nats.ErrTimeout) {
			h.t.Fatal(batch.Error())
		}
		if n == 0 {
			h.t.Fatalf("stream %s: read %d of %d messages, then nothing", h.opts.Stream, got, info.State.Msgs)
		}
		got += uint64(n)
	}
	return byID, counts
}

// streamCount is the number of messages the stream holds. It fails the test
// when it cannot tell: a 0 read from an error would pass for "nothing
// published".
func (h *harness) streamCount() uint64 {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := h.js.Stream(ctx, h.opts.Stream)
	if err != nil {
		h.t.Fatalf("count the messages of stream %s: %v", h.opts.Stream, err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		h.t.Fatalf("count the messages of stream %s: %v", h.opts.Stream, err)
	}
	return info.State.Msgs
}

// countState counts the rows in state. With --on-publish none a row the
// CDC path published stays 'ready', and the newest watermark says it was
// published (G17): it counts as published, not as ready. The condition is
// written out here rather than taken from the store, so that the tests
// check the store's reading of the watermark against their own.
func (h *harness) countState(state string) int {
	q := `SELECT count(*) FROM outbox WHERE state = $1`
	if h.opts.Policy == store.PolicyNone {
		switch state {
		case "published":
			q = `SELECT count(*) FROM outbox o WHERE o.state = $1 OR (o.state = 'ready' AND ` + coveredSQL + `)`
		case "ready":
			q = `SELECT count(*) FROM outbox o WHERE o.state = $1 AND NOT ` + coveredSQL
		}
	}
	var n int
	if err := h.pool.QueryRow(context.Background(), q, state).Scan(&n); err != nil {
		return -1
	}
	return n
}

// coveredSQL: the row o's transaction is finished in the newest watermark
// recorded on this cluster.
const coveredSQL = `coalesce(pg_visible_in_snapshot(o.xact_id, (SELECT watermark_snapshot FROM outbox_slots
	WHERE watermark_lsn IS NOT NULL AND watermark_system_identifier = (SELECT system_identifier FROM pg_control_system())
	ORDER BY watermark_lsn DESC LIMIT 1)), false)`

// waitPublished waits until n rows are published.
func (h *harness) waitPublished(n int, timeout time.Duration) {
	h.t.Helper()
	testenv.WaitFor(h.t, timeout, fmt.Sprintf("%d rows published", n), func() (bool, error) {
		got := h.countState("published")
		return got == n, fmt.Errorf("%d published, stream holds %d", got, h.streamCount())
	})
}

// slotConfirmed reads the slot's confirmed_flush_lsn and how far the server's
// WAL is ahead of it.
func (h *harness) slotConfirmed() (lsn string, lag int64) {
	h.t.Helper()
	err := h.pool.QueryRow(context.Background(), `SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, h.opts.Slot).Scan(&lsn, &lag)
	if err != nil {
		h.t.Fatalf("read slot: %v", err)
	}
	return lsn, lag
}

// assertExactlyOnce checks that every id is stored once and nothing else is.
func (h *harness) assertExactlyOnce(ids []string) {
	h.t.Helper()
	_, counts := h.streamMsgs()
	lost, dups := 0, 0
	for _, id := range ids {
		switch c := counts[id]; {
		case c == 0:
			lost++
		case c > 1:
			dups += c - 1
		}
	}
	extra := len(counts) - len(ids) + lost
	h.t.Logf("rows %d, stream ids %d, lost %d, stored duplicates %d, unexpected %d", len(ids), len(counts), lost, dups, extra)
	if lost != 0 || dups != 0 || extra != 0 {
		h.t.Fatalf("lost=%d duplicates=%d unexpected=%d, want all 0", lost, dups, extra)
	}
}

// slotFor is a test's slot name: slots are the cluster's, and every test
// has a database of its own on the shared server, so each test (and
// subtest) has a slot of its own too, and may run beside the others
// (parallel). The harnesses of one test share it, as instances of one
// relay do.
func slotFor(t testing.TB) string {
	sum := sha256.Sum256([]byte(t.Name()))
	return "outbox_relay_" + hex.EncodeToString(sum[:6])
}

// parallel lets a test run beside the package's other parallel tests:
// every harness has its test's slot (slotFor) unless one was named, then
// t.Parallel.
func parallel(t *testing.T, hs ...*harness) {
	t.Helper()
	for _, h := range hs {
		if h.opts.Slot == "" {
			h.opts.Slot = slotFor(t)
		}
	}
	t.Parallel()
}

// shiftedHarness is a harness on a PostgreSQL of its own whose clock runs
// offset from this host's (libfaketime), checked before it is returned;
// the shared nats-server, a stream of its own.
func shiftedHarness(t *testing.T, offset time.Duration) *harness {
	t.Helper()
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{ClockOffset: offset})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.CreateDatabase(t), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	if skew := h.dbNow().Sub(time.Now()); (skew - offset).Abs() > 10*time.Second {
		t.Fatalf("PostgreSQL's clock is %s from the host's, want about %s", skew, offset)
	}
	return h
}
