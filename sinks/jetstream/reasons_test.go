package jetstream_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// TestRejectionReasonsMatchDocs holds the docs to the reason constants: an
// operator who finds "rejected: <reason>" in last_error finds it explained
// in docs/ (the runbook's table of reasons, docs/troubleshooting.md), and no
// page of docs/ names a reason the relay cannot write.
func TestRejectionReasonsMatchDocs(t *testing.T) {
	reasons := append(slices.Clone(wire.Reasons), jetstream.Reasons...)
	if len(slices.Compact(slices.Sorted(slices.Values(reasons)))) != len(reasons) {
		t.Fatalf("a reason is listed twice in wire.Reasons and jetstream.Reasons: %q", reasons)
	}
	mentioned := map[string]bool{}
	cite := regexp.MustCompile("rejected: ([a-z_]+)")
	files, err := filepath.Glob("../../docs/*.md")
	if err != nil || len(files) < 10 {
		t.Fatalf("found %d pages in docs/ (%v); the test is looking in the wrong place", len(files), err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range cite.FindAllStringSubmatch(string(b), -1) {
			mentioned[m[1]] = true
			if !slices.Contains(reasons, m[1]) {
				t.Errorf("%s names rejection reason %q, which the relay never writes (known: %q)", f, m[1], reasons)
			}
		}
	}
	for _, r := range reasons {
		if !mentioned[r] {
			t.Errorf("rejection reason %q is explained nowhere in docs/ (write it as `rejected: %s` in docs/runbook.md's table of reasons or in docs/troubleshooting.md)", r, r)
		}
	}
}
