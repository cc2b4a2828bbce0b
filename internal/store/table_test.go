package store

import (
	"io/fs"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/table"
	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

const maxIdentifier = table.MaxIdentifier

// goSuffixes are the suffixes this package's statements derive names with
// (TestDerivedNamesFit checks the list against the code).
var goSuffixes = []string{"slots", "redrives", "next_seq", "give_back_seq", "settings", "work_id_free", "partitioning", "add_partitions"}

// templateSuffix finds the names the migrations derive, {{.Name "x"}} and
// {{.Companion "x"}}.
var templateSuffix = regexp.MustCompile(`\{\{-?\s*\.(?:Name|Companion)\s+"([^"]*)"\s*-?\}\}`)

// longestSuffix is the longest suffix appended to the table's name, read
// from the embedded migrations so that a migration that adds a longer one
// (a constraint, an index) moves the limit with it instead of having its
// name cut.
var longestSuffix = func() string {
	longest := ""
	for _, s := range goSuffixes {
		if len(s) > len(longest) {
			longest = s
		}
	}
	entries, err := fs.ReadDir(outboxsql.Migrations, "migrations")
	if err != nil {
		panic("read embedded migrations: " + err.Error())
	}
	for _, e := range entries {
		src, err := fs.ReadFile(outboxsql.Migrations, "migrations/"+e.Name())
		if err != nil {
			panic("read embedded migration " + e.Name() + ": " + err.Error())
		}
		for _, m := range templateSuffix.FindAllStringSubmatch(string(src), -1) {
			if len(m[1]) > len(longest) {
				longest = m[1]
			}
		}
	}
	return longest
}()

// Every name the relay derives from the table must fit when the table name
// is MaxTableName bytes long: the limit is read from the migrations'
// templates, and this checks it against what they render and what the Go
// code derives, so a new suffix cannot slip past it.
func TestDerivedNamesFit(t *testing.T) {
	const name = "tbl"
	migs, err := schema.Migrations(Table{Schema: "s", Name: name})
	if err != nil {
		t.Fatal(err)
	}
	rendered := regexp.MustCompile(`"` + name + `_([^"]+)"`)
	suffixes := map[string]bool{}
	for _, m := range migs {
		for _, sub := range rendered.FindAllStringSubmatch(m.SQL, -1) {
			suffixes[sub[1]] = true
		}
	}
	if len(suffixes) == 0 {
		t.Fatal("found no derived names in the rendered migrations: the test no longer sees them")
	}
	// The Go statements' own derived names.
	var files []string
	for _, dir := range []string{".", "../enqueue"} {
		entries, err := os.ReadDir(dir)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range entries {
			files = append(files, dir+"/"+e.Name())
		}
	}
	call := regexp.MustCompile(`\.Derived\("([^"]+)"`)
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") || !strings.HasSuffix(f, ".go") {
			continue
		}
		src, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, sub := range call.FindAllStringSubmatch(string(src), -1) {
			suffixes[sub[1]] = true
			found := false
			for _, s := range goSuffixes {
				found = found || s == sub[1]
			}
			if !found {
				t.Errorf("%s derives <table>_%s, which goSuffixes lacks", f, sub[1])
			}
		}
	}
	longest := ""
	for s := range suffixes {
		if len(s) > len(longest) {
			longest = s
		}
		if n := MaxTableName() + len("_"+s); n > maxIdentifier {
			t.Errorf("<table>_%s is %d bytes for a %d-byte table name, over %d", s, n, MaxTableName(), maxIdentifier)
		}
	}
	if len(longestSuffix) != len(longest) {
		t.Errorf("longestSuffix = %q, but the longest derived suffix is %q", longestSuffix, longest)
	}
	if table.LongestSuffix != longestSuffix {
		t.Errorf("table.LongestSuffix = %q, but the migrations' and statements' longest is %q: set it so", table.LongestSuffix, longestSuffix)
	}
	long := Table{Schema: "s", Name: strings.Repeat("t", MaxTableName())}
	if got := long.Derived(longestSuffix, false); got != `"`+long.Name+"_"+longestSuffix+`"` {
		t.Errorf("derived %s = %s: cut", longestSuffix, got)
	}
	t.Logf("longest suffix %q: table names of at most %d bytes", longestSuffix, MaxTableName())
}

func TestParseTableLength(t *testing.T) {
	limit := MaxTableName()
	at := func(n int) string { return strings.Repeat("a", n) }
	for _, s := range []string{at(limit), "s." + at(limit), strings.Repeat("s", 63) + ".outbox"} {
		if _, err := ParseTable(s); err != nil {
			t.Errorf("ParseTable(%d bytes): %v", len(s), err)
		}
	}
	for s, want := range map[string]string{
		at(limit + 1):                       "table name is " + strconv.Itoa(limit+1) + " bytes, but at most " + strconv.Itoa(limit) + " fit",
		at(63):                              "choose a table name of at most " + strconv.Itoa(limit) + " bytes",
		"s." + at(63):                       "at most " + strconv.Itoa(limit),
		at(64):                              "table name is 64 bytes, longer than PostgreSQL's 63",
		strings.Repeat("s", 64) + ".outbox": "schema name is 64 bytes",
		"":                                  "empty table name",
		".x":                                "empty schema name",
		"a.b.c":                             "may not contain a dot",
	} {
		_, err := ParseTable(s)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "--table") {
			t.Errorf("ParseTable(%.20q...) = %v, want an error naming --table with %q", s, err, want)
		}
	}
}
