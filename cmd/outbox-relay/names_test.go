package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func countRows(t *testing.T, pool *pgxpool.Pool, where string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// An age too large for time.Duration used to wrap round: `prune
// --older-than 213504d` pruned everything published more than 25m26s ago.
// It is refused, and nothing is deleted.
func TestPruneRefusesOverflowingAge(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, created_at)
		SELECT 'p' || i, 'k', '{}', 'published', clock_timestamp() - interval '1 hour', clock_timestamp() - interval '2 hours' FROM generate_series(1, 5) i`)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, redriven_at)
		VALUES ('c', 'k', '{}', 'cancelled', clock_timestamp() - interval '1 hour')`)
	for _, age := range []string{"213504d", "106752d", "9999999999999d", "9999999999h", "2562048h"} {
		for _, extra := range [][]string{nil, {"--include-cancelled"}} {
			args := append([]string{"prune", "--database-url", url, "--older-than", age}, extra...)
			code, _, errOut := run(t, args...)
			if code == 0 {
				t.Errorf("prune --older-than %s exited 0", age)
			}
			if want := fmt.Sprintf(`--older-than %q: too large; the largest accepted age is 106751d (2562047h)`, age); !strings.Contains(errOut, want) {
				t.Errorf("stderr lacks %q", want)
			}
		}
		if n := countRows(t, pool, "true"); n != 6 {
			t.Fatalf("after prune --older-than %s: %d rows, want all 6 kept", age, n)
		}
	}
	// The largest accepted age still works, and deletes nothing this recent.
	if code, out, _ := run(t, "prune", "--database-url", url, "--older-than", "106751d"); code != 0 || !strings.Contains(out, "pruned 0 published rows") {
		t.Errorf("prune --older-than 106751d: exit %d, %q", code, out)
	}
	// An age inside the range prunes as before.
	if code, out, _ := run(t, "prune", "--database-url", url, "--older-than", "30m"); code != 0 || !strings.Contains(out, "pruned 5 published rows") {
		t.Errorf("prune --older-than 30m: exit %d, %q", code, out)
	}
}

