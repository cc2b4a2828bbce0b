package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The demo against given servers: every committed order reaches the stream
// once, the rolled-back one never, the slot ends confirmed, and the inbox
// consumer applies each effect once although every message is delivered twice.
func TestDemoOnGivenServers(t *testing.T) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	var out, errb bytes.Buffer
	code := mainErr([]string{"demo", "--database-url", env.PG.CreateDatabase(t), "--nats-url", env.NATS.URL(),
		"--stream", stream, "--subject-prefix", prefix, "--slot", "demo_test"}, &out, &errb)
	t.Logf("demo output:\n%s\n%s", out.String(), errb.String())
	if code != 0 {
		t.Fatalf("demo exited %d", code)
	}
	for _, want := range []string{
		"5 rows committed, 5 in the stream (0 duplicates), 1 rolled back and 0 published by mistake, 5 rows marked published",
		"consumer: 10 deliveries, 5 effects applied, 5 duplicates dropped by the inbox",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the demo's output lacks %q", want)
		}
	}
}

// Without --nats-url the demo starts a nats-server; when the one it is told
// to use does not exist, the error says every way to fix that, before
// anything was started or connected.
func TestDemoWithoutNATSServerSaysHowToFix(t *testing.T) {
	t.Setenv("OUTBOX_RELAY_NATS_SERVER", "/nonexistent/nats-server")
	code, out, errOut := run(t, "demo", "--database-url", "postgres://nobody@127.0.0.1:1/none")
	if code != 1 {
		t.Fatalf("demo exited %d, want 1", code)
	}
	if strings.Contains(out, "starting") {
		t.Errorf("the demo started something:\n%s", out)
	}
	for _, want := range []string{"/nonexistent/nats-server", "--nats-url", "install nats-server", "OUTBOX_RELAY_NATS_SERVER"} {
		if !strings.Contains(errOut, want) {
			t.Errorf("the error lacks %q: %s", want, errOut)
		}
	}
}
