package logbridge

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// The public packages' records reach the binary's log with the zerolog
// logger's level filter, its fields, and their own attributes as fields.
func TestSlogWritesThroughZerolog(t *testing.T) {
	var buf bytes.Buffer
	zl := zerolog.New(&buf).Level(zerolog.WarnLevel).With().Str("app", "relay").Logger()
	l := Slog(zl).With(slog.String("component", "inbox")).WithGroup("g")
	l.Info("filtered out")
	l.Warn("kept", slog.Int64("n", 3), slog.Duration("wait", 2*time.Second), slog.Any("error", errors.New("boom")),
		slog.Group("sub", slog.Bool("ok", true)))
	var rec map[string]any
	if err := json.Unmarshal(bytes.TrimSpace(buf.Bytes()), &rec); err != nil {
		t.Fatalf("want exactly one JSON record, got %q: %v", buf.String(), err)
	}
	want := map[string]any{"level": "warn", "message": "kept", "app": "relay", "component": "inbox",
		"g.n": 3.0, "g.wait": 2000.0, "g.error": "boom", "g.sub.ok": true}
	for k, v := range want {
		if rec[k] != v {
			t.Errorf("%s = %#v, want %#v (record %v)", k, rec[k], v, rec)
		}
	}
	if len(rec) != len(want) {
		t.Errorf("record has %d fields, want %d: %v", len(rec), len(want), rec)
	}
}
