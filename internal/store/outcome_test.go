package store_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

func TestClassNotes(t *testing.T) {
	for _, c := range store.Classes {
		n := c.Notef("%s: %d", "reason", 7)
		if n != string(c)+": reason: 7" || !c.Of(n) {
			t.Errorf("%s: note %q, Of %v", c, n, c.Of(n))
		}
		for _, other := range store.Classes {
			if other != c && other.Of(n) {
				t.Errorf("%s's note %q is also %s's", c, n, other)
			}
		}
		if want := `x LIKE '` + string(c) + `:%'`; c.Like("x") != want {
			t.Errorf("%s: Like %q, want %q", c, c.Like("x"), want)
		}
	}
}

// One place writes the classes and one matches them: no other file of the
// module spells a class's prefix in a string ("rejected: ..." in Go,
// 'rejected: ...' or LIKE 'rejected...' in SQL). Test data and fixtures
// (testenv) may, and so may package inbox, whose words are the
// consumer's, not a row's.
func TestClassesAreSpelledOnlyInOutcome(t *testing.T) {
	var words []string
	for _, c := range store.Classes {
		words = append(words, string(c))
	}
	spelled := regexp.MustCompile(`["'](` + strings.Join(words, "|") + `)(:|%)`)
	root := "../.."
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case "proof", "node_modules", "testenv", ".git", "inbox":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") || strings.HasSuffix(path, "internal/store/outcome.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(src), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "//") {
				continue
			}
			if m := spelled.FindString(line); m != "" {
				t.Errorf("%s:%d spells a class (%s): write it with a store.Class (Note, Notef, Of, Like)", path, i+1, m)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
