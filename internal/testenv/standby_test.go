package testenv

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/devenv"
)

// standbyVersions are Debian's 15, which has no failover slots, and 17, the
// first that has; `make test-pg-versions` adds the version it runs with.
func standbyVersions() []int {
	vs := []int{15, 17}
	if v, err := strconv.Atoi(os.Getenv(devenv.EnvPGVersion)); err == nil && !slices.Contains(vs, v) {
		vs = append(vs, v)
	}
	return vs
}

func TestStandbyFailover(t *testing.T) {
	for _, v := range standbyVersions() {
		t.Run(fmt.Sprintf("pg%d", v), func(t *testing.T) { testStandbyFailover(t, v) })
	}
}

func testStandbyFailover(t *testing.T, version int) {
	primary, err := StartPostgres(PostgresOptions{Version: version})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	if got := primary.Version(); got != version {
		t.Fatalf("asked for PostgreSQL %d, got a server of version %d", version, got)
	}
	dbURL := primary.CreateDatabase(t)
	pc := connect(t, dbURL)
	mustExec(t, pc, "CREATE TABLE kv (k int PRIMARY KEY, v text)")
	mustExec(t, pc, "CREATE PUBLICATION kv_pub FOR TABLE kv")
	// In the copy of the data directory too: the standby must not keep it.
	mustExec(t, pc, "SELECT pg_create_logical_replication_slot('primary_only', 'pgoutput')")
	failoverSlots := version >= 17

	standby, err := primary.StartStandby(StandbyOptions{SynchronizedStandbySlots: failoverSlots})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	if standby.Version() != version || standby.Port() == primary.Port() {
		t.Fatalf("standby: version %d on port %d; primary: version %d on port %d",
			standby.Version(), standby.Port(), version, primary.Port())
	}
	if failoverSlots {
		wantSetting(t, primary.URL("postgres"), "synchronized_standby_slots", standby.StandbySlot())
		// Inherited from the primary's postgresql.auto.conf, it would make
		// the promoted standby wait for itself.
		wantSetting(t, standby.URL("postgres"), "synchronized_standby_slots", "")
	}
	// The copy was taken with the primary stopped: reconnect.
	pc = connect(t, dbURL)
	dbName := pc.Config().Database
	multi := MultiHostURL(t, dbURL, primary, standby)
	// A standby listed first is skipped for one that accepts writes.
	if got := serverPort(t, MultiHostURL(t, dbURL, standby, primary)); got != primary.Port() {
		t.Fatalf("multi-host URL led to port %d, want the primary's %d", got, primary.Port())
	}

	sc := connect(t, standby.URL(dbName))
	var copied int
	if err := sc.QueryRow(context.Background(), "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'primary_only'").Scan(&copied); err != nil {
		t.Fatal(err)
	}
	if copied != 0 {
		t.Fatal("the standby kept the primary's logical slot from the copy")
	}
	// Its catalog_xmin, older than the standby's, would hold back that of
	// any slot created after it, and such a slot is synced only once a
	// consumer has moved it on.
	mustExec(t, pc, "SELECT pg_drop_replication_slot('primary_only')")

	// replicated is what the standby holds, and a promotion keeps.
	replicated := []string{"before the cut"}
	mustExec(t, pc, "INSERT INTO kv VALUES (1, 'before the cut')")
	if failoverSlots {
		mustExec(t, pc, "SELECT pg_create_logical_replication_slot('s', 'pgoutput', false, false, true)")
		waitSlotSynced(t, dbURL, standby.URL(dbName), "s")
		mustExec(t, pc, "INSERT INTO kv VALUES (2, 'decoded after the failover')")
		replicated = append(replicated, "decoded after the failover")
	}
	if err := standby.WaitReplayed(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	if got := values(t, sc); !slices.Equal(got, replicated) {
		t.Fatalf("standby holds %q, want the primary's rows %q", got, replicated)
	}
	if _, err := sc.Exec(context.Background(), "INSERT INTO kv VALUES (9, 'on a standby')"); err == nil {
		t.Fatal("a standby accepted a write")
	}

	if err := standby.CutOff(); err != nil {
		t.Fatal(err)
	}
	mustExec(t, pc, "INSERT INTO kv VALUES (10, 'after the cut')")
	if got, want := values(t, pc), append(slices.Clone(replicated), "after the cut"); !slices.Equal(got, want) {
		t.Fatalf("primary holds %q, want %q", got, want)
	}
	if got := values(t, sc); !slices.Equal(got, replicated) {
		t.Fatalf("a cut-off standby holds %q, want only the rows from before the cut %q", got, replicated)
	}

	// A failover: the primary crashes and the lagging standby takes over.
	if err := primary.KillImmediate(); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(); err != nil {
		t.Fatal(err)
	}
	if got := serverPort(t, multi); got != standby.Port() {
		t.Fatalf("after the promotion the multi-host URL led to port %d, want the promoted standby's %d", got, standby.Port())
	}
	mc := connect(t, multi)
	mustExec(t, mc, "INSERT INTO kv VALUES (20, 'on the new primary')")
	if got, want := values(t, mc), append(slices.Clone(replicated), "on the new primary"); !slices.Equal(got, want) {
		t.Fatalf("promoted standby holds %q, want %q: the replicated rows and the new one, not the one written after the cut", got, want)
	}

	if failoverSlots {
		// The synced slot is usable on the new primary and decodes the
		// inserts since its creation that the standby had, and the new one.
		var n int
		err := mc.QueryRow(context.Background(),
			`SELECT count(*) FROM pg_logical_slot_peek_binary_changes('s', NULL, NULL,
				'proto_version', '1', 'publication_names', 'kv_pub')
			 WHERE get_byte(data, 0) = ascii('I')`).Scan(&n)
		if err != nil {
			t.Fatalf("decode the failover slot on the promoted standby: %v", err)
		}
		if n != 2 {
			t.Fatalf("failover slot on the promoted standby decodes %d inserts, want 2", n)
		}
	}
}

// The cut-off standby catches up when it reconnects.
func TestStandbyReconnect(t *testing.T) {
	primary, err := StartPostgres(PostgresOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Close)
	standby, err := primary.StartStandby(StandbyOptions{Slot: "lagging"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Close)
	if err := standby.CutOff(); err != nil {
		t.Fatal(err)
	}
	pc := connect(t, primary.URL("postgres"))
	mustExec(t, pc, "CREATE TABLE kv (k int PRIMARY KEY, v text)")
	mustExec(t, pc, "INSERT INTO kv VALUES (1, 'while cut off')")
	// The primary's slot keeps the WAL the standby has not received.
	var retained bool
	if err := pc.QueryRow(context.Background(),
		"SELECT restart_lsn < pg_current_wal_lsn() FROM pg_replication_slots WHERE slot_name = 'lagging'").Scan(&retained); err != nil {
		t.Fatal(err)
	}
	if !retained {
		t.Fatal("the standby's slot does not retain the WAL it missed")
	}
	if err := standby.Reconnect(); err != nil {
		t.Fatal(err)
	}
	if err := standby.WaitReplayed(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	if got := values(t, connect(t, standby.URL("postgres"))); !slices.Equal(got, []string{"while cut off"}) {
		t.Fatalf("reconnected standby holds %q", got)
	}
}

func values(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), "SELECT v FROM kv ORDER BY k")
	if err != nil {
		t.Fatalf("read kv: %v", err)
	}
	vs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatalf("read kv: %v", err)
	}
	return vs
}

