package relay_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// producer commits rows in the background until stopped, in transactions of
// 1 to 20 rows, and records every committed work ID.
type producer struct {
	mu   sync.Mutex
	ids  []string
	stop chan struct{}
	done chan struct{}
	errs atomic.Int64
}

func startProducer(t *testing.T, dbURL, prefix string, limit int) *producer {
	p := &producer{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		ctx := context.Background()
		var conn *pgx.Conn
		defer func() {
			if conn != nil {
				conn.Close(ctx)
			}
		}()
		for n := 0; n < limit; {
			select {
			case <-p.stop:
				return
			default:
			}
			if conn == nil || conn.IsClosed() {
				c, err := pgx.Connect(ctx, dbURL)
				if err != nil {
					p.errs.Add(1)
					time.Sleep(50 * time.Millisecond) // the database is restarting
					continue
				}
				conn = c
			}
			size := 1 + n%20
			var batch []string
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				for j := 0; j < size; j++ {
					id := fmt.Sprintf("%s-%d", prefix, n+j)
					if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'load', $2)`,
						id, fmt.Sprintf(`{"n": %d}`, n+j)); err != nil {
						return err
					}
					batch = append(batch, id)
				}
				return nil
			})
			if err != nil {
				// An error at COMMIT leaves the outcome unknown; the check
				// below uses the table, not this list, for such rows.
				p.errs.Add(1)
				conn.Close(ctx)
				conn = nil
				n += size // never reuse an ID whose commit may have happened
				continue
			}
			p.mu.Lock()
			p.ids = append(p.ids, batch...)
			p.mu.Unlock()
			n += size
			time.Sleep(2 * time.Millisecond)
		}
	}()
	return p
}

// committed is how many rows the producer has committed so far.
func (p *producer) committed() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ids)
}

func (p *producer) finish() []string {
	close(p.stop)
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.ids...)
}

// committedIDs is the ground truth: every row in the table.
func (h *harness) committedIDs() []string {
	h.t.Helper()
	rows, err := h.pool.Query(context.Background(), `SELECT work_id FROM outbox`)
	if err != nil {
		h.t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		h.t.Fatal(err)
	}
	return ids
}

// dbNow reads the database clock, the one that stamps created_at
// (clock_timestamp() at insert).
func (h *harness) dbNow() time.Time {
	h.t.Helper()
	var now time.Time
	if err := h.pool.QueryRow(context.Background(), `SELECT clock_timestamp()`).Scan(&now); err != nil {
		h.t.Fatalf("read the database clock: %v", err)
	}
	return now
}

// committedBetween counts the rows inserted in [from, to) on the database
// clock: a row stamped after an instant was committed after it.
func (h *harness) committedBetween(from, to time.Time) int {
	h.t.Helper()
	var n int
	if err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE created_at >= $1 AND created_at < $2`, from, to).Scan(&n); err != nil {
		h.t.Fatalf("count rows committed between %v and %v: %v", from, to, err)
	}
	return n
}

// waitCommittedAfter waits until at least n rows were inserted after t: the
// producer is still writing.
func (h *harness) waitCommittedAfter(t time.Time, n int, what string) {
	h.t.Helper()
	testenv.WaitFor(h.t, 30*time.Second, fmt.Sprintf("%d rows committed %s", n, what), func() (bool, error) {
		got := h.committedBetween(t, time.Now().Add(time.Hour))
		return got >= n, fmt.Errorf("%d so far", got)
	})
}

// The broker is killed for longer than the ack timeout while rows stream,
// then restarted: nothing lost, nothing stored twice, every row published.
// The producer must be writing across the fault: rows committed before the
// kill, while the broker was down, and after it came back.
func TestBrokerKilledMidStream(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	h := newHarness(t, setup{dbURL: env.PG.CreateDatabase(t), natsURL: n.URL(), stream: "BROKER", subjectPrefix: "broker."})
	h.opts.AckTimeout = time.Second
	h.start()
	p := startProducer(t, h.dbURL, "b", 1<<30)
	testenv.WaitFor(t, 20*time.Second, "some rows published", func() (bool, error) { return h.countState("published") > 200, nil })
	if err := n.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := h.dbNow()
	// Down for 3 ack timeouts while the producer keeps committing.
	time.Sleep(3 * time.Second)
	h.waitCommittedAfter(killed, 20, "while the broker is down")
	restarting := h.dbNow()
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	back := h.dbNow()
	h.waitCommittedAfter(back, 20, "after the broker came back")
	p.finish()
	var epoch, future time.Time
	future = time.Now().Add(time.Hour)
	before, during, after := h.committedBetween(epoch, killed), h.committedBetween(killed, restarting), h.committedBetween(back, future)
	t.Logf("rows committed before the kill %d, while the broker was down %d, after it came back %d", before, during, after)
	if before == 0 || during == 0 || after == 0 {
		t.Fatalf("the producer was not writing across the fault (%d before, %d during, %d after): the test proves nothing", before, during, after)
	}
	ids := h.committedIDs()
	h.waitPublished(len(ids), 60*time.Second)
	h.assertExactlyOnce(ids)
	t.Logf("broker kill: %d rows committed, producer errors %d", len(ids), p.errs.Load())
}

// PostgreSQL restarted mid-stream, fast and then immediate (crash recovery):
// the relay reconnects and resumes from the slot. The producer must be
// writing across each restart: rows committed before it and after it.
func TestPostgresRestartMidStream(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.start()
	p := startProducer(t, h.dbURL, "p", 1<<30)
	type fault struct {
		mode       string
		down, back time.Time
	}
	var faults []fault
	for _, mode := range []string{"fast", "immediate"} {
		before := h.countState("published")
		testenv.WaitFor(t, 30*time.Second, "progress before restart", func() (bool, error) {
			return h.countState("published") > before+200, nil
		})
		down := h.dbNow()
		if err := pg.Restart(mode); err != nil {
			t.Fatalf("restart %s: %v", mode, err)
		}
		h.pool.Reset()
		back := h.dbNow()
		h.waitCommittedAfter(back, 20, "after the "+mode+" restart")
		faults = append(faults, fault{mode, down, back})
	}
	p.finish()
	var epoch time.Time
	for _, f := range faults {
		before, after := h.committedBetween(epoch, f.down), h.committedBetween(f.back, time.Now().Add(time.Hour))
		t.Logf("%s restart: rows committed before %d, after %d", f.mode, before, after)
		if before == 0 || after == 0 {
			t.Errorf("%s restart: the producer was not writing across it (%d rows before, %d after): the test proves nothing", f.mode, before, after)
		}
		epoch = f.back
	}
	ids := h.committedIDs()
	h.waitPublished(len(ids), 60*time.Second)
	h.assertExactlyOnce(ids)
	t.Logf("postgres restarts: %d rows committed, producer errors %d", len(ids), p.errs.Load())
}

// The visibility trap: with a synchronous standby that does not exist, a
// commit is flushed (so logical decoding streams it) but waits before it
// becomes visible. The relay publishes it, its mark matches zero rows, and
// the checkpoint must not pass it until the row is visible and marked.
func TestStreamedBeforeVisible(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{
		"synchronous_standby_names": "ghost",
		// Everyone but the test's producer commits without waiting.
		"synchronous_commit": "local",
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.start()
	h.insertRows("warm", 1, 1)
	h.waitPublished(1, 20*time.Second)

	ctx := context.Background()
	prod, err := pgx.Connect(ctx, h.dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer prod.Close(ctx)
	var pid int
	if err := prod.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := prod.Exec(ctx, `SET synchronous_commit = on`); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() {
		_, err := prod.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('invisible', 'x', '{"a": 1}')`)
		committed <- err
	}()

	// It streams and is published while its commit still waits.
	testenv.WaitFor(t, 20*time.Second, "the waiting row in the stream", func() (bool, error) {
		return h.streamCount() == 2, nil
	})
	byID, _ := h.streamMsgs()
	commitLSN, err := pglogrepl.ParseLSN(byID["invisible"].Header.Get(wire.HeaderCommitLSN))
	if err != nil {
		t.Fatal(err)
	}
	// Several status intervals pass; the checkpoint must hold before it.
	deadline := time.Now().Add(1500 * time.Millisecond)
	for time.Now().Before(deadline) {
		confirmed, _ := h.slotConfirmed()
		if c, _ := pglogrepl.ParseLSN(confirmed); c > commitLSN {
			t.Fatalf("slot confirmed at %s, past the invisible transaction's commit at %s", confirmed, commitLSN)
		}
		var visible int
		if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = 'invisible'`).Scan(&visible); err != nil {
			t.Fatal(err)
		}
		if visible != 0 {
			t.Fatal("the row became visible while its commit waits: the trap did not arm")
		}
		time.Sleep(100 * time.Millisecond)
	}
	select {
	case err := <-committed:
		t.Fatalf("commit returned early (%v): the trap did not arm", err)
	default:
	}

	// Cancel the wait: the transaction is already committed locally and
	// becomes visible.
	if _, err := h.pool.Exec(ctx, `SELECT pg_cancel_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	<-committed
	testenv.WaitFor(t, 20*time.Second, "the row marked published", func() (bool, error) {
		var state string
		err := h.pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'invisible'`).Scan(&state)
		return state == "published", err
	})
	testenv.WaitFor(t, 20*time.Second, "the slot confirmed past it", func() (bool, error) {
		confirmed, _ := h.slotConfirmed()
		c, _ := pglogrepl.ParseLSN(confirmed)
		return c > commitLSN, nil
	})
}

