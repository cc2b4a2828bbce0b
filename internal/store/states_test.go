package store_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// TestStatesMatchMigrationsAndDocs holds the three places that spell out
// the states to the one list in states.go: the table's CHECK constraint as
// the latest migration that defines it leaves it, and the states table in
// docs/design.md (state names in order, and which of them block the later
// rows of an aggregate).
func TestStatesMatchMigrationsAndDocs(t *testing.T) {
	t.Run("migrations", func(t *testing.T) {
		files, err := filepath.Glob("../../sql/migrations/*.sql")
		if err != nil || len(files) == 0 {
			t.Fatalf("read sql/migrations: %v (%d files)", err, len(files))
		}
		sort.Strings(files)
		check := regexp.MustCompile(`CHECK \(state IN \(([^)]*)\)\)`)
		var latest, from string
		for _, f := range files {
			b, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range check.FindAllStringSubmatch(string(b), -1) {
				latest, from = m[1], filepath.Base(f)
			}
		}
		if latest == "" {
			t.Fatal("no migration defines CHECK (state IN (...))")
		}
		var got []string
		for _, lit := range strings.Split(latest, ",") {
			got = append(got, strings.Trim(strings.TrimSpace(lit), "'"))
		}
		if !slices.Equal(got, store.States) {
			t.Errorf("%s's CHECK allows states %q; internal/store/states.go lists %q: add a migration that changes the CHECK, or fix the list", from, got, store.States)
		}
	})

	t.Run("docs", func(t *testing.T) {
		b, err := os.ReadFile("../../docs/design.md")
		if err != nil {
			t.Fatal(err)
		}
		doc := string(b)
		i := strings.Index(doc, "\n## States\n")
		if i < 0 {
			t.Fatal("docs/design.md has no ## States section")
		}
		sec := doc[i+1:]
		if j := strings.Index(sec[3:], "\n## "); j >= 0 {
			sec = sec[:j+3]
		}
		var states, blocking []string
		for _, line := range strings.Split(sec, "\n") {
			cells := strings.Split(strings.Trim(line, "| "), "|")
			if !strings.HasPrefix(line, "| ") || len(cells) != 3 {
				continue
			}
			name := strings.TrimSpace(cells[0])
			if name == "state" || strings.HasPrefix(name, "---") {
				continue
			}
			states = append(states, name)
			if strings.HasPrefix(strings.TrimSpace(cells[2]), "yes") {
				blocking = append(blocking, name)
			}
		}
		if !slices.Equal(states, store.States) {
			t.Errorf("docs/design.md's states table lists %q; internal/store/states.go lists %q", states, store.States)
		}
		if !slices.Equal(blocking, store.BlockingStates) {
			t.Errorf("docs/design.md's states table says %q block later rows of an aggregate; internal/store/states.go's BlockingStates is %q", blocking, store.BlockingStates)
		}
	})

	t.Run("lists", func(t *testing.T) {
		for _, s := range store.BlockingStates {
			if !slices.Contains(store.States, s) {
				t.Errorf("blocking state %q is not a state", s)
			}
		}
		want := slices.DeleteFunc(slices.Clone(store.BlockingStates), func(s string) bool { return s == store.StateReady })
		if !slices.Equal(store.WithPollerStates, want) {
			t.Errorf("WithPollerStates %q: want the blocking states but ready, %q", store.WithPollerStates, want)
		}
	})
}
