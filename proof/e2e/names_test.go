package e2e

import (
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Names the broker or PostgreSQL would refuse only after the relay started
// (it then retried forever) make the real binary exit 1 at once, with the
// flag and the fix, before the poller starts. Environment variables are
// checked the same way as flags.
func TestBadNamesFailAtStart(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	db := env.PG.URL("postgres")
	base := func(extra ...string) []string {
		return append([]string{"run"}, runArgs(db, env.NATS.URL(), stream, prefix, uniqueName("e2e_names"), "outbox_relay", extra...)...)
	}
	// --stream given only through OUTBOX_RELAY_STREAM: the same check.
	var fromEnv []string
	for _, a := range base() {
		if a != "--stream" && a != stream {
			fromEnv = append(fromEnv, a)
		}
	}
	for _, tc := range []struct {
		name     string
		args     []string
		env      []string
		contains []string
	}{
		{"stream with slash", base("--stream", "a/b"), nil, []string{`--stream "a/b"`, "path separator"}},
		{"stream from environment", fromEnv, []string{`OUTBOX_RELAY_STREAM=a\b`}, []string{`--stream "a\\b"`, "path separator"}},
		{"_INBOX prefix", base("--subject-prefix", "_INBOX."), nil, []string{`--subject-prefix "_INBOX."`, "reply"}},
		{"bad slot", base("--slot", "Bad-Slot"), nil, []string{`--slot "Bad-Slot"`, "lower-case letters"}},
		{"63-byte table", base("--table", strings.Repeat("t", 63)), nil, []string{"--table", "choose a table name of at most"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			start := time.Now()
			code, _, stderr := runCmd(t, tc.env, tc.args...)
			t.Logf("exit %d after %s; stderr:\n%s", code, time.Since(start), strings.TrimSpace(stderr))
			if code != 1 {
				t.Errorf("exit code %d, want 1", code)
			}
			for _, s := range tc.contains {
				if !strings.Contains(stderr, s) {
					t.Errorf("stderr does not mention %q", s)
				}
			}
			if strings.Contains(stderr, "poller started") {
				t.Error("the poller started before the name was refused")
			}
			if d := time.Since(start); d > 10*time.Second {
				t.Errorf("took %s to refuse", d)
			}
		})
	}
}
