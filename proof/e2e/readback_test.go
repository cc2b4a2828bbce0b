package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G18: kill -9 under load, then an outage several times the stream's
// duplicate window (1 s; the relay down 4 s), then a restart: no row is
// stored twice. Before, the replay from the slot's confirmed position
// republished every row acked after the last confirmation (up to
// --status-interval of them, here 2 s) and, past the window, the broker
// stored each again (8,834 rows under mark, 11,787 under none, measured with
// a 7 s outage). Now each session start reads back the stream's headers
// and settles the replayed rows it finds there. Under mark and none.
func TestKill9ThenOutageLongerThanTheDuplicateWindow(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"mark", "none"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			testKill9ThenLongOutage(t, policy)
		})
	}
}

func testKill9ThenLongOutage(t *testing.T, policy string) {
	const (
		kills  = 3
		outage = 4 * time.Second
	)
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot, publication := uniqueName("e2e_readback"), "outbox_relay"
	migrate(t, dbURL, publication)
	conn := connectPG(t, dbURL)
	js := connectNATS(t, env.NATS.URL())
	r := newRelay(t, runArgs(dbURL, env.NATS.URL(), stream, prefix, slot, publication,
		"--duplicate-window", "1s", "--status-interval", "2s", "--on-publish", policy)...)
	r.start()
	waitSlot(t, conn, slot, true, 60*time.Second)

	ctx, cancel := context.WithCancel(context.Background())
	var (
		wg        sync.WaitGroup
		committed atomic.Int64
		perr      error
	)
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		perr = func() error {
			pc, err := pgx.Connect(ctx, dbURL)
			if err != nil {
				return err
			}
			defer pc.Close(context.Background())
			for i := 0; ctx.Err() == nil; i++ {
				rows := make([]outRow, 1+i%20)
				for j := range rows {
					rows[j] = outRow{id: fmt.Sprintf("w-%d-%d", i, j), kind: "order", n: i*100 + j}
				}
				tx, err := pc.Begin(ctx)
				if err != nil {
					return err
				}
				if err := insertRows(ctx, tx, rows); err != nil {
					_ = tx.Rollback(ctx)
					return err
				}
				if err := tx.Commit(ctx); err != nil {
					return err
				}
				committed.Add(int64(len(rows)))
				time.Sleep(5 * time.Millisecond) // pacing the load, not waiting for anything
			}
			return nil
		}()
	}()
	var confirmed pglogrepl.LSN
	for k := range kills {
		// Each session confirms once, then acks rows it has not confirmed
		// yet when it is killed: those are the replay's repeats.
		testenv.WaitFor(t, time.Minute, fmt.Sprintf("kill %d: the slot confirmed past %s", k+1, confirmed), func() (bool, error) {
			st, err := readSlot(context.Background(), conn, slot)
			if err == nil && st.confirmed > confirmed {
				confirmed = st.confirmed
				return true, nil
			}
			return false, err
		})
		at := committed.Load() + 1000
		testenv.WaitFor(t, time.Minute, fmt.Sprintf("kill %d: 1,000 more rows committed", k+1), func() (bool, error) {
			return committed.Load() >= at, perr
		})
		r.requireRunning()
		r.kill()
		waitSlot(t, conn, slot, false, 60*time.Second)
		// Down for longer than the duplicate window, while rows commit.
		time.Sleep(outage) // the outage itself: the fault under test
		r.start()
	}
	cancel()
	wg.Wait()
	if perr != nil && ctx.Err() == nil {
		t.Fatalf("producer: %v", perr)
	}
	// A commit cut off by the cancel may still commit: count the table
	// each time.
	var total, published int
	testenv.WaitFor(t, 2*time.Minute, "every committed row published", func() (bool, error) {
		err := conn.QueryRow(context.Background(), `SELECT count(*), count(*) FILTER (WHERE `+publishedSQL(policy)+`) FROM outbox o`).Scan(&total, &published)
		return err == nil && published == total, fmt.Errorf("%d of %d published (%v)", published, total, err)
	})
	msgs := readStream(t, js, stream)
	seen := map[string]int{}
	for _, m := range msgs {
		seen[m.header.Get("Nats-Msg-Id")]++
	}
	twice := 0
	for _, n := range seen {
		if n > 1 {
			twice++
		}
	}
	if len(seen) != total || twice != 0 {
		t.Errorf("%d rows committed, %d distinct in the stream, %d stored more than once (of %d messages)", total, len(seen), twice, len(msgs))
	}
	found := readBackFound(t, r.logPath)
	t.Logf("%s: %d rows, %d kills with %s outages; replayed rows found stored at the restarts: %v", policy, total, kills, outage, found)
	sum := 0
	for _, n := range found {
		sum += n
	}
	if sum == 0 {
		t.Errorf("no restart found a replayed row already stored: the test did not exercise the read-back (log %s)", r.logPath)
	}
}

// readBackFound reads the "stored" count of every read-back the relay
// logged.
func readBackFound(t *testing.T, logPath string) []int {
	t.Helper()
	b, err := os.ReadFile(logPath)
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, line := range strings.Split(string(b), "\n") {
		if !strings.Contains(line, "read the stream back") {
			continue
		}
		var rec struct {
			Stored int     `json:"stored"`
			Read   int     `json:"read"`
			Took   float64 `json:"took"`
		}
		if err := json.Unmarshal([]byte(line), &rec); err == nil {
			out = append(out, rec.Stored)
			t.Logf("read-back: %d messages read, %d of the replay found stored, in %.0f ms", rec.Read, rec.Stored, rec.Took)
		}
	}
	return out
}
