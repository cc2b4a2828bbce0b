package main

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/config"
)

// run's flags whose zero the library takes as "use the default" used to run
// silently with the default when given 0 (--max-attempts 0 ran with 10
// attempts, --lease 0 with 30s); a million-hour --deadline-margin expired
// every row with a deadline. Each is refused with its range before anything
// connects: the URLs below lead nowhere, and the refusal must come first.
func TestRunRefusesZeroAndOutOfRangeFlags(t *testing.T) {
	nowhere := []string{"--database-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=1", "--nats-url", "nats://127.0.0.1:1"}
	cases := []struct {
		flag, value, want string
	}{
		{"max-attempts", "0", "--max-attempts 0: must be at least 1"},
		{"max-attempts", "-3", "--max-attempts -3: must be at least 1"},
		{"lease", "0", "--lease 0s: must be longer than --ack-timeout 10s"},
		{"lease", "-1s", "--lease -1s: must be longer than --ack-timeout 10s"},
		{"poll-batch", "0", "--poll-batch 0: must be at least 1"},
		{"poll-pipeline", "0", "--poll-pipeline 0: must be at least 1"},
		{"status-interval", "0", "--status-interval 0s: must be more than 0"},
		{"max-in-flight-bytes", "0", "--max-in-flight-bytes 0: must be at least 1"},
		{"max-in-flight-bytes", "-1", "--max-in-flight-bytes -1: must be at least 1"},
		{"max-buffered-bytes", "0", "--max-buffered-bytes 0: must be at least 1"},
		{"drain-timeout", "0", "--drain-timeout 0s: must be more than 0"},
		{"poll-interval", "0", "--poll-interval 0s: must be more than 0"},
		{"backoff-min", "0", "--backoff-min 0s: must be more than 0"},
		{"backoff-max", "0", "--backoff-max 0s: must be more than 0"},
		{"stream-replicas", "0", "--stream-replicas 0: must be at least 1"},
		{"deadline-margin", "0", "--deadline-margin 0s: must be more than 0 and at most 24h0m0s"},
		{"deadline-margin", "1000000h", "--deadline-margin 1000000h0m0s: must be more than 0 and at most 24h0m0s"},
		{"deadline-margin", "24h0m1s", "--deadline-margin 24h0m1s: must be more than 0 and at most 24h0m0s"},
	}
	check := func(t *testing.T, args []string, want string) {
		t.Helper()
		start := time.Now()
		code, errOut := runWithin(t, 10*time.Second, args...)
		if code != 1 || !strings.Contains(errOut, "outbox-relay run: "+want) {
			t.Errorf("exit %d, stderr %q; want 1 and %q", code, errOut, want)
		}
		if strings.Contains(errOut, "connect to") {
			t.Errorf("stderr %q: it tried to connect before refusing the flag", errOut)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Errorf("the refusal took %v", took)
		}
	}
	for _, c := range cases {
		t.Run(c.flag+"="+c.value, func(t *testing.T) {
			check(t, append([]string{"run", "--" + c.flag, c.value}, nowhere...), c.want)
		})
	}
	// The same from the environment, as an env file would set it.
	t.Run("env", func(t *testing.T) {
		t.Setenv(config.EnvName("poll-batch"), "0")
		check(t, append([]string{"run"}, nowhere...), "--poll-batch 0: must be at least 1")
	})
	// The defaults and the bounds themselves pass the checks: run goes on to
	// connect, and fails there.
	for _, extra := range [][]string{nil, {"--deadline-margin", "24h"}, {"--deadline-margin", "1ms"}, {"--max-attempts", "1", "--poll-batch", "1", "--poll-pipeline", "1"}} {
		code, errOut := runWithin(t, 30*time.Second, append(append([]string{"run"}, extra...), nowhere...)...)
		if code != 1 || !strings.Contains(errOut, "connect to PostgreSQL") {
			t.Errorf("run %v: exit %d, stderr %q; want it to pass the checks and fail to connect", extra, code, errOut)
		}
	}
}

// redrive --stagger of a million hours scheduled the second row 114 years
// ahead; it is refused with the maximum, and nothing moves.
func TestRedriveRefusesStaggerAboveMaximum(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('f1', 'k', '{}', 'failed'), ('f2', 'k', '{}', 'failed')`)
	for _, s := range []string{"1000000h", "1h0m1s"} {
		code, _, errOut := run(t, "redrive", "--database-url", url, "--state", "failed", "--reason", "r", "--stagger", s)
		if want := "--stagger " + mustDuration(t, s).String() + ": must be from 0 to 1h0m0s"; code != 1 || !strings.Contains(errOut, want) {
			t.Errorf("--stagger %s: exit %d, stderr %q; want 1 and %q", s, code, errOut, want)
		}
		if n := countRows(t, pool, "state = 'failed'"); n != 2 {
			t.Fatalf("after --stagger %s: %d rows failed, want both untouched", s, n)
		}
	}
	code, out, _ := run(t, "redrive", "--database-url", url, "--state", "failed", "--reason", "r", "--stagger", "1h")
	if code != 0 || !strings.Contains(out, "redrove 2 rows") {
		t.Fatalf("--stagger 1h: exit %d, %q", code, out)
	}
	if n := countRows(t, pool, "state = 'scheduled' AND available_at BETWEEN clock_timestamp() + interval '50 minutes' AND clock_timestamp() + interval '1 hour'"); n != 1 {
		t.Errorf("%d rows due about an hour from now, want the second of two staggered by 1h", n)
	}
}

func mustDuration(t *testing.T, s string) time.Duration {
	t.Helper()
	d, err := time.ParseDuration(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}
