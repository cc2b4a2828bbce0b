package console_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

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
