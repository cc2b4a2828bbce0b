package docscheck

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// TestDesignPackageMapMatchesGoList fails when the package map in
// docs/design.md and what `go list` prints for both modules differ: a
// package added, removed or renamed, or an import arrow gained or lost,
// without the map saying so. Each difference is printed with the line the
// map should hold.
func TestDesignPackageMapMatchesGoList(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(root, "docs", "design.md"))
	if err != nil {
		t.Fatalf("read docs/design.md: %v", err)
	}
	documented, err := parsePackageMap(string(doc))
	if err != nil {
		t.Fatalf("docs/design.md: %v", err)
	}
	actual := map[string][]string{}
	for _, dir := range []string{root, filepath.Join(root, "proof")} {
		for pkg, imps := range listImports(t, dir) {
			actual[pkg] = imps
		}
	}
	if len(actual) < 20 {
		t.Fatalf("go list printed only %d packages of this repository; is it running in the right directories?", len(actual))
	}
	var pkgs []string
	for p := range actual {
		pkgs = append(pkgs, p)
	}
	for p := range documented {
		if _, ok := actual[p]; !ok {
			pkgs = append(pkgs, p)
		}
	}
	sort.Strings(pkgs)
	for _, p := range pkgs {
		want, inList := actual[p]
		got, inDoc := documented[p]
		switch {
		case !inList:
			t.Errorf("the package map in docs/design.md lists %s, which go list does not print: remove its line", p)
		case !inDoc:
			t.Errorf("the package map in docs/design.md lacks %s: add the line %q", p, mapLine(p, want))
		case strings.Join(got, " ") != strings.Join(want, " "):
			t.Errorf("the package map in docs/design.md says %q, go list says %q: replace the line", mapLine(p, got), mapLine(p, want))
		}
	}
}

// parsePackageMap reads the text block under "## Package map": a package
// per line, then "->" and the repository's packages it imports, if any.
func parsePackageMap(doc string) (map[string][]string, error) {
	_, after, ok := strings.Cut(doc, "\n## Package map\n")
	if !ok {
		return nil, errors.New(`no "## Package map" section`)
	}
	if end := strings.Index(after, "\n## "); end >= 0 {
		after = after[:end]
	}
	_, block, ok := strings.Cut(after, "\n```text\n")
	if !ok {
		return nil, errors.New("the package map section has no ```text block")
	}
	block, _, ok = strings.Cut(block, "```")
	if !ok {
		return nil, errors.New("the package map's ```text block is not closed")
	}
	m := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(block), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if len(f) > 1 && f[1] != "->" || len(f) == 2 {
			return nil, fmt.Errorf("package map line %q: want a package, then -> and the packages it imports, or the package alone", line)
		}
		if _, dup := m[f[0]]; dup {
			return nil, fmt.Errorf("package map lists %s twice", f[0])
		}
		var imps []string
		if len(f) > 2 {
			imps = append(imps, f[2:]...)
			sort.Strings(imps)
		}
		m[f[0]] = imps
	}
	return m, nil
}

// listImports runs go list in dir (a module's root) and returns each of its
// packages with the repository's packages it imports, both without the
// repository's module path.
func listImports(t *testing.T, dir string) map[string][]string {
	t.Helper()
	const self = "github.com/outbox-relay/outbox-relay"
	cmd := exec.Command("go", "list", "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", "./...")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			t.Fatalf("go list ./... in %s: %v\n%s", dir, err, ee.Stderr)
		}
		t.Fatalf("go list ./... in %s: %v", dir, err)
	}
	m := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		var imps []string
		for _, imp := range f[1:] {
			if rel, ok := strings.CutPrefix(imp, self+"/"); ok {
				imps = append(imps, rel)
			}
		}
		sort.Strings(imps)
		pkg, ok := strings.CutPrefix(f[0], self+"/")
		if !ok {
			t.Fatalf("go list in %s printed %s, outside this repository", dir, f[0])
		}
		m[pkg] = imps
	}
	return m
}

func mapLine(pkg string, imps []string) string {
	if len(imps) == 0 {
		return pkg
	}
	return fmt.Sprintf("%-24s -> %s", pkg, strings.Join(imps, " "))
}
