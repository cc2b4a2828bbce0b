// Package docscheck holds only tests: every repository path and every Go test,
// fuzz target or benchmark that the README and docs/ cite must exist, so a
// rename or a move fails `make test` instead of sending a reader to nothing.
package docscheck

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
)

// root is the repository root, seen from proof/docscheck.
var root = filepath.Join("..", "..")

// topDirs are the repository's top-level folders: a cited token that starts
// with one of them (after an optional ./) is a path in this repository.
func topDirs(t *testing.T, dir string) []string {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read repository root: %v", err)
	}
	var dirs []string
	for _, e := range entries {
		if e.IsDir() && e.Name() != ".git" {
			dirs = append(dirs, e.Name())
		}
	}
	return dirs
}

// docFiles are the documents a reader follows: the README and docs/*.md.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{filepath.Join(root, "README.md")}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, more...)
	if len(files) < 5 {
		t.Fatalf("found %d documents (%v); the check is looking in the wrong place", len(files), files)
	}
	return files
}

var (
	// A code span, or a link target.
	codeSpan   = regexp.MustCompile("`([^`\n]+)`")
	linkTarget = regexp.MustCompile(`\]\(([^)#\s]+)(?:#[^)]*)?\)`)
	// A word within a span: paths are split from commands around them.
	word = regexp.MustCompile(`[A-Za-z0-9_./*<>-]+`)
	// Test, fuzz and benchmark names; a subtest after / is not checked.
	testName = regexp.MustCompile(`\b(?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*`)
	testFunc = regexp.MustCompile(`(?m)^func ((?:Test|Fuzz|Benchmark)[A-Z][A-Za-z0-9_]*)\(`)
)

// candidatePath turns a cited word into a repository path to check, or ""
// when the word is not one (a URL path, a subject, another repository's).
func candidatePath(w string, tops []string) string {
	w = strings.TrimPrefix(w, "./")
	w = strings.TrimSuffix(w, "/...")
	w = strings.TrimRight(w, ".,:;")
	// A Go symbol after a package path: sinks/jetstream.(*Sink).Publish.
	if i := strings.Index(w, ".("); i > 0 {
		w = w[:i]
	}
	if strings.ContainsAny(w, "<>") {
		return ""
	}
	first, _, _ := strings.Cut(w, "/")
	for _, d := range tops {
		if first == d {
			return w
		}
	}
	// Top-level files the docs name by path.
	switch w {
	case "README.md", "go.mod", "Makefile", "Dockerfile", "docker-compose.yml":
		return w
	}
	return ""
}

// definedTests is every Test, Fuzz and Benchmark function in the
// repository's _test.go files (both modules).
func definedTests(t *testing.T) map[string]bool {
	t.Helper()
	defined := map[string]bool{}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range testFunc.FindAllStringSubmatch(string(src), -1) {
			defined[m[1]] = true
		}
		return nil
	})
	if err != nil {
		t.Fatalf("walk the repository for tests: %v", err)
	}
	if len(defined) < 100 {
		t.Fatalf("found only %d test functions; the walk is looking in the wrong place", len(defined))
	}
	return defined
}

// TestDocsCiteWhatExists fails for every path or test name in the README and
// docs/ that is not in the repository.
func TestDocsCiteWhatExists(t *testing.T) {
	tops := topDirs(t, root)
	proofTops := topDirs(t, filepath.Join(root, "proof"))
	defined := definedTests(t)
	missing := map[string][]string{} // citation -> documents citing it
	paths, tests := 0, 0
	for _, doc := range docFiles(t) {
		src, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		text := string(src)
		rel, _ := filepath.Rel(root, doc)
		docDir := filepath.Dir(doc)

		for _, m := range codeSpan.FindAllStringSubmatch(text, -1) {
			// A command that starts in proof/ names that module's paths.
			base, candTops := root, tops
			if strings.Contains(m[1], "cd proof") {
				base, candTops = filepath.Join(root, "proof"), proofTops
			}
			for _, w := range word.FindAllString(m[1], -1) {
				p := candidatePath(w, candTops)
				if p == "" && base != root {
					p = candidatePath(w, tops)
				}
				if p == "" {
					continue
				}
				paths++
				if !exists(filepath.Join(base, p)) && !exists(filepath.Join(root, p)) {
					missing[p] = append(missing[p], rel)
				}
			}
		}
		for _, m := range linkTarget.FindAllStringSubmatch(text, -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			paths++
			if !exists(filepath.Join(docDir, target)) {
				missing[target+" (link)"] = append(missing[target+" (link)"], rel)
			}
		}
		for _, name := range testName.FindAllString(text, -1) {
			tests++
			if !defined[name] {
				missing[name] = append(missing[name], rel)
			}
		}
	}
	// The check must have read something: a regexp that matches nothing
	// would pass any document.
	if paths < 50 || tests < 50 {
		t.Fatalf("checked %d paths and %d test names; expected far more, the patterns are broken", paths, tests)
	}
	t.Logf("checked %d cited paths and %d cited test names", paths, tests)
	var keys []string
	for k := range missing {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		t.Errorf("%s cited in %s does not exist in the repository", k, strings.Join(uniq(missing[k]), ", "))
	}
}

// TestCandidatePath pins which words count as repository paths.
func TestCandidatePath(t *testing.T) {
	tops := []string{"internal", "proof", "sinks", "docs"}
	for in, want := range map[string]string{
		"./internal/e2e/":                 "internal/e2e/",
		"./proof/e2e/...":                 "proof/e2e",
		"sinks/jetstream.(*Sink).Publish": "sinks/jetstream",
		"internal/app/http.go,":           "internal/app/http.go",
		"/readyz":                         "",
		"outbox.orders":                   "",
		"internal/<pkg>":                  "",
		"docs/guarantees.md":              "docs/guarantees.md",
		"Makefile":                        "Makefile",
	} {
		if got := candidatePath(in, tops); got != want {
			t.Errorf("candidatePath(%q) = %q, want %q", in, got, want)
		}
	}
}

func exists(p string) bool {
	if strings.ContainsAny(p, "*?[") {
		m, err := filepath.Glob(p)
		return err == nil && len(m) > 0
	}
	_, err := os.Stat(p)
	return err == nil
}

func uniq(s []string) []string {
	sort.Strings(s)
	out := s[:0]
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}
