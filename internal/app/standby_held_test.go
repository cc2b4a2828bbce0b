package app_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// heldSeries reads every outbox_relay_standby_held_seconds sample of an
// exposition, by its label set ("" for none).
func heldSeries(body string) map[string]float64 {
	re := regexp.MustCompile(`(?m)^outbox_relay_standby_held_seconds(?:\{([^}]*)\})? (\S+)$`)
	out := map[string]float64{}
	for _, m := range re.FindAllStringSubmatch(body, -1) {
		if v, err := strconv.ParseFloat(m[2], 64); err == nil {
			out[m[1]] = v
		}
	}
	return out
}

// Both paths hold delivery for a standby that flushes nothing: a CDC
// transaction first, a poller batch two seconds later. Each scrape reports
// the CDC path's wait as the longer one, and each path's own wait under its
// label. outbox_relay_standby_held_seconds used to be one gauge that the CDC
// gate and the poller's wait both set: a scrape read whichever wrote last,
// so the alert's max() saw the poller's younger wait about half the time,
// and the end of either wait zeroed it while the other still held.
func TestStandbyHeldSecondsByPath(t *testing.T) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// Physical slot names are per cluster, and the test servers are shared.
	const standbySlot = "held_by_path_standby"
	exec(`SELECT pg_create_physical_replication_slot($1, true)`, standbySlot)
	t.Cleanup(func() {
		c, err := pgx.Connect(context.Background(), dbURL)
		if err == nil {
			_, _ = c.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, standbySlot)
			c.Close(context.Background())
		}
	})

	addr := make(chan string, 1)
	o := app.Options{
		DatabaseURL: dbURL, NATSURL: env.NATS.URL(), Table: testenv.OutboxTable, Slot: "held_by_path", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark, DuplicateWindow: 2 * time.Minute,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20, HTTPAddr: "127.0.0.1:0",
		Lease: 5 * time.Second, PollInterval: 50 * time.Millisecond,
		StandbySlots: []string{standbySlot},
		Listening:    func(a string) { addr <- a },
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx, o, zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		done <- err
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	testenv.WaitFor(t, 30*time.Second, "/readyz 200 active", func() (bool, error) {
		code, body := get(t, base+"/readyz")
		return code == 200 && strings.TrimSpace(body) == "active", fmt.Errorf("%d %q", code, body)
	})
	scrape := func() map[string]float64 {
		_, body := get(t, base+"/metrics")
		return heldSeries(body)
	}
	longest := func(s map[string]float64) float64 {
		m := 0.0
		for _, v := range s {
			m = max(m, v)
		}
		return m
	}
	state := func(id string) string {
		var s string
		if err := conn.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = $1`, id).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	// The CDC path holds a transaction; its wait is under way by cdcBy.
	t0 := time.Now()
	exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('cdc-1', 'k', '{}')`)
	testenv.WaitFor(t, 30*time.Second, "the CDC transaction held for the standby", func() (bool, error) {
		return longest(scrape()) > 0, nil
	})
	cdcBy := time.Now()
	testenv.WaitFor(t, 30*time.Second, "two seconds held", func() (bool, error) {
		return longest(scrape()) >= 2, nil
	})

	// The poller claims a row and waits for the standby too.
	t1 := time.Now()
	exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('poller-1', 'k', '{}', 'scheduled')`)
	testenv.WaitFor(t, 30*time.Second, "poller-1 claimed", func() (bool, error) {
		return state("poller-1") == "running", nil
	})

	// While both wait, every scrape reports the CDC wait as the longest.
	pollerSeen := false
	for range 20 {
		before := time.Now()
		s := scrape()
		after := time.Now()
		if got, least := longest(s), before.Sub(cdcBy).Seconds(); got < least {
			t.Errorf("scrape %v: longest held %.3fs, want at least %.3fs (the CDC transaction's wait)", s, got, least)
		}
		cdc, pollerV := s[`path="cdc"`], s[`path="poller"`]
		if most := after.Sub(t0).Seconds(); cdc < before.Sub(cdcBy).Seconds() || cdc > most {
			t.Errorf(`scrape %v: path="cdc" %.3fs, want between %.3fs and %.3fs`, s, cdc, before.Sub(cdcBy).Seconds(), most)
		}
		if most := after.Sub(t1).Seconds(); pollerV > most {
			t.Errorf(`scrape %v: path="poller" %.3fs, want at most %.3fs (its batch was claimed after that)`, s, pollerV, most)
		}
		pollerSeen = pollerSeen || pollerV > 0
		time.Sleep(50 * time.Millisecond)
	}
	if !pollerSeen {
		t.Error(`path="poller" stayed 0 while its claimed batch waited for the standby`)
	}
	for _, id := range []string{"cdc-1", "poller-1"} {
		if st := state(id); st == "published" {
			t.Fatalf("%s published while the standby flushed nothing", id)
		}
	}

	// The standby catches up: both rows go out, and both paths read 0.
	exec(`SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, standbySlot)
	testenv.WaitFor(t, 30*time.Second, "both rows published", func() (bool, error) {
		return state("cdc-1") == "published" && state("poller-1") == "published", nil
	})
	testenv.WaitFor(t, 30*time.Second, "nothing held on either path", func() (bool, error) {
		s := scrape()
		v1, ok1 := s[`path="cdc"`]
		v2, ok2 := s[`path="poller"`]
		return ok1 && ok2 && v1 == 0 && v2 == 0, fmt.Errorf("%v", s)
	})
}
