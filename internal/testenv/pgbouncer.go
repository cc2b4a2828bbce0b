package testenv

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PgBouncerBin is Debian's PgBouncer (apt-get install pgbouncer; .ci/run
// installs it): 1.18, which has no protocol-level prepared statements in
// transaction mode and passes no replication connection through, the
// pooler a managed service's "pooled endpoint" is most like.
const PgBouncerBin = "/usr/sbin/pgbouncer"

// PgBouncer is a PgBouncer in front of one PostgreSQL server, in
// transaction pooling mode, on a free port, for t only.
type PgBouncer struct {
	port int
	dir  string
}

// StartPgBouncer starts PgBouncer in transaction pooling mode in front of
// pg, trusting the users named (PgBouncer's own check; the server checks
// them again), and stops it when t ends. A server connection serves a
// client only for one transaction at a time, like the pooled endpoints of
// managed services: session state (a prepared statement, a session lock,
// a SET) does not follow the client. Four server connections a database
// and user, fewer than a relay's pool: clients take turns on them, so
// state one leaves on a server connection meets another.
func StartPgBouncer(t testing.TB, pg *Postgres, users ...string) *PgBouncer {
	t.Helper()
	if _, err := os.Stat(PgBouncerBin); err != nil {
		t.Fatalf("PgBouncer is not installed (%v): apt-get install pgbouncer (.ci/run does)", err)
	}
	// Not t.TempDir: PgBouncer runs as postgres when the tests run as root,
	// and t.TempDir's parent is root's alone.
	dir, err := os.MkdirTemp("", "pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var auth strings.Builder
	for _, u := range append([]string{"postgres"}, users...) {
		fmt.Fprintf(&auth, "%q \"\"\n", u)
	}
	if err = os.WriteFile(filepath.Join(dir, "users.txt"), []byte(auth.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	conf := fmt.Sprintf(`[databases]
* = host=127.0.0.1 port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
pool_mode = transaction
max_client_conn = 500
default_pool_size = 4
server_reset_query =
logfile = %s
pidfile = %s
`, pg.Port(), port, filepath.Join(dir, "users.txt"), filepath.Join(dir, "pgbouncer.log"), filepath.Join(dir, "pgbouncer.pid"))
	ini := filepath.Join(dir, "pgbouncer.ini")
	if err := os.WriteFile(ini, []byte(conf), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(PgBouncerBin, ini)
	if os.Geteuid() == 0 {
		// PgBouncer refuses to run as root; the server's own user runs it.
		cmd.Args = []string{PgBouncerBin, "-u", "postgres", ini}
		if err := chownAll(dir, "postgres"); err != nil {
			t.Fatal(err)
		}
	}
	out, err := os.Create(filepath.Join(dir, "stdout.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start pgbouncer: %v", err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-done
		_ = out.Close()
	})
	b := &PgBouncer{port: port, dir: dir}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		conn, err := pgx.Connect(ctx, b.URL("postgres"))
		if err == nil {
			_ = conn.Close(ctx)
			cancel()
			return b
		}
		cancel()
		select {
		case <-done:
			log, _ := os.ReadFile(filepath.Join(dir, "stdout.log"))
			log2, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			t.Fatalf("pgbouncer exited: %s%s", log, log2)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("pgbouncer on port %d not ready: %v", port, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// URL is database dbname through the pooler, as the superuser.
func (b *PgBouncer) URL(dbname string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", b.port, url.PathEscape(dbname))
}

// Port is the port PgBouncer listens on.
func (b *PgBouncer) Port() int { return b.port }

// Log is what PgBouncer logged so far.
func (b *PgBouncer) Log() string {
	log, _ := os.ReadFile(filepath.Join(b.dir, "pgbouncer.log"))
	return string(log)
}

func chownAll(dir, user string) error {
	out, err := exec.Command("id", "-u", user).Output()
	if err != nil {
		return fmt.Errorf("look up user %s: %w", user, err)
	}
	uid, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	out, err = exec.Command("id", "-g", user).Output()
	if err != nil {
		return fmt.Errorf("look up group of %s: %w", user, err)
	}
	gid, _ := strconv.Atoi(strings.TrimSpace(string(out)))
	return filepath.Walk(dir, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Chown(p, uid, gid)
	})
}
