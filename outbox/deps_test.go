package outbox_test

import (
	"encoding/json"
	"errors"
	"os/exec"
	"sort"
	"strings"
	"testing"
)

// The public packages are imported by applications, so what they pull in is
// pulled into every application: pgx, nats.go and the standard library, no
// more. In particular no logging library (they take a *slog.Logger) and
// nothing of the binary's or the tests' (zerolog, Prometheus, chromedp),
// including through the internal packages they use. What pgx and nats.go
// themselves import is theirs and not checked.
func TestPublicPackagesDependOnlyOnPgxNATSAndTheStandardLibrary(t *testing.T) {
	const self = "github.com/outbox-relay/outbox-relay"
	allowed := map[string]bool{"github.com/jackc/pgx/v5": true, "github.com/nats-io/nats.go": true}
	// The test runs in outbox/, so "." is outbox and "../inbox" inbox.
	roots := []string{self + "/outbox", self + "/inbox"}
	out, err := exec.Command("go", "list", "-deps",
		"-f", "{{.ImportPath}}\t{{.Standard}}\t{{with .Module}}{{.Path}}{{end}}\t{{join .Imports \" \"}}", ".", "../inbox").Output()
	if err != nil {
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			t.Fatalf("go list -deps . ../inbox: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps . ../inbox: %v", err)
	}
	type pkg struct {
		std     bool
		module  string
		imports []string
	}
	pkgs := map[string]pkg{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 4 {
			t.Fatalf("go list printed %q; want four tab-separated fields", line)
		}
		pkgs[f[0]] = pkg{std: f[1] == "true", module: f[2], imports: strings.Fields(f[3])}
	}
	for _, r := range roots {
		if _, ok := pkgs[r]; !ok {
			t.Fatalf("go list printed no %s; is this the outbox package's directory?\n%s", r, out)
		}
	}
	// Walk from the roots through the standard library and this module's
	// packages; stop at pgx and nats.go; anything else reached is a
	// dependency the applications would inherit.
	via := map[string]string{} // package -> the package that imports it on the walk
	seen := map[string]bool{}
	queue := append([]string(nil), roots...)
	var bad []string
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if seen[p] {
			continue
		}
		seen[p] = true
		info, ok := pkgs[p]
		if !ok {
			t.Fatalf("go list printed no entry for %s (imported by %s)", p, via[p])
		}
		switch {
		case info.std, info.module == self:
		case allowed[info.module]:
			continue
		default:
			bad = append(bad, p)
			continue
		}
		for _, imp := range info.imports {
			if _, done := via[imp]; !done {
				via[imp] = p
			}
			queue = append(queue, imp)
		}
	}
	sort.Strings(bad)
	for _, p := range bad {
		chain := []string{p}
		for q := via[p]; q != ""; q = via[q] {
			chain = append(chain, q)
		}
		for i, j := 0, len(chain)-1; i < j; i, j = i+1, j-1 {
			chain[i], chain[j] = chain[j], chain[i]
		}
		t.Errorf("public packages depend on %s (module %s): %s", p, pkgs[p].module, strings.Join(chain, " -> "))
	}
}

// Applications that import the public packages resolve the product module's
// requirements: the browser test's chromedp lives in the proof module
// (proof/console), not here.
func TestProductModuleRequiresNoBrowserTooling(t *testing.T) {
	out, err := exec.Command("go", "mod", "edit", "-json", "../go.mod").Output()
	if err != nil {
		t.Fatalf("go mod edit -json ../go.mod: %v", err)
	}
	var mod struct {
		Module  struct{ Path string }
		Require []struct{ Path string }
	}
	if err := json.Unmarshal(out, &mod); err != nil {
		t.Fatalf("go mod edit -json: %v", err)
	}
	if mod.Module.Path != "github.com/outbox-relay/outbox-relay" {
		t.Fatalf("../go.mod is module %q, want the product's", mod.Module.Path)
	}
	for _, r := range mod.Require {
		if strings.HasPrefix(r.Path, "github.com/chromedp/") {
			t.Errorf("the product module requires %s; browser tests belong in proof/ (its own module)", r.Path)
		}
	}
}

// An application that imports outbox links what enqueueing needs: the
// table's name rules, the producer's statements and the message format's
// checks. Not the store (the relay's statements, the migrations' SQL), which
// it used to pull in whole.
func TestOutboxLinksOnlyWhatEnqueueingNeeds(t *testing.T) {
	const self = "github.com/outbox-relay/outbox-relay/"
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps .: %v", err)
	}
	want := map[string]bool{"internal/table": true, "internal/enqueue": true, "internal/wire": true, "outbox": true}
	var got []string
	for _, p := range strings.Fields(string(out)) {
		if rest, ok := strings.CutPrefix(p, self); ok {
			got = append(got, rest)
			if !want[rest] {
				t.Errorf("outbox links %s: applications would carry it; move what enqueueing needs out of it", p)
			}
		}
	}
	if len(got) != len(want) {
		t.Errorf("outbox links %v of this module, want exactly %v", got, want)
	}
}
