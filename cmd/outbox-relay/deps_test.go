package main

import (
	"errors"
	"os/exec"
	"sort"
	"strings"
	"testing"
)

// The binary links only the product: no test apparatus (package testing
// adds its flags and runtime hooks to every program that imports it), no
// testenv, nothing of the proof module. The demo's throwaway servers come
// from internal/devenv for this reason.
func TestBinaryLinksNoTestCode(t *testing.T) {
	// The test runs in the package's directory, so "." is cmd/outbox-relay.
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", ".").Output()
	if err != nil {
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			t.Fatalf("go list -deps .: %v\n%s", err, ee.Stderr)
		}
		t.Fatalf("go list -deps .: %v", err)
	}
	importers := map[string][]string{} // dependency -> packages that import it
	deps := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		deps[f[0]] = true
		for _, imp := range f[1:] {
			importers[imp] = append(importers[imp], f[0])
		}
	}
	if !deps["github.com/outbox-relay/outbox-relay/internal/app"] {
		t.Fatalf("go list printed no internal/app among the dependencies; is this the binary's package?\n%s", out)
	}
	var bad []string
	for dep := range deps {
		if dep == "testing" || strings.HasPrefix(dep, "testing/") ||
			dep == "github.com/outbox-relay/outbox-relay/internal/testenv" ||
			dep == "github.com/outbox-relay/outbox-relay/proof" ||
			strings.HasPrefix(dep, "github.com/outbox-relay/outbox-relay/proof/") {
			bad = append(bad, dep)
		}
	}
	sort.Strings(bad)
	for _, dep := range bad {
		by := importers[dep]
		sort.Strings(by)
		t.Errorf("the outbox-relay binary depends on %s (imported by %s)", dep, strings.Join(by, ", "))
	}
}
