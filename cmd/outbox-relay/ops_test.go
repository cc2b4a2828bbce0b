package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// run runs the command line as main does and returns its exit code and
// output.
func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = mainErr(args, &out, &errOut)
	t.Logf("outbox-relay %s -> %d\nstdout:\n%sstderr:\n%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return code, out.String(), errOut.String()
}

// migrated creates a database with the outbox table through the migrate
// command and returns its URL and a pool on it.
func migrated(t *testing.T) (string, *pgxpool.Pool) {
	t.Helper()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	return url, migratedAt(t, url)
}

// migratedAt runs the migrate command on the database at url (a server of
// the test's own) and returns a pool on it.
func migratedAt(t *testing.T, url string) *pgxpool.Pool {
	t.Helper()
	if code, _, _ := run(t, "migrate", "--database-url", url); code != 0 {
		t.Fatalf("migrate exited %d", code)
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func mustExec(t *testing.T, pool *pgxpool.Pool, sql string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func stateOf(t *testing.T, pool *pgxpool.Pool, id string) (state, by, reason string) {
	t.Helper()
	if err := pool.QueryRow(context.Background(), `SELECT state, coalesce(redriven_by, ''), coalesce(redrive_reason, '') FROM outbox WHERE work_id = $1`, id).
		Scan(&state, &by, &reason); err != nil {
		t.Fatalf("read %s: %v", id, err)
	}
	return state, by, reason
}

func historyRows(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox_redrives`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A redrive that names a row it may not move exits non-zero, says which and
// why, and still redrives the rest.
func TestRedriveCommandRefusals(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error) VALUES
		('f', 'k', '{"x": 1}', 'failed', 10, 'rejected: max_payload: big'),
		('r', 'k', '{}', 'ready', 0, NULL),
		('p', 'k', '{}', 'published', 0, NULL)`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, claimed_by, lease_until) VALUES
		('run', 'k', '{}', 'running', 'w', clock_timestamp() + interval '1 minute')`)

	code, out, errOut := run(t, "redrive", "--database-url", url, "--reason", "INC-7", "--by", "tester",
		"--work-id", "f", "--work-id", "r", "--work-id", "run", "--work-id", "p", "--work-id", "nope")
	if code != 1 {
		t.Fatalf("exit %d, want 1", code)
	}
	for _, want := range []string{
		`redrove 1 rows of 5 given work IDs in public.outbox (by tester, reason "INC-7"): f`,
		"refused 4:",
		"r: ready: already on its way through the CDC path",
		"run: running: a worker holds it, retry after its lease",
		"p: published: the broker has it (terminal)",
		"nope: not found",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("stdout lacks %q", want)
		}
	}
	if !strings.Contains(errOut, "refused 4 of 5 work IDs") {
		t.Errorf("stderr lacks the refusal count: %q", errOut)
	}
	if st, by, reason := stateOf(t, pool, "f"); st != "scheduled" || by != "tester" || reason != "INC-7" {
		t.Errorf("f = %s by %q reason %q", st, by, reason)
	}
	for id, want := range map[string]string{"r": "ready", "run": "running", "p": "published"} {
		if st, by, _ := stateOf(t, pool, id); st != want || by != "" {
			t.Errorf("%s = %s by %q, want %s untouched", id, st, by, want)
		}
	}
	if n := historyRows(t, pool); n != 1 {
		t.Errorf("%d history rows, want 1", n)
	}

	// All accepted: exit 0.
	mustExec(t, pool, `UPDATE outbox SET state = 'failed' WHERE work_id = 'f'`)
	if code, _, _ := run(t, "redrive", "--database-url", url, "--reason", "again", "--work-id", "f"); code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	if _, by, _ := stateOf(t, pool, "f"); !strings.Contains(by, "@") {
		t.Errorf("default --by = %q, want user@host", by)
	}
}

// Bad flag combinations are refused before anything connects (no
// --database-url is reachable here) with a message that names the flags.
func TestOpCommandFlagErrors(t *testing.T) {
	bad := "--database-url=postgres://nobody@127.0.0.1:1/none?connect_timeout=1"
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"redrive", bad, "--work-id", "a"}, "reason is required (--reason)"},
		{[]string{"redrive", bad, "--work-id", "a", "--reason", "r", "--state", "failed"}, "--work-id and --state: give work IDs or a filter, not both"},
		{[]string{"redrive", bad, "--kind", "k", "--reason", "r"}, "a filter redrive needs --state (failed or cancelled or expired)"},
		{[]string{"redrive", bad, "--state", "ready", "--reason", "r"}, `redrive --state "ready": want failed or cancelled or expired`},
		{[]string{"redrive", bad, "--reason", "r"}, "nothing selected"},
		{[]string{"redrive", bad, "--state", "failed", "--since", "yesterday", "--reason", "r"}, `--since "yesterday"`},
		{[]string{"cancel", bad, "--state", "running", "--reason", "r"}, `cancel --state "running": want scheduled or failed`},
		{[]string{"prune", bad}, "--older-than is required"},
		{[]string{"prune", bad, "--older-than", "-1h"}, "want a positive age"},
	}
	for _, c := range cases {
		code, _, errOut := run(t, c.args...)
		if code != 1 || !strings.Contains(errOut, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 1 and %q", c.args, code, errOut, c.want)
		}
	}
}

// Cancel refuses ready and running rows with the reason and a non-zero
// exit, and cancels by filter.
func TestCancelCommand(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES
		('r', 'k', '{}', 'ready'), ('s1', 'a', '{}', 'scheduled'), ('s2', 'a', '{}', 'scheduled'), ('s3', 'b', '{}', 'scheduled')`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, claimed_by, lease_until) VALUES
		('run', 'a', '{}', 'running', 'w', clock_timestamp() + interval '1 minute')`)
	code, out, _ := run(t, "cancel", "--database-url", url, "--reason", "stop", "--work-id", "r", "--work-id", "run")
	if code != 1 || !strings.Contains(out, "r: ready: already on its way through the CDC path") ||
		!strings.Contains(out, "run: running: a worker holds it, retry after its lease (until ") {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	if st, _, _ := stateOf(t, pool, "run"); st != "running" {
		t.Fatalf("run is %s", st)
	}

	code, out, _ = run(t, "cancel", "--database-url", url, "--reason", "bad deploy", "--by", "ops", "--state", "scheduled", "--kind", "a", "--dry-run")
	if code != 0 || !strings.Contains(out, "dry run, nothing changed: would cancel 2 rows in state scheduled of kind a") {
		t.Fatalf("dry run: exit %d, stdout %q", code, out)
	}
	if st, _, _ := stateOf(t, pool, "s1"); st != "scheduled" || historyRows(t, pool) != 0 {
		t.Fatalf("dry run changed s1 (%s) or wrote history", st)
	}
	code, out, _ = run(t, "cancel", "--database-url", url, "--reason", "bad deploy", "--by", "ops", "--state", "scheduled", "--kind", "a")
	if code != 0 || !strings.Contains(out, "cancelled 2 rows in state scheduled of kind a") || !strings.Contains(out, "s1, s2") {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	for id, want := range map[string]string{"s1": "cancelled", "s2": "cancelled", "s3": "scheduled", "r": "ready"} {
		if st, _, _ := stateOf(t, pool, id); st != want {
			t.Errorf("%s is %s, want %s", id, st, want)
		}
	}
	if n := historyRows(t, pool); n != 2 {
		t.Errorf("%d history rows, want 2", n)
	}
}

// A redrive of rows whose last attempt timed out long ago warns that the
// broker may store the republish twice; a wider window silences it, and a
// rejected row never triggers it.
func TestRedriveCommandUncertainWarning(t *testing.T) {
	url, pool := migrated(t)
	insert := func() {
		mustExec(t, pool, `DELETE FROM outbox`)
		mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error, available_at) VALUES
			('u-old', 'k', '{}', 'failed', 'uncertain: ack timeout', clock_timestamp() - interval '10 minutes'),
			('u-new', 'k', '{}', 'failed', 'uncertain: ack timeout', clock_timestamp()),
			('rej',   'k', '{}', 'failed', 'rejected: no_stream: x', clock_timestamp() - interval '10 minutes')`)
	}
	insert()
	code, out, errOut := run(t, "redrive", "--database-url", url, "--reason", "r", "--state", "failed", "--stagger", "0s")
	if code != 0 || !strings.Contains(out, "redrove 3 rows in state failed") {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	if !strings.Contains(errOut, "WARNING: 1 rows redriven last failed with an uncertain outcome") || !strings.Contains(errOut, "(2m0s, from --duplicate-window)") ||
		!strings.HasSuffix(strings.TrimSpace(errOut), ": u-old") {
		t.Fatalf("stderr %q, want a warning naming u-old only", errOut)
	}
	insert()
	if code, _, errOut := run(t, "redrive", "--database-url", url, "--reason", "r", "--state", "failed", "--duplicate-window", "1h"); code != 0 || strings.Contains(errOut, "WARNING") {
		t.Fatalf("exit %d, stderr %q; want no warning inside a 1h window", code, errOut)
	}

	// With --nats-url the uncertain rows are looked up in the stream
	// first (TestRedriveCommandResolvesUncertainFromStream); the warning
	// is left for those the lookup could not rule out, here past a
	// --lookup-limit of 1 on a subject with other messages. The stream's
	// own window counts: 1s here, so even the fresh uncertain row, due 2s
	// after its attempt, is outside it.
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	js := createStream(t, env.NATS.URL(), stream, prefix, time.Second)
	for _, id := range []string{"other-1", "other-2"} {
		m := nats.NewMsg(prefix + "k")
		m.Header.Set(jetstream.MsgIDHeader, id)
		if _, err := js.PublishMsg(context.Background(), m); err != nil {
			t.Fatal(err)
		}
	}
	insert()
	mustExec(t, pool, `UPDATE outbox SET available_at = clock_timestamp() - interval '2 seconds' WHERE work_id = 'u-new'`)
	code, out, errOut = run(t, "redrive", "--database-url", url, "--reason", "r", "--state", "failed",
		"--duplicate-window", "1h", "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix, "--lookup-limit", "1")
	if code != 0 || !strings.Contains(out, "0 found, 0 not found, 2 inconclusive") || !strings.Contains(errOut, "lookup inconclusive") ||
		!strings.Contains(errOut, "WARNING: 2 rows redriven") || !strings.Contains(errOut, "(1s, from stream "+stream+")") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want an inconclusive lookup and the stream's 1s window used", code, out, errOut)
	}
	// Read to the end, the lookup rules both out: no warning.
	insert()
	code, out, errOut = run(t, "redrive", "--database-url", url, "--reason", "r", "--state", "failed",
		"--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix)
	if code != 0 || !strings.Contains(out, "0 found, 2 not found, 0 inconclusive") || strings.Contains(errOut, "WARNING") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want both ruled out, no warning", code, out, errOut)
	}
}

