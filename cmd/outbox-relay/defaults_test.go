package main

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// A run with the defaults, on a new broker, creates a stream that passes
// its own contract check: no broker_contract warning at start (the default
// --backoff-max once outlasted the default stream's duplicate window). The
// server is fsynced and its monitor given, so the only check that depends
// on the server and not on what the relay created has its answer. And a
// start refused for a reason in the database (no outbox table) creates
// nothing on the broker: the database is checked before the stream.
func TestDefaultRunAgreesWithItsOwnStream(t *testing.T) {
	srv, err := testenv.StartNATS(testenv.NATSOptions{SyncAlways: true, Monitor: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	streams := func() []string {
		t.Helper()
		var names []string
		l := js.StreamNames(context.Background())
		for n := range l.Name() {
			names = append(names, n)
		}
		if l.Err() != nil {
			t.Fatal(l.Err())
		}
		return names
	}
	env := testenv.Shared(t)

	// Refused in the database: nothing on the broker.
	bare := env.PG.CreateDatabase(t)
	code, _, errOut := run(t, "run", "--database-url", bare, "--nats-url", srv.URL(), "--slot", "defaults_refused")
	if code == 0 || !strings.Contains(errOut, "outbox") {
		t.Fatalf("run on a database without the table exited %d, stderr %q; want a refusal naming the table", code, errOut)
	}
	if s := streams(); len(s) != 0 {
		t.Fatalf("a start refused by the database left streams %v on the broker", s)
	}

	// The defaults: no contract finding about the stream it creates.
	url, pool := migrated(t)
	logs := runOne(t, []string{"run", "--database-url", url, "--nats-url", srv.URL(), "--nats-monitor-url", srv.MonitorURL(), "--slot", "defaults_run"}, func() {
		mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('w-1', 'k', '{}')`)
		testenv.WaitFor(t, 30*time.Second, "run to publish w-1", func() (bool, error) {
			state, _, _ := stateOf(t, pool, "w-1")
			return state == "published", nil
		})
	})
	if !strings.Contains(logs, `"created stream"`) {
		t.Fatalf("run did not create the stream:\n%s", logs)
	}
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, `"broker_contract"`) {
			t.Errorf("a default run warns about the stream it created: %s", line)
		}
	}
}

// On Debian 12's nats-server (2.9, no per-message TTL) the stream the relay
// creates cannot allow TTL: the warning's fix says to upgrade the server,
// not to edit the stream, which 2.9 cannot do. Skipped where that package
// is not installed.
func TestOldBrokerIsAdvisedToUpgrade(t *testing.T) {
	t.Parallel() // a broker of its own, a slot of its own
	const old = "/usr/sbin/nats-server"
	if _, err := os.Stat(old); err != nil {
		t.Skipf("no Debian nats-server at %s", old)
	}
	srv, err := testenv.StartNATS(testenv.NATSOptions{Bin: old})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	url, pool := migrated(t)
	logs := runOne(t, []string{"run", "--database-url", url, "--nats-url", srv.URL(), "--slot", "defaults_old_broker"}, func() {
		// The stream is checked before the session streams the slot.
		testenv.WaitFor(t, 30*time.Second, "run to stream its slot", func() (bool, error) {
			var n int
			err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'defaults_old_broker' AND active`).Scan(&n)
			return n == 1, err
		})
	})
	var ttl string
	for _, line := range strings.Split(logs, "\n") {
		if strings.Contains(line, `"check":"msg_ttl"`) {
			ttl = line
		}
	}
	if !strings.Contains(ttl, `"fix":"upgrade nats-server (2.9`) {
		t.Fatalf("on nats-server 2.9 the msg_ttl finding does not advise an upgrade first: %q\n%s", ttl, logs)
	}
}

// status warns while the relay's slot is inactive on a server that
// invalidates idle slots (PostgreSQL 18's idle_replication_slot_timeout),
// and says what an invalidated slot means for the next run.
func TestStatusWarnsOfIdleSlotTimeout(t *testing.T) {
	t.Parallel() // a server of its own
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Version: 18, Conf: map[string]string{"idle_replication_slot_timeout": "1"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	url := pg.URL("postgres")
	pool := migratedAt(t, url)
	mustExec(t, pool, `SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')`)
	code, out, _ := run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "slot outbox_relay is inactive and PostgreSQL invalidates a slot no one streams for 1s (idle_replication_slot_timeout)") {
		t.Fatalf("status exited %d without the idle slot warning:\n%s", code, out)
	}
	// Invalidated at a checkpoint, which nothing but this one starts here.
	testenv.WaitFor(t, 30*time.Second, "the slot invalidated for idleness", func() (bool, error) {
		mustExec(t, pool, `CHECKPOINT`)
		var reason *string
		err := pool.QueryRow(context.Background(), `SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = 'outbox_relay'`).Scan(&reason)
		return reason != nil && *reason == "idle_timeout", err
	})
	code, out, _ = run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, `slot outbox_relay was invalidated by PostgreSQL (wal_status lost, reason "idle_timeout")`) {
		t.Fatalf("status exited %d without the invalidation warning:\n%s", code, out)
	}
}
