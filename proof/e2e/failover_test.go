package e2e

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/devenv"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G14: a promotion under load with a lagging standby, on PostgreSQL 15 and
// 17. The relay gets the multi-host URL and --standby-slot naming the
// standby's physical slot. Producers commit through the same URL while the
// standby is cut off from the primary (a lagging async standby), then the
// primary is killed (-m immediate) and the standby promoted; the producers
// go on against the new primary. Every row the new primary holds is in the
// stream, none the promotion took back is, nothing is stored twice, every
// row ends published, and on 17 the failover slot survived (no new slot,
// no backfill).
func TestPromotionUnderLoad(t *testing.T) {
	// Beside the kill tests (at most -parallel of them at once), not
	// before them: on its own it took two minutes of the package's run,
	// mostly waiting (the standby's slot sync, the promotion).
	t.Parallel()
	for _, v := range []int{15, 17} {
		t.Run(fmt.Sprintf("pg%d", v), func(t *testing.T) {
			if _, err := devenv.PostgresBinDir(v); err != nil {
				if os.Getenv("CI") != "" {
					t.Fatalf("PostgreSQL %d is not installed: %v (make pg-versions installs it)", v, err)
				}
				t.Skipf("PostgreSQL %d is not installed here: %v (make pg-versions)", v, err)
			}
			promotionUnderLoad(t, v)
		})
	}
}

func promotionUnderLoad(t *testing.T, version int) {
	ctx := context.Background()
	primary, err := testenv.StartPostgres(testenv.PostgresOptions{Version: version})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	dbURL := primary.CreateDatabase(t)
	migrate(t, dbURL, "outbox_relay")
	standby, err := primary.StartStandby(testenv.StandbyOptions{Slot: "standby_e2e"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	multi := testenv.MultiHostURL(t, dbURL, primary, standby)
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	slot := "e2e_failover"
	js := connectNATS(t, env.NATS.URL())

	r := newRelay(t, runArgs(multi, env.NATS.URL(), stream, prefix, slot, "outbox_relay",
		"--standby-slot", "standby_e2e", "--status-interval", "200ms", "--ack-timeout", "2s")...)
	r.start()
	conn := connectPG(t, dbURL)
	waitSlot(t, conn, slot, true, 60*time.Second)
	if version >= 17 {
		// A promotion before the failover slot is synced falls back to a new
		// slot (lossless, but this test wants the survival path).
		testenv.WaitFor(t, 90*time.Second, "the failover slot synced to the standby", func() (bool, error) {
			sc := connectPG(t, standby.URL(strings.TrimPrefix(dbURLPath(dbURL), "/")))
			defer sc.Close(ctx)
			var ok bool
			err := sc.QueryRow(ctx, `SELECT coalesce(bool_or(synced AND NOT temporary), false) FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&ok)
			return ok, err
		})
	}

	pool, err := pgxpool.New(ctx, multi)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var (
		mu        sync.Mutex
		committed []string
		failed    atomic.Int64
		stop      = make(chan struct{})
		wg        sync.WaitGroup
	)
	for p := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				id := fmt.Sprintf("p%d-%d", p, i)
				qctx, cancel := context.WithTimeout(ctx, 3*time.Second)
				_, err := pool.Exec(qctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'order_event', '{}')`, id)
				cancel()
				if err != nil {
					failed.Add(1)
					time.Sleep(50 * time.Millisecond)
					continue
				}
				mu.Lock()
				committed = append(committed, id)
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	time.Sleep(3 * time.Second)
	if err := standby.CutOff(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second)
	if err := primary.KillImmediate(); err != nil {
		t.Fatal(err)
	}
	promoted := time.Now()
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	close(stop)
	wg.Wait()

	newConn := connectPG(t, standby.URL(strings.TrimPrefix(dbURLPath(dbURL), "/")))
	var total int
	if err := newConn.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&total); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 90*time.Second, "every row of the new primary published", func() (bool, error) {
		var n int
		err := newConn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
		return n == total, fmt.Errorf("%d of %d published (%v)", n, total, err)
	})
	rows, err := newConn.Query(ctx, `SELECT work_id FROM outbox`)
	if err != nil {
		t.Fatal(err)
	}
	held := map[string]bool{}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		held[id] = true
	}
	stored := map[string]int{}
	for _, m := range readStream(t, js, stream) {
		stored[m.header.Get(jetstream.MsgIDHeader)]++
	}
	missing, takenBack, dups := 0, 0, 0
	for id := range held {
		if stored[id] == 0 {
			missing++
		}
	}
	for id, n := range stored {
		if !held[id] {
			takenBack++
		}
		dups += n - 1
	}
	mu.Lock()
	lostInPromotion := 0
	for _, id := range committed {
		if !held[id] {
			lostInPromotion++
		}
	}
	mu.Unlock()
	var created int
	if err := newConn.QueryRow(ctx, `SELECT created_count FROM outbox_slots WHERE slot_name = $1`, slot).Scan(&created); err != nil {
		t.Fatal(err)
	}
	t.Logf("PostgreSQL %d: %d commits acknowledged to producers (%d failed during the failover), %d rows on the new primary, %d taken back by the promotion; stream: %d messages, %d missing, %d for taken-back rows, %d stored duplicates; slot created %d time(s); all published %.1fs after the promotion",
		version, len(committed), failed.Load(), len(held), lostInPromotion, len(stored), missing, takenBack, dups, created, time.Since(promoted).Seconds())
	if missing != 0 || takenBack != 0 || dups != 0 {
		t.Errorf("missing %d, taken back %d, duplicates %d: want 0 each", missing, takenBack, dups)
	}
	if lostInPromotion == 0 {
		t.Errorf("the promotion took back no acknowledged commit: the standby did not lag, so the test proved nothing")
	}
	logText, _ := os.ReadFile(r.logPath)
	survived := strings.Contains(string(logText), "synced failover slot that survived a promotion")
	if version >= 17 && !survived {
		t.Errorf("the relay's log does not say the failover slot survived the promotion")
	}
	if version >= 17 && created != 1 {
		t.Errorf("slot created %d times on PostgreSQL %d; want 1 (the failover slot survives the promotion)", created, version)
	}
	if version < 17 && created != 2 {
		t.Errorf("slot created %d times on PostgreSQL %d; want 2 (a new slot on the new primary)", created, version)
	}
}

// dbURLPath is the database part of a URL (/name).
func dbURLPath(u string) string {
	rest := u[strings.Index(u, "://")+3:]
	p := rest[strings.Index(rest, "/"):]
	if i := strings.IndexByte(p, '?'); i >= 0 {
		p = p[:i]
	}
	return p
}