// connect is a JetStream client of the server at url, closed when the
// test ends.
func connect(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

func createStream(t *testing.T, url, name, prefix string, window time.Duration) jetstream.JetStream {
	t.Helper()
	js := connect(t, url)
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{
		Name: name, Subjects: []string{prefix + ">"}, Duplicates: window, Storage: jetstream.MemoryStorage,
	}); err != nil {
		t.Fatal(err)
	}
	return js
}

func TestPruneCommand(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, created_at)
		SELECT 'old' || g, 'k', '{}', 'published', clock_timestamp() - interval '8 days', clock_timestamp() - interval '9 days' FROM generate_series(1, 7) g`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, created_at, redriven_at) VALUES
		('new', 'k', '{}', 'published', clock_timestamp(), clock_timestamp(), NULL),
		('failed', 'k', '{}', 'failed', NULL, clock_timestamp() - interval '9 days', NULL),
		('cancelled', 'k', '{}', 'cancelled', NULL, clock_timestamp() - interval '9 days', clock_timestamp() - interval '8 days')`)
	code, out, _ := run(t, "prune", "--database-url", url, "--older-than", "7d", "--batch", "3", "--dry-run")
	if code != 0 || !strings.Contains(out, "would prune 7 published rows older than 168h0m0s") {
		t.Fatalf("dry run: exit %d, stdout %q", code, out)
	}
	// The 9 rows created before the cutoff are read 3 at a time, and a
	// fourth batch finds none left (docs/operator-commands.md, prune).
	code, out, _ = run(t, "prune", "--database-url", url, "--older-than", "7d", "--batch", "3")
	if code != 0 || !strings.Contains(out, "pruned 7 published rows older than 168h0m0s") || !strings.HasSuffix(strings.TrimSpace(out), "in 4 batches") {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, "prune", "--database-url", url, "--older-than", "168h", "--include-cancelled")
	if code != 0 || !strings.Contains(out, "pruned 0 published rows and 1 cancelled and 0 expired rows") {
		t.Fatalf("exit %d, stdout %q", code, out)
	}
	var left []string
	rows, err := pool.Query(context.Background(), `SELECT work_id FROM outbox ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		left = append(left, id)
	}
	if strings.Join(left, ",") != "failed,new" {
		t.Fatalf("rows left: %v, want failed,new", left)
	}
}

// status reads the stream when --nats-url is given, estimates the replay
// horizon in seconds and warns when it exceeds the duplicate window; an
// unreachable broker is a line in the report, not a failure.
func TestStatusStreamAndReplayWarning(t *testing.T) {
	url, pool := migrated(t)
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	js := createStream(t, env.NATS.URL(), stream, prefix, 90*time.Second)
	for _, id := range []string{"a", "b", "c"} {
		if _, err := js.Publish(context.Background(), prefix+"x", []byte(`{}`), jetstream.WithMsgID(id)); err != nil {
			t.Fatal(err)
		}
	}
	// A slot, then a ready row an hour old: its transaction is not settled,
	// so a restart replays at least that far.
	mustExec(t, pool, `SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('stuck', 'k', '{}', clock_timestamp() - interval '1 hour')`)

	code, out, _ := run(t, "status", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--json")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	var rep statusReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if rep.Stream == nil || rep.Stream.Error != "" || rep.Stream.Messages != 3 || rep.Stream.Bytes == 0 ||
		rep.Stream.DuplicateWindowSeconds != 90 || len(rep.Stream.Subjects) != 1 || rep.Stream.Subjects[0] != prefix+">" {
		t.Fatalf("stream = %+v", rep.Stream)
	}
	if rep.DuplicateWindowSeconds != 90 {
		t.Errorf("duplicate_window_seconds = %v, want the stream's 90", rep.DuplicateWindowSeconds)
	}
	if rep.Slot.LagSeconds < 3600 || rep.Slot.LagSeconds > 3700 || rep.Slot.LagSource != "oldest ready row" {
		t.Errorf("lag %vs by %q, want about 3600 by the oldest ready row", rep.Slot.LagSeconds, rep.Slot.LagSource)
	}
	if len(rep.Warnings) != 1 || !strings.Contains(rep.Warnings[0], "exceeds the duplicate window (1m30s)") {
		t.Errorf("warnings = %q", rep.Warnings)
	}
	if rep.ByState["ready"] != 1 {
		t.Errorf("by_state = %v", rep.ByState)
	}

	code, out, _ = run(t, "status", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream)
	if code != 0 || !strings.Contains(out, "stream     "+stream+": 3 messages") || !strings.Contains(out, "duplicate window 1m30s") ||
		!strings.Contains(out, "WARNING: the replay horizon") {
		t.Fatalf("text status: exit %d\n%s", code, out)
	}

	// Settled, and no slot: no warning. Broker unreachable: reported, exit 0.
	mustExec(t, pool, `UPDATE outbox SET state = 'published', published_at = clock_timestamp()`)
	mustExec(t, pool, `SELECT pg_drop_replication_slot('outbox_relay')`)
	code, out, _ = run(t, "status", "--database-url", url, "--nats-url", "nats://127.0.0.1:1", "--json")
	if code != 0 {
		t.Fatalf("exit %d with the broker unreachable", code)
	}
	rep = statusReport{}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Stream == nil || !strings.Contains(rep.Stream.Error, "cannot connect to NATS") || rep.DuplicateWindowSeconds != 120 || len(rep.Warnings) != 0 {
		t.Fatalf("unreachable broker: stream %+v, window %v, warnings %q", rep.Stream, rep.DuplicateWindowSeconds, rep.Warnings)
	}
}

// A slot nobody streams that holds unconfirmed WAL: PostgreSQL before 17
// cannot say since when, and status says so instead of guessing.
func TestStatusInactiveSlotNote(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at) VALUES ('x', 'k', '{}', 'published', clock_timestamp())`)
	code, out, _ := run(t, "status", "--database-url", url, "--json")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	var rep statusReport
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if !rep.Slot.Exists || rep.Slot.Active || rep.Slot.LagBytes == 0 || rep.Stream != nil {
		t.Fatalf("slot = %+v, stream %+v", rep.Slot, rep.Stream)
	}
	var pg17 bool
	if err := pool.QueryRow(context.Background(), `SELECT current_setting('server_version_num')::int >= 170000`).Scan(&pg17); err != nil {
		t.Fatal(err)
	}
	if pg17 {
		if rep.Slot.LagSource != "pg_replication_slots.inactive_since" {
			t.Errorf("PostgreSQL 17+: lag source %q", rep.Slot.LagSource)
		}
		return
	}
	if len(rep.Warnings) != 1 || !strings.HasPrefix(rep.Warnings[0], "NOTE: no relay streams the slot") {
		t.Errorf("warnings = %q", rep.Warnings)
	}
}

