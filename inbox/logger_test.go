package inbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
)

// lockedBuffer collects a JSON handler's lines; the inbox may log from
// several goroutines.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) records(t *testing.T) []map[string]any {
	t.Helper()
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(b.buf.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, rec)
	}
	return out
}

// TestLoggerIsSlog: Config.Logger is the standard library's *slog.Logger.
// A rejection is an error record and a handler failure a warning, each with
// the inbox's and the message's identity as attributes; with no Logger the
// inbox writes nothing, not even to slog's default logger. Not parallel: it
// replaces slog's default logger for the nil case.
func TestLoggerIsSlog(t *testing.T) {
	f := newFixture(t, fixtureOpts{})

	// Nil: quiet, including slog's default logger.
	var dflt lockedBuffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewJSONHandler(&dflt, &slog.HandlerOptions{Level: slog.LevelDebug})))
	quiet, err := inbox.New(f.pool, inbox.Config{Consumer: "billing"})
	if err != nil {
		slog.SetDefault(prev)
		t.Fatal(err)
	}
	f.publish("", `{"x":0}`, nil)
	out, err := quiet.Process(context.Background(), f.fetch(5*time.Second), apply)
	slog.SetDefault(prev)
	expect(t, "no Nats-Msg-Id, no logger", out, inbox.Rejected, err)
	if recs := dflt.records(t); len(recs) != 0 {
		t.Errorf("an inbox without a Logger wrote %d records to slog's default logger: %v", len(recs), recs)
	}

	var logged lockedBuffer
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.Logger = slog.New(slog.NewJSONHandler(&logged, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	f.publish("", `{"x":1}`, nil)
	out, err = in.Process(context.Background(), f.fetch(5*time.Second), apply)
	expect(t, "no Nats-Msg-Id", out, inbox.Rejected, err)
	// Last: its redelivery is not fetched.
	f.publish("m-fails", `{"x":2}`, nil)
	boom := errors.New("boom")
	out, err = in.Process(context.Background(), f.fetch(5*time.Second), func(context.Context, pgx.Tx, jetstream.Msg) error { return boom })
	expect(t, "handler failure", out, inbox.Retrying, err)

	recs := logged.records(t)
	if len(recs) != 2 {
		t.Fatalf("got %d log records, want 2 (the rejection and the retry; debug records filtered by the handler's level): %v", len(recs), recs)
	}
	want := []map[string]any{
		{"level": "ERROR", "msg": "message rejected and terminated; not applied", "component": "inbox", "consumer": "billing",
			"msg_id": "", "subject": f.subject, "delivered": 1.0, "reason": "no_msg_id"},
		{"level": "WARN", "msg": "handler failed; rolled back, redelivering", "component": "inbox", "consumer": "billing",
			"msg_id": "m-fails", "subject": f.subject, "delivered": 1.0},
	}
	for i, w := range want {
		for k, v := range w {
			if recs[i][k] != v {
				t.Errorf("record %d: %s = %#v, want %#v (record %v)", i, k, recs[i][k], v, recs[i])
			}
		}
	}
	if e, _ := recs[0]["error"].(string); !strings.Contains(e, "Nats-Msg-Id") {
		t.Errorf("rejection record's error = %q, want the missing header named", e)
	}
	if e, _ := recs[1]["error"].(string); !strings.Contains(e, "boom") {
		t.Errorf("retry record's error = %q, want the handler's error", e)
	}
	if _, ok := recs[1]["redeliver_in"]; !ok {
		t.Errorf("retry record has no redeliver_in: %v", recs[1])
	}
}