// --since on redrive and cancel refuses the same ages, before any row moves.
func TestOpSinceRefusesOverflowingAge(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('f', 'k', '{}', 'failed')`)
	for _, cmd := range []string{"redrive", "cancel"} {
		for _, age := range []string{"213504d", "106752d", "9999999999999d", "9999999999h"} {
			code, _, errOut := run(t, cmd, "--database-url", url, "--state", "failed", "--since", age, "--reason", "r")
			if code == 0 || !strings.Contains(errOut, fmt.Sprintf("--since %q: too large", age)) || !strings.Contains(errOut, "106751d") {
				t.Errorf("%s --since %s: exit %d, stderr %q; want a refusal naming --since and 106751d", cmd, age, code, errOut)
			}
		}
	}
	if st, _, _ := stateOf(t, pool, "f"); st != "failed" {
		t.Fatalf("row f is %s, want failed (untouched)", st)
	}
	if code, out, _ := run(t, "redrive", "--database-url", url, "--state", "failed", "--since", "7d", "--reason", "r"); code != 0 || !strings.Contains(out, "redrove 1 rows") {
		t.Errorf("redrive --since 7d: exit %d, %q", code, out)
	}
}

// A producer controls work_id and kind. Printed raw, a work ID holding
// "\r\n" and an escape sequence paints a fake line into the operator's
// terminal; every operator command shows it escaped instead.
func TestOperatorOutputEscapesRowData(t *testing.T) {
	const (
		evil   = "x\r\nredrove 0 rows; all good\x1b[2K"
		forged = "redrove 0 rows; all good"
		shown  = `\r\nredrove 0 rows; all good\x1b[2K"` // escaped, in quotes
	)
	url, pool := migrated(t)
	reset := func(state string) {
		t.Helper()
		if _, err := pool.Exec(context.Background(), `DELETE FROM outbox`); err != nil {
			t.Fatal(err)
		}
		// Migration 0005 refuses such work IDs at insert with a CHECK that
		// is NOT VALID: rows from before it (or with it dropped) still
		// hold them, so the test drops it to insert one.
		for _, c := range []string{"outbox_work_id_wire_check", "outbox_kind_wire_check"} {
			if _, err := pool.Exec(context.Background(), `ALTER TABLE outbox DROP CONSTRAINT IF EXISTS `+c); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pool.Exec(context.Background(), `INSERT INTO outbox (work_id, kind, payload, state, last_error) VALUES
			($1, $2, '{}', $3, $4), ('ready-'||$1, 'k', '{}', 'ready', NULL)`,
			evil, "kind\x1b]0;pwned\a", state, "rejected: max_payload\r\nall good"); err != nil {
			t.Fatal(err)
		}
	}
	check := func(t *testing.T, out string) {
		t.Helper()
		if strings.ContainsAny(out, "\x1b\r\a") {
			t.Errorf("output holds a raw ESC, CR or BEL: %q", out)
		}
		for _, line := range strings.Split(out, "\n") {
			if strings.HasPrefix(line, forged) {
				t.Errorf("output holds the forged line %q", line)
			}
		}
		if !strings.Contains(out, shown) {
			t.Errorf("output lacks the escaped work ID %s: %q", shown, out)
		}
	}
	for _, c := range []struct {
		name  string
		state string
		args  []string
	}{
		{"redrive by id", "failed", []string{"redrive", "--work-id", evil}},
		{"redrive by id, dry run", "failed", []string{"redrive", "--work-id", evil, "--dry-run"}},
		{"redrive by filter", "failed", []string{"redrive", "--state", "failed"}},
		{"redrive by filter, dry run", "failed", []string{"redrive", "--state", "failed", "--dry-run"}},
		{"redrive uncertain, warning", "failed", []string{"redrive", "--state", "failed", "--duplicate-window", "1s"}},
		{"redrive refused", "ready", []string{"redrive", "--work-id", evil, "--work-id", "ready-" + evil}},
		{"cancel by id", "scheduled", []string{"cancel", "--work-id", evil}},
		{"cancel by id, dry run", "scheduled", []string{"cancel", "--work-id", evil, "--dry-run"}},
		{"cancel by filter", "failed", []string{"cancel", "--state", "failed", "--kind", "kind\x1b]0;pwned\a"}},
		{"cancel by filter, dry run", "scheduled", []string{"cancel", "--state", "scheduled", "--dry-run"}},
		{"cancel refused", "scheduled", []string{"cancel", "--work-id", "ready-" + evil, "--work-id", "missing-" + evil}},
	} {
		t.Run(c.name, func(t *testing.T) {
			reset(c.state)
			if c.name == "redrive uncertain, warning" {
				mustExec(t, pool, `UPDATE outbox SET last_error = 'uncertain: timeout', available_at = clock_timestamp() - interval '1 hour' WHERE state = 'failed'`)
			}
			args := append(c.args, "--database-url", url, "--reason", "INC-1\r\nall good", "--by", "ops\x1b[2K")
			_, out, errOut := run(t, args...)
			check(t, out+errOut)
			if strings.Contains(out, "kind") && !strings.Contains(out, `"kind\x1b]0;pwned\a"`) {
				t.Errorf("the kind is not shown escaped: %q", out)
			}
		})
	}
	// republish names the rows it reads, finds and publishes: a published
	// row with such a work ID is shown escaped, left out (its message
	// cannot be built) and makes the exit status 1, and the good row beside
	// it is still republished.
	nats := testenv.Shared(t).NATS.URL()
	stream, prefix := testenv.Shared(t).StreamName(t)
	if _, err := connect(t, nats).CreateStream(context.Background(), jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}}); err != nil {
		t.Fatal(err)
	}
	for _, dry := range []bool{true, false} {
		t.Run(fmt.Sprintf("republish, dry run %v", dry), func(t *testing.T) {
			reset("published")
			args := []string{"republish", "--database-url", url, "--nats-url", nats, "--stream", stream, "--subject-prefix", prefix, "--since", "1h"}
			if dry {
				args = append(args, "--dry-run")
			}
			mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('w-good', 'k', '{}', 'published')`)
			code, out, errOut := run(t, args...)
			check(t, out+errOut)
			want := "republished 1 rows: w-good"
			if dry {
				want = "would republish 1 rows: w-good"
			}
			if code != 1 || !strings.Contains(out, want) {
				t.Errorf("exit %d, stdout %q; want 1 and %q", code, out, want)
			}
		})
	}
}

// runWithin runs a command that must end on its own: a `run` that passed
// validation would stream until stopped, so it fails the test instead of
// hanging it.
func runWithin(t *testing.T, d time.Duration, args ...string) (code int, stderr string) {
	t.Helper()
	var out, errOut testenv.LogBuffer
	done := make(chan int, 1)
	go func() { done <- mainErr(args, &out, &errOut) }()
	select {
	case code = <-done:
	case <-time.After(d):
		t.Fatalf("outbox-relay %s still running after %s; stderr:\n%s", strings.Join(args, " "), d, errOut.String())
	}
	t.Logf("outbox-relay %s -> %d\nstderr:\n%s", strings.Join(args, " "), code, errOut.String())
	return code, errOut.String()
}

// Names that PostgreSQL or the broker refuse only once the relay runs (it
// then retried forever) are refused at start, before anything connects or
// the poller starts, with the flag and the fix.
func TestRunRefusesBadNamesAtStart(t *testing.T) {
	env := testenv.Shared(t)
	url, _ := migrated(t)
	stream, prefix := env.StreamName(t)
	long := strings.Repeat("t", 63)
	base := func(extra ...string) []string {
		return append([]string{"run", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream,
			"--subject-prefix", prefix, "--slot", "names_test"}, extra...)
	}
	for _, c := range []struct {
		name string
		args []string
		want []string
	}{
		{"stream with slash", base("--stream", "a/b"), []string{`--stream "a/b"`, "path separator '/'"}},
		{"stream with backslash", base("--stream", `a\b`), []string{"--stream", "path separator"}},
		{"stream with control", base("--stream", "A\x1bB"), []string{"--stream", `\x1b`}},
		{"prefix _INBOX", base("--subject-prefix", "_INBOX."), []string{`--subject-prefix "_INBOX."`, "reply"}},
		{"prefix $JS", base("--subject-prefix", "$JS.API."), []string{`--subject-prefix "$JS.API."`, "reserved"}},
		{"bad slot", base("--slot", "Bad-Slot"), []string{`--slot "Bad-Slot"`, "lower-case letters"}},
		{"bad publication", base("--publication", "pub-x"), []string{`--publication "pub-x"`, "lower-case letters"}},
		{"63-byte table", base("--table", long), []string{"--table", fmt.Sprintf("at most %d bytes", store.MaxTableName())}},
	} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			code, errOut := runWithin(t, 30*time.Second, c.args...)
			if code != 1 {
				t.Errorf("exit %d, want 1", code)
			}
			for _, w := range c.want {
				if !strings.Contains(errOut, w) {
					t.Errorf("stderr lacks %q", w)
				}
			}
			if strings.Contains(errOut, "poller started") {
				t.Error("the poller started before the name was refused")
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Errorf("took %s to refuse", d)
			}
		})
	}
}

// Operator commands that take --stream refuse the same names before they
// connect (the database URL here is unreachable).
func TestOpCommandsRefuseBadStream(t *testing.T) {
	bad := "--database-url=postgres://nobody@127.0.0.1:1/none?connect_timeout=1"
	for _, args := range [][]string{
		{"status", bad, "--stream", "a/b"},
		{"redrive", bad, "--stream", "a/b", "--work-id", "w", "--reason", "r"},
	} {
		code, _, errOut := run(t, args...)
		if code != 1 || !strings.Contains(errOut, `--stream "a/b"`) || strings.Contains(errOut, "connect") {
			t.Errorf("%s: exit %d, stderr %q; want the --stream refusal before connecting", args[0], code, errOut)
		}
	}
}

// A 63-byte --table cut every derived name to the table's own, so migrate
// made no <table>_slots and run retried forever on `column "slot_name" does
// not exist`. migrate refuses it and creates nothing; the longest name that
// fits still works.
func TestMigrateTableNameLength(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	relations := func(prefix string) int {
		var n int
		if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_class WHERE starts_with(relname, $1)`, prefix).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	limit := store.MaxTableName()
	for _, n := range []int{limit + 1, 63} {
		name := strings.Repeat("m", n)
		code, _, errOut := run(t, "migrate", "--database-url", url, "--table", name)
		if code != 1 || !strings.Contains(errOut, fmt.Sprintf("table name is %d bytes, but at most %d fit", n, limit)) {
			t.Errorf("migrate --table <%d bytes>: exit %d, stderr %q", n, code, errOut)
		}
		if r := relations(name); r != 0 {
			t.Errorf("migrate --table <%d bytes> created %d relations", n, r)
		}
	}
	name := strings.Repeat("m", limit)
	if code, _, _ := run(t, "migrate", "--database-url", url, "--table", name, "--publication", "names_test"); code != 0 {
		t.Fatalf("migrate --table <%d bytes>: exit %d", limit, code)
	}
	var col string
	err = pool.QueryRow(context.Background(), `SELECT attname FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'slot_name'`,
		pgx.Identifier{"public", name + "_slots"}.Sanitize()).Scan(&col)
	if err != nil {
		t.Fatalf("%s_slots has no slot_name column: %v", name, err)
	}
	var idx int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_indexes WHERE indexname = $1`, name+"_redrives_work_id_idx").Scan(&idx); err != nil || idx != 1 {
		t.Errorf("index %s_redrives_work_id_idx: %d, %v", name, idx, err)
	}
}