// A slot a walsender streams: status names its pid and takes the lag in
// seconds from pg_stat_replication once the receiver confirmed something.
func TestStatusActiveSlotLag(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	url, pool := migrated(t)
	mustExec(t, pool, `SELECT pg_create_logical_replication_slot('outbox_relay', 'pgoutput')`)
	conn, err := replication.Connect(ctx, url, "status-test")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := pglogrepl.StartReplication(ctx, conn, "outbox_relay", 0, pglogrepl.StartReplicationOptions{
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"},
	}); err != nil {
		t.Fatal(err)
	}
	// A ready row, so the publication (WHERE state = 'ready') sends it.
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('x', 'k', '{}')`)
	// Read until the insert's commit arrived, then confirm it, as the relay
	// would after the broker's ack.
	var end pglogrepl.LSN
	for end == 0 {
		msg, err := conn.ReceiveMessage(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || cd.Data[0] != pglogrepl.XLogDataByteID {
			continue
		}
		xld, err := pglogrepl.ParseXLogData(cd.Data[1:])
		if err != nil {
			t.Fatal(err)
		}
		if len(xld.WALData) > 0 && xld.WALData[0] == 'C' {
			end = xld.ServerWALEnd
		}
	}
	// Published, as the relay would mark it, so no ready row stands in for
	// the lag.
	mustExec(t, pool, `UPDATE outbox SET state = 'published', published_at = clock_timestamp() WHERE work_id = 'x'`)
	if err := pglogrepl.SendStandbyStatusUpdate(ctx, conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: end}); err != nil {
		t.Fatal(err)
	}
	var rep statusReport
	testenv.WaitFor(t, 20*time.Second, "status to take the lag from pg_stat_replication", func() (bool, error) {
		var out, errOut bytes.Buffer
		if code := mainErr([]string{"status", "--database-url", url, "--json"}, &out, &errOut); code != 0 {
			return false, fmt.Errorf("exit %d: %s", code, errOut.String())
		}
		rep = statusReport{}
		if err := json.Unmarshal(out.Bytes(), &rep); err != nil {
			return false, err
		}
		return strings.HasPrefix(rep.Slot.LagSource, "pg_stat_replication"), fmt.Errorf("slot %+v", rep.Slot)
	})
	if !rep.Slot.Active || rep.Slot.ActivePID == 0 || rep.Slot.LagSeconds < 0 || rep.Slot.LagSeconds > 20 || len(rep.Warnings) != 0 {
		t.Fatalf("slot = %+v, warnings %q", rep.Slot, rep.Warnings)
	}
	t.Logf("slot %+v", rep.Slot)
}

// status prints a blocked aggregate so that two different ones never read
// the same: type a/b with id c and type a with id b/c both printed a/b/c.
// Each part is quoted (and so escaped) now.
func TestStatusPrintsAggregatesUnambiguously(t *testing.T) {
	url, pool := migrated(t)
	// Each aggregate: its first row dead-lettered, its second waiting
	// behind it. The first is the oldest blocked one.
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error, created_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('x-1', 'k', '{}', 'failed', 'rejected: x', clock_timestamp() - interval '2 hours', 'a/b', 'c', 1),
		('x-2', 'k', '{}', 'scheduled', NULL, clock_timestamp() - interval '2 hours', 'a/b', 'c', 2),
		('y-1', 'k', '{}', 'failed', 'rejected: y', clock_timestamp() - interval '1 hour', 'a', 'b/c', 1),
		('y-2', 'k', '{}', 'scheduled', NULL, clock_timestamp() - interval '1 hour', 'a', 'b/c', 2)`)
	code, out, _ := run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, `blocked aggregates: 2; oldest "a/b"/"c": 1 rows wait behind x-1`) {
		t.Fatalf("status: exit %d, %q; want the oldest blocked aggregate printed as \"a/b\"/\"c\"", code, out)
	}
	mustExec(t, pool, `UPDATE outbox SET state = 'cancelled' WHERE work_id = 'x-1'`)
	code, out, _ = run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, `blocked aggregates: 1; oldest "a"/"b/c": 1 rows wait behind y-1`) {
		t.Fatalf("status: exit %d, %q; want the oldest blocked aggregate printed as \"a\"/\"b/c\"", code, out)
	}
}
