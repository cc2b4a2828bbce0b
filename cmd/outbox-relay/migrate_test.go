package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// migrate creates the publication with its row filter, and gives one made
// before the filter existed the filter, once.
func TestMigrateFiltersThePublication(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	filter := func() string { return testenv.PublicationRowFilter(t, pool, "outbox_relay", "outbox") }
	migrate := func() string {
		t.Helper()
		code, out, _ := run(t, "migrate", "--database-url", url)
		if code != 0 {
			t.Fatalf("migrate: exit %d", code)
		}
		return out
	}

	out := migrate()
	if got := filter(); got != replication.ReadyFilterCatalog || strings.Contains(out, "added the row filter") {
		t.Fatalf("first migrate: filter %s, output %q; want %s, created with the publication", got, out, replication.ReadyFilterCatalog)
	}
	if _, err := pool.Exec(context.Background(), `ALTER PUBLICATION outbox_relay SET TABLE outbox`); err != nil {
		t.Fatal(err)
	}
	if out := migrate(); filter() != replication.ReadyFilterCatalog || !strings.Contains(out, "publication outbox_relay: added the row filter WHERE (state = 'ready')") {
		t.Fatalf("migrate of an unfiltered publication: filter %s, output %q", filter(), out)
	}
	if out := migrate(); strings.Contains(out, "added") || !strings.Contains(out, "publishes inserts of ready rows") {
		t.Fatalf("third migrate: output %q, want nothing added", out)
	}
}

// The procedure for changing a table's --ordering or --on-publish
// (docs/upgrading.md): migrate prints the recorded settings, migrate
// --record-settings replaces them (from flags or the environment, as run
// reads them), and a run with other settings exits 1 naming each one.
func TestMigrateRecordSettings(t *testing.T) {
	env := testenv.Shared(t)
	url := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	migrate := func(args ...string) (int, string, string) {
		t.Helper()
		return run(t, append([]string{"migrate", "--database-url", url}, args...)...)
	}
	if code, out, _ := migrate(); code != 0 || !strings.Contains(out, "settings of public.outbox: none recorded yet; the first `run` records") {
		t.Fatalf("first migrate: exit %d, %q; want none recorded", code, out)
	}
	if code, _, errOut := migrate("--record-settings", "--ordering", "sometimes"); code != 1 || !strings.Contains(errOut, `--ordering "sometimes": want none or aggregate`) {
		t.Fatalf("--record-settings --ordering sometimes: exit %d, %q", code, errOut)
	}
	if code, _, errOut := migrate("--record-settings", "--on-publish", "sometimes"); code != 1 || !strings.Contains(errOut, `--on-publish "sometimes"`) {
		t.Fatalf("--record-settings --on-publish sometimes: exit %d, %q", code, errOut)
	}
	code, out, _ := migrate("--record-settings", "--ordering", "aggregate")
	if code != 0 || !strings.Contains(out, "recorded the settings of public.outbox: --ordering aggregate --on-publish mark (were: none recorded)") {
		t.Fatalf("--record-settings --ordering aggregate: exit %d, %q", code, out)
	}
	if code, out, _ := migrate(); code != 0 || !strings.Contains(out, "settings of public.outbox: --ordering aggregate --on-publish mark (recorded by migrate --record-settings on ") {
		t.Fatalf("migrate after recording: exit %d, %q", code, out)
	}

	runArgs := []string{"run", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix}
	code, errOut := runWithin(t, 60*time.Second, runArgs...)
	if code != 1 || !strings.Contains(errOut, "--ordering: the table's is aggregate, this instance's none") ||
		!strings.Contains(errOut, "migrate --record-settings --ordering none --on-publish mark") {
		t.Fatalf("run without --ordering aggregate: exit %d, stderr %q; want 1, naming --ordering and the change", code, errOut)
	}

	// The same values from the environment, as one env file serves both.
	t.Setenv("OUTBOX_RELAY_ORDERING", "none")
	t.Setenv("OUTBOX_RELAY_ON_PUBLISH", "delete")
	code, out, _ = migrate("--record-settings")
	if code != 0 || !strings.Contains(out, "recorded the settings of public.outbox: --ordering none --on-publish delete (were: --ordering aggregate --on-publish mark, recorded by migrate --record-settings on ") {
		t.Fatalf("--record-settings from the environment: exit %d, %q", code, out)
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var ordering, onPublish string
	if err := pool.QueryRow(context.Background(), `SELECT ordering, on_publish FROM outbox_settings`).Scan(&ordering, &onPublish); err != nil || ordering != "none" || onPublish != "delete" {
		t.Fatalf("outbox_settings: %s, %s, %v; want none, delete", ordering, onPublish, err)
	}
	code, errOut = runWithin(t, 60*time.Second, append(runArgs, "--on-publish", "mark")...)
	if code != 1 || !strings.Contains(errOut, "--on-publish: the table's is delete, this instance's mark") || strings.Contains(errOut, "--ordering: ") {
		t.Fatalf("run with --on-publish mark: exit %d, stderr %q; want 1, naming --on-publish only", code, errOut)
	}
}

// --lock-timeout reaches the migration: with a session holding the table,
// a pending migration that needs its lock gives up after the flag's time
// with the reason and the holder, exit 1; the applied ones are listed as
// they go; a rerun once the holder is gone applies it. 0 is refused.
func TestMigrateLockTimeoutFlag(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	ctx := context.Background()
	if code, _, errOut := run(t, "migrate", "--database-url", url, "--lock-timeout", "0s"); code == 0 || !strings.Contains(errOut, "--lock-timeout 0s: want more than 0") {
		t.Fatalf("--lock-timeout 0s: exit %d, %q; want refused", code, errOut)
	}
	code, out, _ := run(t, "migrate", "--database-url", url)
	if code != 0 || !strings.Contains(out, "public.outbox: building index outbox_aggregate_idx on \"public\".\"outbox\" concurrently") ||
		!strings.Contains(out, "applied 0010_stream_name to public.outbox") {
		t.Fatalf("first migrate: exit %d, output %q; want the concurrent builds and the applied migrations", code, out)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	// As if 0010 were new: its ADD COLUMN needs the table's ACCESS EXCLUSIVE lock.
	if _, err := pool.Exec(ctx, `ALTER TABLE outbox DROP COLUMN stream_name; DELETE FROM outbox_relay_migrations WHERE version = 10`); err != nil {
		t.Fatal(err)
	}
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx) //nolint:errcheck
	if _, err := holder.Exec(ctx, `SELECT count(*) FROM outbox`); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)
	start := time.Now()
	code, _, errOut := run(t, "migrate", "--database-url", url, "--lock-timeout", "300ms")
	took := time.Since(start)
	if code == 0 || !strings.Contains(errOut, "apply 0010_stream_name (rolled back: nothing of it is applied): gave up after waiting lock_timeout 300ms (--lock-timeout)") ||
		!strings.Contains(errOut, "holds AccessShareLock on outbox") {
		t.Fatalf("migrate beside a holder: exit %d, stderr %q; want the lock timeout and the holder", code, errOut)
	}
	if took > 5*time.Second {
		t.Errorf("migrate took %s to give up with --lock-timeout 300ms", took)
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if code, out, _ := run(t, "migrate", "--database-url", url, "--lock-timeout", "300ms"); code != 0 || !strings.Contains(out, "applied 0010_stream_name to public.outbox") {
		t.Fatalf("rerun: exit %d, output %q; want 0010 applied", code, out)
	}
}
