package pipeline

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// relayBinary builds cmd/outbox-relay once per test binary, with -race when
// the tests run with it.
func relayBinary() (string, error) { return testenv.RelayBinary(raceEnabled) }

func mustBinary(t *testing.T) string {
	t.Helper()
	bin, err := relayBinary()
	if err != nil {
		t.Fatalf("build outbox-relay: %v", err)
	}
	return bin
}

// cleanEnv drops OUTBOX_RELAY_* so a developer's settings cannot leak in.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			env = append(env, kv)
		}
	}
	return env
}

func runOnce(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, mustBinary(t), args...)
	cmd.Env = cleanEnv()
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("outbox-relay %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// relayProc runs `outbox-relay run`, appending every start to one log.
type relayProc struct {
	t       *testing.T
	args    []string
	logPath string
	cmd     *exec.Cmd
	done    chan struct{}
}

func (r *relayProc) start() {
	r.t.Helper()
	f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatal(err)
	}
	defer f.Close()
	fmt.Fprintf(f, "=== pipeline: start at %s ===\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(mustBinary(r.t), append([]string{"run"}, r.args...)...)
	cmd.Env = cleanEnv()
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		r.t.Fatalf("start relay: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	r.cmd, r.done = cmd, done
}

func (r *relayProc) kill() {
	r.t.Helper()
	select {
	case <-r.done:
		r.t.Fatalf("relay exited on its own before the kill; log %s:\n%s", r.logPath, r.tail())
	default:
	}
	if err := r.cmd.Process.Kill(); err != nil {
		r.t.Fatalf("kill relay: %v", err)
	}
	<-r.done
}

func (r *relayProc) tail() string {
	b, _ := os.ReadFile(r.logPath)
	if len(b) > 6000 {
		b = b[len(b)-6000:]
	}
	return string(b)
}

// TestExactlyOnceEffectsAcrossRelayKills: 10,000 messages enqueued by four
// producers (with rolled-back transactions mixed in), the relay killed with
// SIGKILL twice under load and restarted, and two consumer instances with
// the inbox. The stream's duplicate window is 1s, shorter than a restart, so
// the relay's repeats after a kill reach the consumers as real duplicates.
// Every committed message has exactly one effect; nothing rolled back has
// any.
func TestExactlyOnceEffectsAcrossRelayKills(t *testing.T) {
	const (
		total     = 10000
		producers = 4
		maxTxRows = 40
		maxPause  = 40 * time.Millisecond
	)
	began := time.Now()
	env := testenv.Shared(t)
	outboxDB, consumerDB := env.PG.CreateDatabase(t), env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot := fmt.Sprintf("pipeline_%d", os.Getpid())
	ctx := context.Background()

	runOnce(t, "migrate", "--database-url", outboxDB)
	out := runOnce(t, "migrate", "--database-url", consumerDB, "--inbox", "inbox")
	t.Logf("migrate --inbox: %s", strings.TrimSpace(out))

	prodPool, err := pgxpool.New(ctx, outboxDB)
	if err != nil {
		t.Fatal(err)
	}
	defer prodPool.Close()
	if _, err := prodPool.Exec(ctx, `CREATE TABLE orders (id bigint PRIMARY KEY, total numeric NOT NULL)`); err != nil {
		t.Fatal(err)
	}

	r := &relayProc{t: t, logPath: filepath.Join(t.TempDir(), "relay.log"), args: []string{
		"--database-url", outboxDB, "--nats-url", env.NATS.URL(), "--slot", slot,
		"--stream", stream, "--subject-prefix", prefix, "--duplicate-window", "1s",
		"--status-interval", "200ms", "--log-format", "json",
	}}
	t.Cleanup(func() {
		if r.cmd != nil {
			select {
			case <-r.done:
			default:
				_ = r.cmd.Process.Kill()
				<-r.done
			}
		}
		b, _ := os.ReadFile(r.logPath)
		for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
			if i := bytes.Index(b, []byte(bad)); i >= 0 {
				t.Errorf("relay log shows %q:\n%s", bad, b[i:min(len(b), i+3000)])
			}
		}
		if t.Failed() {
			t.Logf("relay log %s, tail:\n%s", r.logPath, r.tail())
		}
	})
	r.start()

	nc, err := nats.Connect(env.NATS.URL(), nats.MaxReconnects(-1))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var s jetstream.Stream
	testenv.WaitFor(t, 60*time.Second, "the relay to create the stream", func() (bool, error) {
		s, err = js.Stream(ctx, stream)
		return err == nil, err
	})
	cons, err := s.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable: "fulfilment", AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Second, MaxDeliver: -1, MaxAckPending: 2000,
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pgxExec(ctx, consumerDB, `CREATE TABLE effects (id bigserial PRIMARY KEY, msg_id text NOT NULL, order_id bigint NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	logger := slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	var instances []*inbox.Inbox
	consumeCtx, stopConsuming := context.WithCancel(ctx)
	defer stopConsuming()
	for range 2 {
		pool, err := pgxpool.New(ctx, consumerDB)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		in, err := inbox.New(pool, inbox.Config{Consumer: "fulfilment", Logger: logger, BackoffMin: 50 * time.Millisecond, BackoffMax: time.Second})
		if err != nil {
			t.Fatal(err)
		}
		instances = append(instances, in)
		cc, err := cons.Consume(in.Wrap(consumeCtx, func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
			var p struct {
				OrderID int64 `json:"order_id"`
			}
			if err := json.Unmarshal(msg.Data(), &p); err != nil {
				return fmt.Errorf("%w: payload: %v", inbox.ErrRejected, err)
			}
			_, err := tx.Exec(ctx, `INSERT INTO effects (msg_id, order_id) VALUES ($1, $2)`, msg.Headers().Get(jetstream.MsgIDHeader), p.OrderID)
			return err
		}))
		if err != nil {
			t.Fatal(err)
		}
		defer cc.Stop()
	}

	// Producers: each order and its message in one transaction, one
	// transaction in ten rolled back.
	var (
		committed  atomic.Int64
		nextID     atomic.Int64
		rolledBack sync.Map
		wg         sync.WaitGroup
		prodErr    = make(chan error, producers)
	)
	for p := range producers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), uint64(p)))
			for mine := 0; mine < total/producers; {
				n := min(1+rng.IntN(maxTxRows), total/producers-mine)
				rollback := rng.IntN(10) == 0
				if err := produce(ctx, prodPool, &nextID, n, rollback, &committed, &rolledBack, rng.IntN(2) == 0); err != nil {
					prodErr <- fmt.Errorf("producer %d: %w", p, err)
					return
				}
				if !rollback {
					mine += n
				}
				time.Sleep(time.Duration(rng.Int64N(int64(maxPause))))
			}
		})
	}
	// Two kills under load, each followed by a restart; each kill waits
	// until the running relay has published a share of the load, so it
	// lands mid-stream rather than during startup.
	lastSeq := func() (uint64, error) {
		info, err := s.Info(ctx)
		if err != nil {
			return 0, err
		}
		return info.State.LastSeq, nil
	}
	var sinceStart uint64
	for i, at := range []int64{total / 4, total * 3 / 5} {
		testenv.WaitFor(t, 2*time.Minute, fmt.Sprintf("%d committed rows and %d more published before kill %d", at, total/10, i+1), func() (bool, error) {
			seq, err := lastSeq()
			return err == nil && committed.Load() >= at && seq >= sinceStart+total/10, err
		})
		r.kill()
		t.Logf("kill %d at %d committed rows, %v in", i+1, committed.Load(), time.Since(began).Round(time.Millisecond))
		// Longer than the duplicate window: what the killed relay published
		// but had not confirmed is published again and stored again.
		time.Sleep(1500 * time.Millisecond)
		if sinceStart, err = lastSeq(); err != nil {
			t.Fatal(err)
		}
		r.start()
	}
	wg.Wait()
	close(prodErr)
	for err := range prodErr {
		t.Fatal(err)
	}
	if c := committed.Load(); c != total {
		t.Fatalf("producers committed %d rows, want %d", c, total)
	}
	t.Logf("producers done at %v", time.Since(began).Round(time.Millisecond))

	cpool, err := pgxpool.New(ctx, consumerDB)
	if err != nil {
		t.Fatal(err)
	}
	defer cpool.Close()
	var rows, distinct int
	testenv.WaitFor(t, 3*time.Minute, fmt.Sprintf("%d effects", total), func() (bool, error) {
		if err := cpool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_id) FROM effects`).Scan(&rows, &distinct); err != nil {
			return false, err
		}
		return distinct >= total, fmt.Errorf("%d effect rows, %d distinct", rows, distinct)
	})
	// Everything the relay still republishes (unconfirmed after the last
	// restart) must be consumed before counting for good.
	testenv.WaitFor(t, 2*time.Minute, "consumer caught up with the stream", func() (bool, error) {
		info, err := cons.Info(ctx)
		if err != nil {
			return false, err
		}
		var unpublished int
		if err := prodPool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state <> 'published'`).Scan(&unpublished); err != nil {
			return false, err
		}
		return unpublished == 0 && info.NumPending == 0 && info.NumAckPending == 0,
			fmt.Errorf("unpublished rows %d, consumer pending %d, ack pending %d", unpublished, info.NumPending, info.NumAckPending)
	})
	// A redrive days later publishes rows again, long after the duplicate
	// window: the same Nats-Msg-Id and payload, stored as new messages.
	time.Sleep(1100 * time.Millisecond) // past the window of the last publish
	redriven := republish(t, js, s, 500)
	testenv.WaitFor(t, time.Minute, "consumer to handle the redriven messages", func() (bool, error) {
		info, err := cons.Info(ctx)
		if err != nil {
			return false, err
		}
		return info.NumPending == 0 && info.NumAckPending == 0, fmt.Errorf("pending %d, ack pending %d", info.NumPending, info.NumAckPending)
	})
	if err := cpool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_id) FROM effects`).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != total || distinct != total {
		t.Errorf("effects: %d rows, %d distinct message IDs; want exactly %d of each", rows, distinct, total)
	}
	var ghosts int
	rolledBack.Range(func(k, _ any) bool {
		var n int
		if err := cpool.QueryRow(ctx, `SELECT count(*) FROM effects WHERE msg_id = $1`, k).Scan(&n); err != nil || n != 0 {
			ghosts++
		}
		return true
	})
	if ghosts > 0 {
		t.Errorf("%d rolled-back messages have effects", ghosts)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var st inbox.Stats
	for _, in := range instances {
		s := in.Stats()
		st.Applied += s.Applied
		st.Duplicates += s.Duplicates
		st.Retried += s.Retried
		st.Rejected += s.Rejected
	}
	t.Logf("%d effects (%d distinct) from %d stream messages (duplicate window %v; %d republished by the test); inbox: %d applied, %d duplicates dropped, %d retried, %d rejected; %v in all",
		rows, distinct, info.State.Msgs, info.Config.Duplicates, redriven, st.Applied, st.Duplicates, st.Retried, st.Rejected, time.Since(began).Round(time.Millisecond))
	// Every stored repeat reaches the inbox and is dropped. More drops than
	// stored repeats are redeliveries after AckWait (5 s here, under a
	// loaded CI machine): the same stored message twice, dropped the same
	// way. Fewer would mean a repeat applied or lost.
	if want := uint64(info.State.Msgs) - total; st.Duplicates < want {
		t.Errorf("inbox dropped %d duplicates; the stream holds %d messages beyond the %d distinct", st.Duplicates, want, total)
	} else if st.Duplicates > want {
		t.Logf("inbox dropped %d more duplicates than the stream holds repeats: redeliveries after AckWait", st.Duplicates-want)
	}
	if st.Rejected != 0 {
		t.Errorf("%d messages rejected", st.Rejected)
	}
}

// produce commits (or rolls back) one transaction of n orders, each with its
// message, written with Enqueue or EnqueueBatch.
func produce(ctx context.Context, pool *pgxpool.Pool, nextID *atomic.Int64, n int, rollback bool, committed *atomic.Int64, rolledBack *sync.Map, batch bool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	msgs := make([]outbox.Message, 0, n)
	for range n {
		id := nextID.Add(1)
		if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total) VALUES ($1, 29.00)`, id); err != nil {
			return err
		}
		m := outbox.Message{WorkID: fmt.Sprintf("order-%d-ack", id), Kind: "order.received", Payload: json.RawMessage(fmt.Sprintf(`{"order_id": %d}`, id))}
		if !batch {
			if err := outbox.Enqueue(ctx, tx, m); err != nil {
				return err
			}
		}
		msgs = append(msgs, m)
	}
	if batch {
		if _, err := outbox.EnqueueBatch(ctx, tx, msgs); err != nil {
			return err
		}
	}
	if rollback {
		for _, m := range msgs {
			rolledBack.Store(m.WorkID, true)
		}
		return tx.Rollback(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	committed.Add(int64(n))
	return nil
}

func pgxExec(ctx context.Context, url, sql string) (int64, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, err
	}
	defer conn.Close(ctx)
	tag, err := conn.Exec(ctx, sql)
	return tag.RowsAffected(), err
}

// republish stores again, with the same Nats-Msg-Id and data, n messages
// spread over the stream, as a redrive after the duplicate window would.
func republish(t *testing.T, js jetstream.JetStream, s jetstream.Stream, n int) int {
	t.Helper()
	ctx := context.Background()
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.LastSeq < uint64(n) {
		t.Fatalf("stream has %d messages, fewer than %d", info.State.LastSeq, n)
	}
	step := info.State.LastSeq / uint64(n)
	for i := range uint64(n) {
		m, err := s.GetMsg(ctx, 1+i*step)
		if err != nil {
			t.Fatalf("get message %d: %v", 1+i*step, err)
		}
		msg := &nats.Msg{Subject: m.Subject, Data: m.Data, Header: nats.Header{}}
		msg.Header.Set(jetstream.MsgIDHeader, m.Header.Get(jetstream.MsgIDHeader))
		// nats-server forgets message IDs on a timer that runs once per
		// window, so an ID can be remembered for up to about twice the
		// window: retry a duplicate for a few windows before failing.
		for try := 0; ; try++ {
			ack, err := js.PublishMsg(ctx, msg)
			if err != nil {
				t.Fatalf("republish: %v", err)
			}
			if !ack.Duplicate {
				break
			}
			if try == 10 {
				t.Fatalf("republished %s dropped as a duplicate 10 times over 5 s: the window has not passed", m.Header.Get(jetstream.MsgIDHeader))
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	return n
}
