package wire_test

import (
	"errors"
	"os/exec"
	"sort"
	"strings"
	"testing"
)

// The message format is what the sinks publish, so the arrow runs from
// sinks to wire only: a sink (sinks/jetstream) checks subjects and header
// sizes with wire's rules, and wire names neither the broker interface nor
// any broker. An import the other way would make the format depend on one
// sink's package, and the public packages (outbox, inbox) that use wire
// would inherit it.
func TestWireImportsNoSink(t *testing.T) {
	const self = "github.com/outbox-relay/outbox-relay"
	// The test runs in the package's directory, so "." is internal/wire.
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
	if !deps[self+"/internal/wire"] {
		t.Fatalf("go list printed no internal/wire among the dependencies; is this the package's directory?\n%s", out)
	}
	var bad []string
	for dep := range deps {
		if dep == self+"/sinks" || strings.HasPrefix(dep, self+"/sinks/") {
			bad = append(bad, dep)
		}
	}
	sort.Strings(bad)
	for _, dep := range bad {
		by := importers[dep]
		sort.Strings(by)
		t.Errorf("internal/wire depends on %s (imported by %s): the message and its rejection error are the format's, in wire; a sink imports wire, never the other way", dep, strings.Join(by, ", "))
	}
}
