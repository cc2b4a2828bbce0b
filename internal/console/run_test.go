package console_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// runOptions are a relay's options on a fresh database and stream.
func runOptions(t *testing.T, httpAddr string) app.Options {
	t.Helper()
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	tbl := testenv.OutboxTable
	return app.Options{
		DatabaseURL: dbURL, NATSURL: env.NATS.URL(), Table: tbl, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark, DuplicateWindow: 2 * time.Minute,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20, HTTPAddr: httpAddr,
		Lease: 5 * time.Second, PollInterval: 50 * time.Millisecond,
	}
}

// TestRunServesConsole runs the relay with --console: the console is on
// --http-addr under /ui/ beside the probes, and shows this instance's role.
func TestRunServesConsole(t *testing.T) {
	o := runOptions(t, "127.0.0.1:0")
	o.Console = console.Options{Enabled: true, Token: token}
	addr := make(chan string, 1)
	o.Listening = func(a string) { addr <- a }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, o, zerolog.New(io.Discard)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		done <- err
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	get := func(path string, auth bool) (int, string, error) {
		req, _ := http.NewRequest(http.MethodGet, base+path, nil)
		if auth {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), err
	}
	if code, _, err := get("/ui/api/health", false); err != nil || code != http.StatusUnauthorized {
		t.Errorf("unauthenticated health: %d %v, want 401", code, err)
	}
	testenv.WaitFor(t, 30*time.Second, "the console showing role active", func() (bool, error) {
		code, body, err := get("/ui/", true)
		return code == 200 && strings.Contains(body, `id="role">active<`), fmt.Errorf("%d %v", code, err)
	})
	if code, body, err := get("/readyz", false); err != nil || code != 200 {
		t.Errorf("/readyz beside the console: %d %q %v", code, body, err)
	}
}

// TestRunRefusesOpenConsole: run --console on an address other machines
// reach, without a token, does not start.
func TestRunRefusesOpenConsole(t *testing.T) {
	o := runOptions(t, ":0")
	o.Console = console.Options{Enabled: true}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	err := app.Run(ctx, o, zerolog.New(io.Discard))
	if !errors.Is(err, console.ErrInsecureAddr) {
		t.Fatalf("app.Run with an open console and no token: %v, want ErrInsecureAddr", err)
	}
	// Read-only does not make it acceptable: the pages show every payload.
	o.Console.ReadOnly = true
	if err := app.Run(ctx, o, zerolog.New(io.Discard)); !errors.Is(err, console.ErrInsecureAddr) {
		t.Fatalf("read-only, no token: %v, want ErrInsecureAddr", err)
	}
}

// G16: the console cannot stall delivery. Twelve previews of a redrive wait
// on a row another transaction holds locked; they run on the console's own
// few connections (app.ObserverMaxConns), so a new row is still published
// at once. Before, they held all of the relay's pool and the row waited for
// the lock (17 s in the attack that found it). The previews then end with the
// statement timeout or the lock's release, not never.
func TestConsoleCannotStallDelivery(t *testing.T) {
	o := runOptions(t, "127.0.0.1:0")
	o.Console = console.Options{Enabled: true, Token: token}
	addr := make(chan string, 1)
	o.Listening = func(a string) { addr <- a }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- app.Run(ctx, o, zerolog.New(io.Discard)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		done <- err
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	pool, err := pgxpool.New(ctx, o.DatabaseURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	published := func(id string) bool {
		var state string
		err := pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = $1`, id).Scan(&state)
		return err == nil && state == "published"
	}
	// The relay is streaming: a first row goes through.
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('before', 'k', '{}')`); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 30*time.Second, "the first row published", func() (bool, error) { return published("before"), nil })

	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error)
		VALUES ('stuck', 'k', '{}', 'failed', 3, 'rejected: x')`); err != nil {
		t.Fatal(err)
	}
	do := func(method, path string, form url.Values) (int, string) {
		var body io.Reader
		if form != nil {
			body = strings.NewReader(form.Encode())
		}
		req, _ := http.NewRequestWithContext(ctx, method, base+path, body)
		req.Header.Set("Authorization", "Bearer "+token)
		if form != nil {
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, page := do(http.MethodGet, "/ui/row?id="+enc("stuck"), nil)
	m := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(page)
	if code != http.StatusOK || m == nil {
		t.Fatalf("row page: %d, no CSRF token in %.300s", code, page)
	}

	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(ctx)
	if _, err := lock.Exec(ctx, `SELECT 1 FROM outbox WHERE work_id = 'stuck' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	const previews = 12
	answered := make(chan int, previews)
	for range previews {
		go func() {
			c, _ := do(http.MethodPost, "/ui/preview", url.Values{"csrf": {m[1]}, "action": {"redrive"}, "reason": {"INC-1"},
				"deadline": {"keep"}, "id": {enc("stuck")}})
			answered <- c
		}()
	}
	// The previews are waiting on the lock, on every connection they can get.
	testenv.WaitFor(t, 30*time.Second, "previews waiting on the locked row", func() (bool, error) {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
		return n >= app.ObserverMaxConns, fmt.Errorf("%d waiting: %v", n, err)
	})
	start := time.Now()
	if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('during', 'k', '{}')`); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 5*time.Second, "a new row published while the previews wait", func() (bool, error) { return published("during"), nil })
	took := time.Since(start)
	select {
	case c := <-answered:
		t.Fatalf("a preview answered %d while the row was locked: the test did not hold them", c)
	default:
	}
	t.Logf("published in %v with %d previews waiting on a lock", took.Round(time.Millisecond), previews)
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for range previews {
		select {
		case <-answered:
		case <-time.After(2 * app.ObserverStatementTimeout * previews / app.ObserverMaxConns):
			t.Fatal("a preview never answered after the lock was released")
		}
	}
}
