package testenv

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func TestMain(m *testing.M) { Main(m) }

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect %s: %v", url, err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func mustExec(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func TestSharedDatabasesAreSeparate(t *testing.T) {
	env := Shared(t)
	if env.PG.Port() == 5432 || env.NATS.Port() == 4222 {
		t.Fatalf("shared servers use a system port: pg %d, nats %d", env.PG.Port(), env.NATS.Port())
	}
	url1 := env.PG.CreateDatabase(t)
	url2 := env.PG.CreateDatabase(t)
	if url1 == url2 {
		t.Fatalf("CreateDatabase returned the same URL twice: %s", url1)
	}
	c1, c2 := connect(t, url1), connect(t, url2)
	mustExec(t, c1, "CREATE TABLE kv (k text PRIMARY KEY, v text)")
	mustExec(t, c1, "INSERT INTO kv VALUES ('a', 'one')")
	mustExec(t, c2, "CREATE TABLE kv (k text PRIMARY KEY, v text)")
	mustExec(t, c2, "INSERT INTO kv VALUES ('a', 'two')")
	for conn, want := range map[*pgx.Conn]string{c1: "one", c2: "two"} {
		var got string
		if err := conn.QueryRow(context.Background(), "SELECT v FROM kv WHERE k = 'a'").Scan(&got); err != nil {
			t.Fatalf("select: %v", err)
		}
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
}

func TestCreateDatabaseNameLimits(t *testing.T) {
	env := Shared(t)
	t.Run(strings.Repeat("Very Long/Name.With*Odd>Chars ", 5), func(t *testing.T) {
		url := env.PG.CreateDatabase(t)
		var name string
		if err := connect(t, url).QueryRow(context.Background(), "SELECT current_database()").Scan(&name); err != nil {
			t.Fatalf("current_database: %v", err)
		}
		if len(name) > 63 || name != strings.ToLower(name) {
			t.Errorf("database name %q is not a lowercase identifier of at most 63 bytes", name)
		}
	})
}

func TestReplicationSlotDroppedOnCleanup(t *testing.T) {
	env := Shared(t)
	admin := connect(t, env.PG.URL("postgres"))
	var dbname string
	var replDone chan struct{}
	t.Run("slot", func(t *testing.T) {
		url := env.PG.CreateDatabase(t)
		conn := connect(t, url)
		if err := conn.QueryRow(context.Background(), "SELECT current_database()").Scan(&dbname); err != nil {
			t.Fatalf("current_database: %v", err)
		}
		mustExec(t, conn, "SELECT pg_create_logical_replication_slot('x', 'pgoutput')")

		// An active walsender holding the slot must not stop the cleanup.
		cfg, err := pgx.ParseConfig(url)
		if err != nil {
			t.Fatal(err)
		}
		cfg.RuntimeParams["replication"] = "database"
		repl, err := pgx.ConnectConfig(context.Background(), cfg)
		if err != nil {
			t.Fatalf("replication connection: %v", err)
		}
		if err := repl.PgConn().Exec(context.Background(),
			"CREATE_REPLICATION_SLOT y LOGICAL pgoutput NOEXPORT_SNAPSHOT").Close(); err != nil {
			repl.Close(context.Background())
			t.Fatalf("create slot over replication protocol: %v", err)
		}
		replDone = make(chan struct{})
		// The goroutine owns the connection: it streams until the cleanup
		// terminates its backend.
		go func() {
			defer close(replDone)
			defer repl.Close(context.Background())
			_ = repl.PgConn().Exec(context.Background(),
				"START_REPLICATION SLOT y LOGICAL 0/0 (proto_version '1', publication_names 'none')").Close()
		}()
		WaitFor(t, 10*time.Second, "slot y to become active", func() (bool, error) {
			var active bool
			err := admin.QueryRow(context.Background(),
				"SELECT active FROM pg_replication_slots WHERE slot_name = 'y'").Scan(&active)
			return active, err
		})
	})
	if dbname == "" || replDone == nil {
		t.Fatal("subtest did not set up the slots")
	}
	select {
	case <-replDone:
	case <-time.After(10 * time.Second):
		t.Fatal("walsender using slot y was not terminated by the cleanup")
	}
	var slots, dbs int
	if err := admin.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_replication_slots WHERE database = $1", dbname).Scan(&slots); err != nil {
		t.Fatal(err)
	}
	if err := admin.QueryRow(context.Background(),
		"SELECT count(*) FROM pg_database WHERE datname = $1", dbname).Scan(&dbs); err != nil {
		t.Fatal(err)
	}
	if slots != 0 || dbs != 0 {
		t.Errorf("after cleanup: %d slots and %d databases named %s remain", slots, dbs, dbname)
	}
}

