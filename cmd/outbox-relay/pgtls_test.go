package main

import (
	"context"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// A managed service's endpoint wants TLS with the server's certificate
// checked (sslmode=verify-full against the provider's CA). The relay's
// pool and its replication connection both go through it: run publishes,
// status reads. Against a CA that did not sign the server's certificate
// the connection is refused, and the error says why.
func TestPostgresVerifyFull(t *testing.T) {
	t.Parallel() // a server of its own
	// PostgreSQL runs as its own user: the files' directory (and the one
	// t.TempDir makes above it) must let it in.
	dir := t.TempDir()
	for _, d := range []string{dir, filepath.Dir(dir)} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	ca, cert, key := writeTLSFiles(t, dir)
	// PostgreSQL reads its key only if the key is private to it: owned by
	// root and readable by the postgres group, or owned by postgres.
	if os.Geteuid() == 0 {
		g, err := user.LookupGroup("postgres")
		if err != nil {
			t.Fatal(err)
		}
		gid, _ := strconv.Atoi(g.Gid)
		for _, f := range []string{cert.server, ca} {
			if err := os.Chmod(f, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.Chown(key.server, 0, gid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(key.server, 0o640); err != nil {
			t.Fatal(err)
		}
	}
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: map[string]string{
		"ssl": "on", "ssl_cert_file": cert.server, "ssl_key_file": key.server,
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pg.Close)
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=verify-full&sslrootcert=%s", pg.Port(), ca)

	// Another CA: refused.
	otherCA, _, _ := writeTLSFiles(t, t.TempDir())
	bad := strings.Replace(url, ca, otherCA, 1)
	if code, _, errOut := run(t, "status", "--database-url", bad); code == 0 || !strings.Contains(errOut, "certificate") {
		t.Fatalf("status with another CA exited %d, stderr %q: want a refusal about the certificate", code, errOut)
	}

	pool := migratedAt(t, url) // over verify-full
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	runOne(t, []string{"run", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix}, func() {
		mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) SELECT 'tls-' || i, 'k', '{}' FROM generate_series(1, 20) i`)
		testenv.WaitFor(t, 30*time.Second, "20 rows published over TLS", func() (bool, error) {
			var n int
			err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == 20, err
		})
		// Both of the relay's kinds of connection use TLS.
		var plain, tls int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE NOT s.ssl), count(*) FILTER (WHERE s.ssl)
			FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) WHERE a.application_name = 'outbox-relay'`).Scan(&plain, &tls)
		if err != nil || plain != 0 || tls < 2 {
			t.Errorf("the relay's connections: %d without TLS, %d with (%v); want none without, its pool and its walsender with", plain, tls, err)
		}
	})
	code, out, _ := run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "published=20") {
		t.Fatalf("status over verify-full exited %d:\n%s", code, out)
	}
}
