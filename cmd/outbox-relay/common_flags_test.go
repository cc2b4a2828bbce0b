package main

import (
	"context"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// ignoredBy is, per command, the common flags it accepts but does not read.
// Stated here rather than derived from the commands, so that a command that
// starts or stops reading one changes this test too.
var ignoredBy = map[string][]string{
	"migrate":   append(slices.Clone(natsAuthFlags), "nats-url", "slot", "stream", "subject-prefix", "message-format", "cloudevents-source", "log-level", "log-format"),
	"run":       nil,
	"status":    {"publication", "subject-prefix", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"},
	"redrive":   {"slot", "publication", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"},
	"republish": {"slot", "publication", "log-level", "log-format"},
	"cancel":    append(slices.Clone(natsAuthFlags), "nats-url", "slot", "publication", "stream", "subject-prefix", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"),
	"prune":     append(slices.Clone(natsAuthFlags), "nats-url", "slot", "publication", "stream", "subject-prefix", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"),
	"version":   append(slices.Clone(natsAuthFlags), "database-url", "database-password-file", "database-password-command", "database-iam", "database-iam-region", "database-pooler", "nats-url", "table", "slot", "publication", "stream", "subject-prefix", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"),
	"demo":      nil,
	"console":   append(slices.Clone(natsAuthFlags), "nats-url", "publication", "stream", "subject-prefix", "on-publish", "message-format", "cloudevents-source"),
}

// natsAuthFlags are the common flags that log in to the broker: read by
// every command that talks to it (TestEveryCommandLogsInToAnAuthenticatedBroker).
var natsAuthFlags = []string{"nats-name", "nats-user", "nats-password", "nats-token", "nats-creds", "nats-nkey", "nats-tls-ca", "nats-tls-cert", "nats-tls-key"}

var allCommonFlags = append([]string{"database-url", "database-password-file", "database-password-command", "database-iam", "database-iam-region", "database-pooler", "nats-url", "table", "slot", "publication", "stream", "subject-prefix", "on-publish", "message-format", "cloudevents-source", "log-level", "log-format"}, natsAuthFlags...)

// Every command's --help lists every common flag and marks exactly the ones
// it ignores.
func TestHelpMarksIgnoredCommonFlags(t *testing.T) {
	for _, c := range commands() {
		t.Run(c.name, func(t *testing.T) {
			ignored, ok := ignoredBy[c.name]
			if !ok {
				t.Fatalf("no entry for %s in ignoredBy: say which common flags it ignores", c.name)
			}
			code, _, help := run(t, c.name, "--help")
			if code != 0 {
				t.Fatalf("%s --help exited %d", c.name, code)
			}
			lines := map[string]string{}
			for _, line := range strings.Split(help, "\n") {
				if strings.HasPrefix(line, "  --") {
					lines[strings.TrimPrefix(strings.Fields(line)[0], "--")] = line
				}
			}
			for _, name := range allCommonFlags {
				line, listed := lines[name]
				if !listed {
					t.Errorf("--help does not list --%s", name)
					continue
				}
				if marked, want := strings.Contains(line, "(ignored by "+c.name+")"), slices.Contains(ignored, name); marked != want {
					t.Errorf("--%s: marked ignored %v, want %v: %q", name, marked, want, line)
				}
			}
			for name, line := range lines {
				if !slices.Contains(allCommonFlags, name) && strings.Contains(line, "ignored") {
					t.Errorf("--%s is not a common flag but is marked: %q", name, line)
				}
			}
		})
	}
}

// One set of common flags serves every command, on the command line or as
// OUTBOX_RELAY_* variables: each command accepts them all and does its job
// with the ones it reads. A single database, slot and stream go through
// migrate, run, status, republish, redrive, cancel, prune, version and demo in turn, as
// a deployment's one env file would.
func TestEveryCommandTakesTheCommonFlags(t *testing.T) {
	for _, mode := range []string{"args", "env"} {
		t.Run(mode, func(t *testing.T) {
			env := testenv.Shared(t)
			stream, prefix := env.StreamName(t)
			common := map[string]string{
				"database-url":   env.PG.CreateDatabase(t),
				"nats-url":       env.NATS.URL(),
				"table":          "common_outbox",
				"slot":           "common_flags_" + mode, // slots are per cluster, not per database
				"publication":    "common_pub",
				"stream":         stream,
				"subject-prefix": prefix,
				"on-publish":     "delete",
				"log-level":      "info",
				"log-format":     "console",
			}
			var commonArgs []string
			for _, name := range allCommonFlags {
				if _, ok := common[name]; !ok {
					continue // the login flags: TestEveryCommandLogsInToAnAuthenticatedBroker
				}
				if mode == "env" {
					t.Setenv(config.EnvName(name), common[name])
				} else {
					commonArgs = append(commonArgs, "--"+name, common[name])
				}
			}
			args := func(cmd string, extra ...string) []string {
				return append(append([]string{cmd}, commonArgs...), extra...)
			}
			pool, err := pgxpool.New(context.Background(), common["database-url"])
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			count := func(sql string, a ...any) int {
				t.Helper()
				var n int
				if err := pool.QueryRow(context.Background(), sql, a...).Scan(&n); err != nil {
					t.Fatalf("%s: %v", sql, err)
				}
				return n
			}

			// migrate: the table by --table, the publication by --publication.
			if code, _, _ := run(t, args("migrate")...); code != 0 {
				t.Fatalf("migrate exited %d", code)
			}
			if n := count(`SELECT count(*) FROM pg_publication_tables WHERE pubname = 'common_pub' AND tablename = 'common_outbox'`); n != 1 {
				t.Fatalf("publication common_pub on common_outbox: %d rows, want 1", n)
			}

			// run: streams a row into --stream under --subject-prefix, then
			// deletes it (--on-publish delete), logs for people without
			// colour codes into a pipe (--log-format console), and stops
			// cleanly.
			logs := runOne(t, args("run"), func() {
				mustExec(t, pool, `INSERT INTO common_outbox (work_id, kind, payload) VALUES ('w-run', 'placed', '{}')`)
				testenv.WaitFor(t, 30*time.Second, "run to publish and delete w-run", func() (bool, error) {
					return count(`SELECT count(*) FROM common_outbox`) == 0, nil
				})
			})
			if !strings.Contains(logs, "INF") || strings.Contains(logs, "\x1b[") {
				t.Errorf("run's console log has no INF level or has colour codes: %q", logs)
			}
			msg := lastMsg(t, env.NATS.URL(), stream, prefix+"placed")
			if id := msg.Header.Get(jetstream.MsgIDHeader); id != "w-run" {
				t.Fatalf("last message on %splaced has Nats-Msg-Id %q, want w-run", prefix, id)
			}
			if n := count(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = $1`, common["slot"]); n != 1 {
				t.Fatalf("run made no slot %s", common["slot"])
			}

			// status: the table, the slot and the stream it was told.
			code, out, _ := run(t, args("status", "--json")...)
			if code != 0 {
				t.Fatalf("status exited %d", code)
			}
			var rep statusReport
			if err := json.Unmarshal([]byte(out), &rep); err != nil {
				t.Fatalf("status --json: %v", err)
			}
			if rep.Table != "public.common_outbox" || rep.Slot.Name != common["slot"] || !rep.Slot.Exists {
				t.Errorf("status reports table %q, slot %+v", rep.Table, rep.Slot)
			}
			if rep.Stream == nil || rep.Stream.Name != stream || rep.Stream.Error != "" || rep.Stream.Messages != 1 {
				t.Errorf("status reports stream %+v, want %s with 1 message", rep.Stream, stream)
			}

			// republish: refuses under the common --on-publish delete (the
			// rows are gone); given mark, it finds a published row of
			// --table whose message --stream lacks and publishes it there
			// under --subject-prefix.
			code, _, errOut := run(t, args("republish", "--since", "1h")...)
			if code != 1 || !strings.Contains(errOut, "--on-publish delete") {
				t.Fatalf("republish under delete exited %d, stderr %q; want 1 and the refusal", code, errOut)
			}
			mustExec(t, pool, `INSERT INTO common_outbox (work_id, kind, payload, state, published_at) VALUES ('w-rep', 'placed', '{}', 'published', clock_timestamp())`)
			code, out, errOut = run(t, args("republish", "--since", "1h", "--on-publish", "mark")...)
			if code != 0 || !strings.Contains(out, "republished 1 rows: w-rep") {
				t.Fatalf("republish exited %d, stdout %q, stderr %q; want w-rep republished", code, out, errOut)
			}
			if id := lastMsg(t, env.NATS.URL(), stream, prefix+"placed").Header.Get(jetstream.MsgIDHeader); id != "w-rep" {
				t.Fatalf("last message on %splaced has Nats-Msg-Id %q, want w-rep", prefix, id)
			}
			mustExec(t, pool, `DELETE FROM common_outbox WHERE work_id = 'w-rep'`)

			// redrive: the row moves, and the window comes from the stream.
			mustExec(t, pool, `INSERT INTO common_outbox (work_id, kind, payload, state, last_error) VALUES ('w-failed', 'k', '{}', 'failed', 'rejected: x')`)
			code, _, errOut = run(t, args("redrive", "--reason", "r", "--work-id", "w-failed")...)
			if code != 0 || strings.Contains(errOut, "using --duplicate-window") {
				t.Fatalf("redrive exited %d, stderr %q; want 0 and the stream read", code, errOut)
			}
			if n := count(`SELECT count(*) FROM common_outbox WHERE work_id = 'w-failed' AND state = 'scheduled'`); n != 1 {
				t.Fatal("redrive did not schedule w-failed")
			}

			// cancel.
			if code, _, _ := run(t, args("cancel", "--reason", "r", "--work-id", "w-failed")...); code != 0 {
				t.Fatalf("cancel exited %d", code)
			}
			if n := count(`SELECT count(*) FROM common_outbox WHERE work_id = 'w-failed' AND state = 'cancelled'`); n != 1 {
				t.Fatal("cancel did not cancel w-failed")
			}

			// prune.
			mustExec(t, pool, `INSERT INTO common_outbox (work_id, kind, payload, state, published_at, created_at) VALUES ('w-old', 'k', '{}', 'published', clock_timestamp() - interval '2 days', clock_timestamp() - interval '3 days')`)
			code, out, _ = run(t, args("prune", "--older-than", "1d")...)
			if code != 0 || !strings.Contains(out, "pruned 1 published rows") || count(`SELECT count(*) FROM common_outbox WHERE work_id = 'w-old'`) != 0 {
				t.Fatalf("prune exited %d, stdout %q; want w-old pruned", code, out)
			}

			// version.
			code, out, _ = run(t, args("version")...)
			if code != 0 || !strings.HasPrefix(out, "outbox-relay ") {
				t.Fatalf("version exited %d, stdout %q", code, out)
			}

			// demo: on the same database, slot and stream, after all that.
			code, out = runLogging(t, args("demo")...)
			if code != 0 || !strings.Contains(out, "5 rows committed, 5 in the stream (0 duplicates), 1 rolled back and 0 published by mistake") {
				t.Fatalf("demo exited %d; stdout lacks the summary", code)
			}
		})
	}
}

// A value meant for another command is not checked by one that ignores the
// flag; a command still refuses a bad value of a flag it reads.
func TestIgnoredFlagValuesAreNotChecked(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	nonsense := []string{"--nats-url", "nats://[::1", "--slot", "Bad-Slot", "--stream", "a/b", "--subject-prefix", "$JS.API.",
		"--on-publish", "sometimes", "--log-level", "loud", "--log-format", "xml"}
	if code, _, _ := run(t, append([]string{"migrate", "--database-url", url}, nonsense...)...); code != 0 {
		t.Fatalf("migrate with nonsense in the flags it ignores exited %d", code)
	}
	if code, _, _ := run(t, append([]string{"prune", "--database-url", url, "--older-than", "1d", "--publication", "pub-x"}, nonsense...)...); code != 0 {
		t.Fatalf("prune with nonsense in the flags it ignores exited %d", code)
	}
	if code, out, _ := run(t, "version", "--database-url", "::", "--table", "a.b.c", "--log-level", "loud"); code != 0 || !strings.HasPrefix(out, "outbox-relay ") {
		t.Fatalf("version with nonsense flags exited %d", code)
	}

	bad := "--database-url=postgres://nobody@127.0.0.1:1/none?connect_timeout=1"
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"migrate", bad, "--publication", "pub-x"}, `--publication "pub-x"`},
		{[]string{"prune", bad, "--older-than", "1d", "--table", "a.b.c"}, `--table "a.b.c"`},
		{[]string{"run", bad, "--on-publish", "sometimes"}, `--on-publish "sometimes": want mark, delete or none`},
		{[]string{"run", bad, "--log-level", "loud"}, `--log-level "loud"`},
	} {
		code, errOut := runWithin(t, 30*time.Second, c.args...)
		if code != 1 || !strings.Contains(errOut, c.want) {
			t.Errorf("%v: exit %d, stderr %q; want 1 and %q", c.args, code, errOut, c.want)
		}
	}
}

// runOne runs args as main would, calls during while it runs, then stops it
// as SIGTERM would, wants a clean exit and returns its stderr. mainErr cannot
// be used: only a signal ends it.
func runOne(t *testing.T, args []string, during func()) (stderr string) {
	t.Helper()
	i := slices.IndexFunc(commands(), func(c command) bool { return c.name == args[0] })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut testenv.LogBuffer
	done := make(chan error, 1)
	go func() { done <- commands()[i].run(ctx, args[1:], &out, &errOut) }()
	// A command that fails at start ends before during's wait would.
	select {
	case err := <-done:
		t.Fatalf("%s ended at start: %v\nstderr:\n%s", args[0], err, errOut.String())
	case <-time.After(200 * time.Millisecond):
	}
	stopped := false
	defer func() {
		if stopped {
			return
		}
		// during failed the test: stop the command all the same, so that it
		// does not outlive its database.
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
		}
	}()
	during()
	cancel()
	select {
	case err := <-done:
		stopped = true
		t.Logf("outbox-relay %s -> %v\nstderr:\n%s", strings.Join(args, " "), err, errOut.String())
		if err != nil {
			t.Fatalf("%s ended with %v, want a clean stop", args[0], err)
		}
	case <-time.After(30 * time.Second):
		t.Fatalf("%s did not stop within 30s of its context ending", args[0])
	}
	return errOut.String()
}

// runLogging is run for a command that logs from several goroutines: its
// stderr must take concurrent writes, as os.Stderr does.
func runLogging(t *testing.T, args ...string) (code int, stdout string) {
	t.Helper()
	var out, errOut testenv.LogBuffer
	code = mainErr(args, &out, &errOut)
	t.Logf("outbox-relay %s -> %d\nstdout:\n%sstderr:\n%s", strings.Join(args, " "), code, out.String(), errOut.String())
	return code, out.String()
}

func lastMsg(t *testing.T, url, stream, subject string) *jetstream.RawStreamMsg {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(context.Background(), stream)
	if err != nil {
		t.Fatalf("stream %s: %v", stream, err)
	}
	m, err := s.GetLastMsgForSubject(context.Background(), subject)
	if err != nil {
		t.Fatalf("last message on %s: %v", subject, err)
	}
	return m
}