func serverPort(t *testing.T, url string) int {
	t.Helper()
	var port int
	if err := connect(t, url).QueryRow(context.Background(), "SELECT inet_server_port()").Scan(&port); err != nil {
		t.Fatalf("inet_server_port on %s: %v", url, err)
	}
	return port
}

func wantSetting(t *testing.T, url, name, want string) {
	t.Helper()
	var got string
	if err := connect(t, url).QueryRow(context.Background(), "SELECT current_setting($1)", name).Scan(&got); err != nil {
		t.Fatalf("read %s on %s: %v", name, url, err)
	}
	if got != want {
		t.Fatalf("%s on %s is %q, want %q", name, url, got, want)
	}
}

// waitSlotSynced waits for a failover slot to reach the standby, moving it
// on at the primary as a consumer would: the standby takes a slot only once
// its catalog_xmin is no older than the standby's own horizon, which a new
// slot's is not until it advances. The slot sync worker naps up to 30 s
// while nothing changes.
func waitSlotSynced(t *testing.T, primaryURL, standbyURL, slot string) {
	t.Helper()
	start := time.Now()
	pc, sc := connect(t, primaryURL), connect(t, standbyURL)
	ctx := context.Background()
	WaitFor(t, 60*time.Second, "failover slot "+slot+" synced to the standby", func() (bool, error) {
		var synced bool
		err := sc.QueryRow(ctx,
			"SELECT EXISTS (SELECT FROM pg_replication_slots WHERE slot_name = $1 AND synced AND NOT temporary)", slot).Scan(&synced)
		if err != nil || synced {
			return synced, err
		}
		// A running-transactions record for the slot to take its new
		// catalog_xmin from, then the slot moved past it.
		if _, err := pc.Exec(ctx, "SELECT pg_log_standby_snapshot()"); err != nil {
			return false, err
		}
		_, err = pc.Exec(ctx, "SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())", slot)
		return false, err
	})
	t.Logf("slot %s synced after %v", slot, time.Since(start).Round(time.Millisecond))
}

// `make test-pg-versions` relies on the shared server, and every server a
// test starts without asking for a version, following the variable.
func TestSharedPostgresVersion(t *testing.T) {
	v := os.Getenv(devenv.EnvPGVersion)
	if v == "" {
		// The default is the highest installed: at least Debian's 15.
		if got := Shared(t).PG.Version(); got < 15 {
			t.Fatalf("shared server is PostgreSQL %d", got)
		}
		return
	}
	want, err := strconv.Atoi(v)
	if err != nil {
		t.Fatalf("%s=%q", devenv.EnvPGVersion, v)
	}
	if got := Shared(t).PG.Version(); got != want {
		t.Fatalf("%s=%d, but the shared server is PostgreSQL %d", devenv.EnvPGVersion, want, got)
	}
}