// G10: an idle outbox in a busy database does not hold WAL: 50 MB of WAL on
// another table, and the slot's lag returns near zero.
func TestIdleOutboxBusyDatabase(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	stream, prefix := env.StreamName(t)
	h := newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
	h.start()
	h.exec(`CREATE TABLE busy (id bigserial PRIMARY KEY, pad text)`)
	var start string
	if err := h.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&start); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10; i++ {
		h.exec(`INSERT INTO busy (pad) SELECT repeat(md5(g::text), 32) FROM generate_series(1, 5000) g`)
	}
	var walBytes int64
	if err := h.pool.QueryRow(context.Background(), `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint`, start).Scan(&walBytes); err != nil {
		t.Fatal(err)
	}
	if walBytes < 50<<20 {
		t.Fatalf("wrote only %d bytes of WAL, want 50 MB", walBytes)
	}
	var lag int64
	testenv.WaitFor(t, 30*time.Second, "slot lag near zero", func() (bool, error) {
		_, lag = h.slotConfirmed()
		return lag < 64<<10, fmt.Errorf("lag %d bytes", lag)
	})
	t.Logf("wrote %d MB of WAL on another table; slot lag now %d bytes", walBytes>>20, lag)
}

// A relay stopping with everything settled confirms past the WAL written
// after its last outbox commit (its own marks among it), so the next
// session's walsender does not decode that WAL again. Without this, a relay
// restarted often re-read every earlier session's marks: the drain slowed
// round after round on the same table (issue 13). The stop comes right after
// the last mark, before the walsender has necessarily read it, as when a
// benchmark or a deploy stops the relay as soon as the backlog is drained.
func TestStopConfirmsPastOwnMarks(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.start()
	ids := h.insertRows("marks", 2000, 100)
	h.waitPublished(len(ids), 60*time.Second)
	testenv.WaitFor(t, 30*time.Second, "every row marked", func() (bool, error) {
		n := h.countState("ready")
		return n == 0, fmt.Errorf("%d rows still ready", n)
	})
	var end string
	if err := h.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		t.Fatal(err)
	}
	endLSN, _ := pglogrepl.ParseLSN(end)
	before, _ := h.slotConfirmed()
	h.stop()
	after, lag := h.slotConfirmed()
	afterLSN, _ := pglogrepl.ParseLSN(after)
	// Within a WAL page of the end: pg_current_wal_lsn() is where WAL is
	// written up to, which can lie a little past the last record the
	// walsender read (a page boundary, a background record). The marks of
	// 2,000 rows are about 150 kB of WAL.
	if afterLSN+16<<10 < endLSN {
		t.Fatalf("slot confirmed %s after stop (was %s while running); the marks end at %s", after, before, end)
	}
	t.Logf("confirmed %s while running, %s after stop; marks end at %s; lag now %d bytes", before, after, end, lag)
	h.assertExactlyOnce(ids)
}
