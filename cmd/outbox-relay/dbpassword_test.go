package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The relay role's password rotates while the relay runs: ALTER ROLE, the
// secret file rewritten (or the command's answer changed), then every one
// of the relay's connections terminated, the walsender's too. Each new
// connection reads the password again (--database-password-file, or
// --database-password-command run for it), so the relay reconnects with the
// new one: every row committed before and after is in the stream once, and
// no output or log holds either password. With the password read once, as
// before, the relay could not reconnect until a restart.
func TestRotatedDatabasePassword(t *testing.T) {
	t.Parallel() // servers of its own
	for _, mode := range []string{"file", "command"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pg.Close)
			ctx := context.Background()
			admin, err := pgxpool.New(ctx, pg.URL("postgres"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(admin.Close)
			const one, two = "Rot-Pw-One-7d3f", "Rot-Pw-Two-9a1c"
			mustExec(t, admin, `CREATE ROLE rotor LOGIN REPLICATION PASSWORD '`+one+`'`)
			mustExec(t, admin, `CREATE DATABASE rot OWNER rotor`)
			// rotor logs in with a password over TCP; everyone else as before.
			var hbaFile string
			if err := admin.QueryRow(ctx, `SHOW hba_file`).Scan(&hbaFile); err != nil {
				t.Fatal(err)
			}
			hba, err := os.ReadFile(hbaFile)
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(hbaFile, append([]byte("host all rotor 127.0.0.1/32 scram-sha-256\nhost replication rotor 127.0.0.1/32 scram-sha-256\n"), hba...), 0o600); err != nil {
				t.Fatal(err)
			}
			mustExec(t, admin, `SELECT pg_reload_conf()`)
			url := fmt.Sprintf("postgres://rotor@127.0.0.1:%d/rot?sslmode=disable", pg.Port())
			if code, _, _ := run(t, "status", "--database-url", url); code == 0 {
				t.Fatal("rotor logged in without a password: the test would prove nothing")
			}

			dir := t.TempDir()
			secret := filepath.Join(dir, "password")
			write := func(pw string) {
				t.Helper()
				if err := os.WriteFile(secret, []byte(pw+"\n"), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			write(one)
			login := []string{"--database-password-file", secret}
			if mode == "command" {
				login = []string{"--database-password-command", "cat " + secret}
			}
			env := testenv.Shared(t)
			stream, prefix := env.StreamName(t)
			args := append([]string{"--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix}, login...)
			var said strings.Builder
			code, out, errOut := run(t, append([]string{"migrate"}, args...)...)
			said.WriteString(out + errOut)
			if code != 0 {
				t.Fatalf("migrate exited %d", code)
			}
			pool, err := pgxpool.New(ctx, pg.URL("rot"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			insert := func(prefix string, n int) {
				t.Helper()
				mustExec(t, pool, fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload) SELECT '%s-' || i, 'k', '{}' FROM generate_series(1, %d) i`, prefix, n))
			}
			published := func(n int) func() (bool, error) {
				return func() (bool, error) {
					var c int
					err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&c)
					return c == n, err
				}
			}
			said.WriteString(runOne(t, append([]string{"run"}, args...), func() {
				insert("before", 50)
				testenv.WaitFor(t, 30*time.Second, "the rows before the rotation published", published(50))
				mustExec(t, admin, `ALTER ROLE rotor PASSWORD '`+two+`'`)
				write(two)
				var n int
				if err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE usename = 'rotor'`).Scan(&n); err != nil || n < 2 {
					t.Fatalf("terminated %d of the relay's connections (%v), want its pool's and its walsender", n, err)
				}
				insert("after", 50)
				testenv.WaitFor(t, 60*time.Second, "the rows after the rotation published", published(100))
			}))

			ids := streamIDs(t, connect(t, env.NATS.URL()), stream)
			for _, p := range []string{"before", "after"} {
				for i := 1; i <= 50; i++ {
					if id := fmt.Sprintf("%s-%d", p, i); ids[id] != 1 {
						t.Errorf("%s is in the stream %d times, want once", id, ids[id])
					}
				}
			}
			if len(ids) != 100 {
				t.Errorf("the stream holds %d work IDs, want 100", len(ids))
			}
			noSecret(t, "migrate and run", said.String(), one, two)
		})
	}
}

// --replication-database-url: the slot's session connects there, the
// statements through --database-url (a pooler in production; here another
// role, so the two can be told apart in pg_stat_activity). A replication
// URL that reaches another database is refused by each session, saying so.
func TestSeparateReplicationURL(t *testing.T) {
	env := testenv.Shared(t)
	ctx := context.Background()
	url, pool := migrated(t)
	mustExec(t, pool, `DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'direct_repl') THEN CREATE ROLE direct_repl LOGIN REPLICATION; END IF; END $$`)
	var db string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	direct := fmt.Sprintf("postgres://direct_repl@127.0.0.1:%d/%s?sslmode=disable", env.PG.Port(), db)
	stream, prefix := env.StreamName(t)
	args := []string{"run", "--database-url", url, "--replication-database-url", direct, "--nats-url", env.NATS.URL(),
		"--stream", stream, "--subject-prefix", prefix, "--slot", "separate_replication"}
	logs := runOne(t, args, func() {
		mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) SELECT 'sep-' || i, 'k', '{}' FROM generate_series(1, 10) i`)
		testenv.WaitFor(t, 30*time.Second, "10 rows published", func() (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == 10, err
		})
		var walsender, statements string
		err := pool.QueryRow(ctx, `SELECT (SELECT usename FROM pg_stat_replication WHERE application_name = 'outbox-relay' AND pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'separate_replication')),
			(SELECT string_agg(DISTINCT usename, ',') FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND backend_type = 'client backend' AND datname = current_database())`).Scan(&walsender, &statements)
		if err != nil || walsender != "direct_repl" || statements != "postgres" {
			t.Errorf("the walsender's role %q, the statements' %q (%v): want direct_repl and postgres", walsender, statements, err)
		}
	})
	if !strings.Contains(logs, `"replication":"127.0.0.1:`) {
		t.Errorf("run did not say at start where each part connects:\n%s", logs)
	}

	// Another database: every session refuses.
	other := strings.Replace(direct, "/"+db+"?", "/postgres?", 1)
	args[4] = other
	args[len(args)-1] = "separate_replication_other"
	logs = runOne(t, args, func() {
		time.Sleep(2 * time.Second)
	})
	if !strings.Contains(logs, `--replication-database-url reaches database \"postgres\"`) {
		t.Errorf("a replication URL on another database was not refused:\n%s", logs)
	}
}