func TestPostgresRestartKeepsData(t *testing.T) {
	pg, err := StartPostgres(PostgresOptions{Conf: map[string]string{"application_name": "testenv"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	url := pg.CreateDatabase(t)
	ctx := context.Background()
	func() {
		conn := connect(t, url)
		defer conn.Close(ctx)
		mustExec(t, conn, "CREATE TABLE kv (k int PRIMARY KEY)")
		mustExec(t, conn, "INSERT INTO kv VALUES (1)")
	}()
	port := pg.Port()
	for i, mode := range []string{"fast", "immediate", "smart"} {
		if err := pg.Restart(mode); err != nil {
			t.Fatalf("restart %s: %v", mode, err)
		}
		if pg.Port() != port {
			t.Fatalf("port changed from %d to %d", port, pg.Port())
		}
		conn := connect(t, url)
		mustExec(t, conn, "INSERT INTO kv VALUES ($1)", i+2)
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM kv").Scan(&n); err != nil {
			t.Fatalf("after %s restart: %v", mode, err)
		}
		if n != i+2 {
			t.Fatalf("after %s restart: %d rows, want %d", mode, n, i+2)
		}
		conn.Close(ctx)
	}
	if err := pg.Stop("fast"); err != nil {
		t.Fatal(err)
	}
	if err := pg.Stop("fast"); err == nil {
		t.Error("Stop of a stopped server succeeded")
	}
	if _, err := pgx.Connect(ctx, url); err == nil {
		t.Error("connected to a stopped server")
	}
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	if err := pg.Start(); err == nil {
		t.Error("Start of a running server succeeded")
	}
	log, err := os.ReadFile(pg.LogPath())
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(log), "database system was interrupted") &&
		!strings.Contains(string(log), "database system was not properly shut down") {
		t.Errorf("log does not mention crash recovery after the immediate stop:\n%s", log)
	}
}

func TestCreateDatabaseCleanupToleratesStoppedServer(t *testing.T) {
	pg, err := StartPostgres(PostgresOptions{Fsync: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	t.Run("stopped", func(t *testing.T) {
		pg.CreateDatabase(t)
		if err := pg.Stop("immediate"); err != nil {
			t.Fatal(err)
		}
	})
	var fsync string
	if err := pg.Start(); err != nil {
		t.Fatal(err)
	}
	if err := connect(t, pg.URL("postgres")).QueryRow(context.Background(), "SHOW fsync").Scan(&fsync); err != nil {
		t.Fatal(err)
	}
	if fsync != "on" {
		t.Errorf("fsync = %q, want on", fsync)
	}
}

func TestNATSKillKeepsMessages(t *testing.T) {
	n, err := StartNATS(NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	env := &Env{NATS: n}
	stream, prefix := env.StreamName(t)
	ctx := context.Background()

	nc, err := nats.Connect(n.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name: stream, Subjects: []string{prefix + ">"}, Storage: jetstream.FileStorage,
	}); err != nil {
		t.Fatalf("create stream %s on %s: %v", stream, prefix+">", err)
	}
	if _, err := js.Publish(ctx, prefix+"a", []byte("hello"), jetstream.WithMsgID("id-1")); err != nil {
		t.Fatal(err)
	}

	if err := n.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}

	var msg *jetstream.RawStreamMsg
	WaitFor(t, 10*time.Second, "message after restart", func() (bool, error) {
		s, err := js.Stream(ctx, stream)
		if err != nil {
			return false, err
		}
		msg, err = s.GetMsg(ctx, 1)
		return err == nil, err
	})
	if string(msg.Data) != "hello" || msg.Header.Get(jetstream.MsgIDHeader) != "id-1" {
		t.Errorf("got %q with id %q", msg.Data, msg.Header.Get(jetstream.MsgIDHeader))
	}
	// The duplicate window survives the crash too.
	ack, err := js.Publish(ctx, prefix+"a", []byte("hello"), jetstream.WithMsgID("id-1"))
	if err != nil {
		t.Fatal(err)
	}
	if !ack.Duplicate {
		t.Error("republish after restart was not detected as duplicate")
	}

	if err := n.Restart(); err != nil {
		t.Fatal(err)
	}
	WaitFor(t, 10*time.Second, "stream after graceful restart", func() (bool, error) {
		s, err := js.Stream(ctx, stream)
		if err != nil {
			return false, err
		}
		info, err := s.Info(ctx)
		if err != nil {
			return false, err
		}
		return info.State.Msgs == 1, nil
	})
}

func TestNATSSyncAlways(t *testing.T) {
	n, err := StartNATS(NATSOptions{SyncAlways: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	nc, err := nats.Connect(n.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.x", []byte("x")); err != nil {
		t.Fatal(err)
	}
	// The server must have read the config file, and that file must mean
	// sync always to nats-server's own parser.
	log, err := os.ReadFile(n.LogPath())
	if err != nil {
		t.Fatal(err)
	}
	confPath := filepath.Join(filepath.Dir(n.LogPath()), "nats.conf")
	if !strings.Contains(string(log), "Using configuration file: "+confPath) {
		t.Errorf("log does not show that %s was used:\n%s", confPath, log)
	}
	opts, err := server.ProcessConfigFile(confPath)
	if err != nil {
		t.Fatal(err)
	}
	if !opts.SyncAlways {
		t.Errorf("%s does not set sync_interval: always", confPath)
	}
}

func TestStreamNamesAreValidAndCleanedUp(t *testing.T) {
	env := Shared(t)
	var stream string
	t.Run("odd name. with * and > chars", func(t *testing.T) {
		var prefix string
		stream, prefix = env.StreamName(t)
		if strings.ContainsAny(stream, " .*>") {
			t.Errorf("invalid stream name %q", stream)
		}
		token := strings.TrimSuffix(strings.SplitN(prefix, ".", 2)[1], ".")
		if strings.ContainsAny(token, " .*>") || !strings.HasSuffix(prefix, ".") {
			t.Errorf("invalid subject prefix %q", prefix)
		}
		other, _ := env.StreamName(t)
		if other == stream {
			t.Errorf("StreamName returned %q twice", stream)
		}
		nc, err := nats.Connect(env.NATS.URL())
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		js, _ := jetstream.New(nc)
		if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{
			Name: stream, Subjects: []string{prefix + ">"},
		}); err != nil {
			t.Fatalf("create stream %q on %q: %v", stream, prefix+">", err)
		}
	})
	nc, err := nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if _, err := js.Stream(context.Background(), stream); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("stream %s after cleanup: err = %v, want not found", stream, err)
	}
}

func TestSharedIsConcurrentSafe(t *testing.T) {
	var wg sync.WaitGroup
	envs := make([]*Env, 4)
	for i := range envs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			envs[i] = Shared(t)
		}()
	}
	wg.Wait()
	for _, e := range envs[1:] {
		if e != envs[0] {
			t.Fatal("Shared returned different environments")
		}
	}
}

func TestWaitFor(t *testing.T) {
	start := time.Now()
	calls := 0
	WaitFor(t, 5*time.Second, "third call", func() (bool, error) {
		calls++
		return calls == 3, errors.New("not yet")
	})
	if calls != 3 || time.Since(start) > 2*time.Second {
		t.Errorf("calls = %d after %v", calls, time.Since(start))
	}
}

func TestStartPostgresFailureShowsLog(t *testing.T) {
	pg, err := StartPostgres(PostgresOptions{Conf: map[string]string{"no_such_setting": "1"}})
	if err == nil {
		pg.Close()
		t.Fatal("StartPostgres with an unknown setting succeeded")
	}
	if !strings.Contains(err.Error(), `unrecognized configuration parameter "no_such_setting"`) {
		t.Errorf("error does not include the server's complaint from its log: %v", err)
	}
}
