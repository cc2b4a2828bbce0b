package relay_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// restartHarness runs a relay on a server of its own: any transaction open
// anywhere on the server holds a slot's restart_lsn, so the shared
// server's other tests would decide the outcome.
func restartHarness(t *testing.T, minVersion int) *harness {
	t.Helper()
	env := testenv.Shared(t)
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	if v := pg.Version(); v < minVersion {
		t.Skipf("PostgreSQL %d has no pg_log_standby_snapshot() (16+): while streaming, the slot's restart position follows only the server's own running-transactions records there (docs/deploy.md, \"Restarts and the slot's restart position\"); run with OUTBOX_RELAY_TEST_PG_VERSION=17", v)
	}
	stream, prefix := env.StreamName(t)
	return newHarness(t, setup{dbURL: pg.URL("postgres"), natsURL: env.NATS.URL(), stream: stream, subjectPrefix: prefix})
}

// slotPositions reads the slot's restart and confirmed positions.
func (h *harness) slotPositions() (restart, confirmed pglogrepl.LSN) {
	h.t.Helper()
	var r, c string
	if err := h.pool.QueryRow(context.Background(), `SELECT restart_lsn::text, confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`,
		h.opts.Slot).Scan(&r, &c); err != nil {
		h.t.Fatalf("read slot: %v", err)
	}
	restart, _ = pglogrepl.ParseLSN(r)
	confirmed, _ = pglogrepl.ParseLSN(c)
	return restart, confirmed
}

func (h *harness) walInsertLSN() pglogrepl.LSN {
	h.t.Helper()
	var s string
	if err := h.pool.QueryRow(context.Background(), `SELECT pg_current_wal_insert_lsn()::text`).Scan(&s); err != nil {
		h.t.Fatal(err)
	}
	lsn, _ := pglogrepl.ParseLSN(s)
	return lsn
}

// A clean stop leaves the slot's restart_lsn past every WAL record written
// before the stop, so the next start decodes nothing of this session's WAL
// again (issue 21). Without the relay's running-transactions records the
// restart position stays where the slot was created: the server writes one
// only every 15 s while busy, and the drain and the stop take less.
//
// On PostgreSQL 16+ the records come from pg_log_standby_snapshot(); on 15
// from creating a temporary logical slot.
func TestCleanStopMovesRestartPosition(t *testing.T) {
	h := restartHarness(t, 15)
	h.start()
	created, _ := h.slotPositions()
	ids := h.insertRows("restart", 5000, 200)
	h.waitPublished(len(ids), 120*time.Second)
	testenv.WaitFor(t, 30*time.Second, "every row marked", func() (bool, error) {
		n := h.countState("ready")
		return n == 0, fmt.Errorf("%d rows still ready", n)
	})
	end := h.walInsertLSN()
	began := time.Now()
	h.stop()
	took := time.Since(began)
	restart, confirmed := h.slotPositions()
	now := h.walInsertLSN()
	t.Logf("slot created at %s; drain ended at %s; after a stop of %s: restart_lsn %s, confirmed %s, WAL end %s: %d kB from restart_lsn to the end (%d MB written since the slot was created)",
		created, end, took.Round(time.Millisecond), restart, confirmed, now, (now-restart)>>10, (now-created)>>20)
	if restart < end {
		t.Fatalf("restart_lsn %s is %d kB behind the end of the drain's WAL %s: the next start decodes it again", restart, (end-restart)>>10, end)
	}
	if confirmed < restart {
		t.Fatalf("confirmed %s behind restart_lsn %s", confirmed, restart)
	}
	h.assertExactlyOnce(ids)
	var leftover int
	if err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_replication_slots WHERE slot_name <> $1`, h.opts.Slot).Scan(&leftover); err != nil {
		t.Fatal(err)
	}
	if leftover != 0 {
		t.Fatalf("%d other slots left after the stop", leftover)
	}

	// The next session resumes where the slot says, with nothing lost.
	h.start()
	more := h.insertRows("after", 500, 50)
	h.waitPublished(len(ids)+len(more), 60*time.Second)
	h.stop()
	h.assertExactlyOnce(append(ids, more...))
}

// While streaming, the slot's restart_lsn follows the confirmed position
// within about a WAL segment, under steady load: the server's own record
// every 15 s moves it only to the record before (a transaction is always
// open at a record under load), so without the relay's records it lags by
// everything written since the slot was created, or 15 s of WAL at best.
func TestStreamingRelayKeepsRestartPosition(t *testing.T) {
	h := restartHarness(t, 16)
	h.opts.RestartCheck = 200 * time.Millisecond
	h.start()
	h.exec(`CREATE TABLE busy (id bigserial PRIMARY KEY, pad text)`)
	start := h.walInsertLSN()

	var stopLoad atomic.Bool
	var wg sync.WaitGroup
	var loadErr error
	var outboxRows []string
	wg.Add(1)
	go func() {
		defer wg.Done()
		ctx := context.Background()
		for i := 0; !stopLoad.Load(); i++ {
			if _, err := h.pool.Exec(ctx, `INSERT INTO busy (pad) SELECT repeat(md5(g::text), 16) FROM generate_series(1, 1000) g`); err != nil {
				loadErr = err
				return
			}
			id := fmt.Sprintf("load-%d", i)
			if _, err := h.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'thing_happened', '{}')`, id); err != nil {
				loadErr = err
				return
			}
			outboxRows = append(outboxRows, id)
		}
	}()
	const written, bound = 96 << 20, 32 << 20
	var restart, confirmed, now pglogrepl.LSN
	deadline := time.Now().Add(120 * time.Second)
	for now = h.walInsertLSN(); now < start+written; now = h.walInsertLSN() {
		if time.Now().After(deadline) {
			stopLoad.Store(true)
			wg.Wait()
			t.Fatalf("wrote only %d MB of WAL in 120 s", (now-start)>>20)
		}
		time.Sleep(100 * time.Millisecond)
	}
	// Read while the load still runs, for two seconds: the lag saws
	// between the keeper's threshold and that plus the WAL written until
	// its record is decoded and confirmed (34 MB once on a quiet machine,
	// where the load writes fastest), so the closest reading is compared;
	// without the relay's records the lag only grows.
	restart, confirmed = h.slotPositions()
	for until := time.Now().Add(2 * time.Second); time.Now().Before(until); time.Sleep(100 * time.Millisecond) {
		if r, c := h.slotPositions(); c-r < confirmed-restart {
			restart, confirmed = r, c
		}
	}
	stopLoad.Store(true)
	wg.Wait()
	if loadErr != nil {
		t.Fatal(loadErr)
	}
	t.Logf("%d MB of WAL written under load; at best restart_lsn %s was %d kB behind confirmed %s (%s when the load had written that)",
		(now-start)>>20, restart, (confirmed-restart)>>10, confirmed, now)
	if confirmed < start+written/2 {
		t.Fatalf("confirmed %s: the relay did not keep up with the load (started at %s)", confirmed, start)
	}
	if confirmed-restart > bound {
		t.Fatalf("restart_lsn %s is %d MB behind confirmed %s while streaming, want at most %d MB", restart, (confirmed-restart)>>20, confirmed, bound>>20)
	}
	h.waitPublished(len(outboxRows), 60*time.Second)
	h.assertExactlyOnce(outboxRows)
}
