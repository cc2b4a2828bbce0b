package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

const consoleToken = "console-token-for-tests"

// The console command serves the console without streaming: its role is
// "console only", the standbys it was told of are shown, and it stops on
// its context.
func TestConsoleCommand(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error) VALUES ('c-1', 'k', '{}', 'failed', 'rejected: max_payload: big')`)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var errOut testenv.LogBuffer
	done := make(chan error, 1)
	go func() {
		done <- runConsole(ctx, []string{"--database-url", url, "--http-addr", addr, "--console-token", consoleToken,
			"--standby-slot", "replica_1"}, io.Discard, &errOut)
	}()
	get := func(path string) (int, string, error) {
		req, _ := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
		req.SetBasicAuth("ops", consoleToken)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), err
	}
	var body string
	testenv.WaitFor(t, 20*time.Second, "the console serving", func() (bool, error) {
		var code int
		code, body, err = get("/ui/")
		return code == 200, err
	})
	for _, want := range []string{`id="role">console only<`, "rejected: max_payload", "replica_1", "no such slot", "basic auth user ops"} {
		if !strings.Contains(body, want) {
			t.Errorf("the console command's overview lacks %q", want)
		}
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("console: %v\n%s", err, errOut.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the console command did not stop on its context")
	}
}

func TestConsoleCommandRefusesOpenAddress(t *testing.T) {
	code, _, errOut := run(t, "console", "--http-addr", "0.0.0.0:0", "--database-url", "postgres://u:hunter2@127.0.0.1:1/x")
	if code != 1 || !strings.Contains(errOut, "--console-token") || strings.Contains(errOut, "hunter2") {
		t.Errorf("console on 0.0.0.0 without a token: exit %d, %q", code, errOut)
	}
}

// A blank or short --console-token is refused at start, before anything
// connects, by both commands that serve the console, naming the minimum
// and never printing the token.
func TestConsoleTokenRefusedAtStart(t *testing.T) {
	for _, c := range []struct{ name, token string }{{"short", "hunter2-short"}, {"blank", "   "}, {"16 spaces", strings.Repeat(" ", 16)}} {
		for _, args := range [][]string{
			{"console", "--http-addr", "127.0.0.1:0"},
			{"run", "--console", "--http-addr", "127.0.0.1:0", "--nats-url", "nats://127.0.0.1:1"},
		} {
			t.Run(c.name+"/"+args[0], func(t *testing.T) {
				start := time.Now()
				code, _, errOut := run(t, append(args, "--console-token", c.token, "--database-url", "postgres://u:pw@127.0.0.1:1/x")...)
				if code != 1 || !strings.Contains(errOut, "--console-token") || !strings.Contains(errOut, "at least 16") {
					t.Errorf("exit %d, %q: want 1 and the minimum", code, errOut)
				}
				if strings.Contains(errOut, "hunter2") || strings.Contains(errOut, "connect") {
					t.Errorf("stderr prints the token or tried to connect first: %q", errOut)
				}
				if d := time.Since(start); d > 5*time.Second {
					t.Errorf("took %s to refuse", d)
				}
			})
		}
	}
}
