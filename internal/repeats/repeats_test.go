package repeats

import (
	"bytes"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// 70,000 repeats in a burst write 2 lines, not 70,000: the first with its
// work ID, then one summary counting the other 69,999, with 5 examples.
func TestRepeatsAreSummarised(t *testing.T) {
	var buf bytes.Buffer
	now := time.Date(2026, 12, 2, 9, 0, 0, 0, time.UTC)
	l := New(zerolog.New(&buf), "duplicate ack", 10*time.Second)
	l.now = func() time.Time { return now }
	for i := range 70000 {
		l.Add(fmt.Sprintf("w-%d", i), "OUTBOX", uint64(i+1))
	}
	if lines := strings.Count(buf.String(), "\n"); lines != 1 {
		t.Fatalf("%d lines during the burst, want 1:\n%s", lines, buf.String())
	}
	now = now.Add(11 * time.Second)
	l.Add("w-last", "OUTBOX", 70001)
	l.Flush()
	out := buf.String()
	if lines := strings.Count(out, "\n"); lines != 2 {
		t.Fatalf("%d lines, want 2:\n%s", lines, out)
	}
	if !strings.Contains(out, `"work_id":"w-0"`) || !strings.Contains(out, `"repeats":70000`) || !strings.Contains(out, `"work_ids":["w-1","w-2","w-3","w-4","w-5"]`) {
		t.Errorf("lines do not say what repeated:\n%s", out)
	}
	l.Flush()
	if strings.Count(buf.String(), "\n") != 2 {
		t.Error("a flush with nothing counted wrote a line")
	}
}
