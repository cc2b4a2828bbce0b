package store

import (
	"fmt"
	"io/fs"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"

	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

// Table names the outbox table. Every identifier built from it is quoted, so
// any name PostgreSQL accepts works and none can inject SQL.
type Table struct {
	Schema string
	Name   string
}

// maxIdentifier is PostgreSQL's identifier limit (NAMEDATALEN - 1 bytes).
// A longer name is silently truncated by the server, not refused.
const maxIdentifier = 63

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

// MaxTableName is the longest table name, in bytes, whose derived names
// (<table>_slots, <table>_redrives, index and constraint names) all fit in
// an identifier. With a longer one, derived names are cut to 63 bytes and
// can collapse into the table's own name: CREATE TABLE IF NOT EXISTS
// <table>_slots then finds the outbox table and creates nothing, and run
// retries forever on `column "slot_name" does not exist`.
func MaxTableName() int { return maxIdentifier - len("_"+longestSuffix) }

// ParseTable reads the --table flag: "name" (schema public) or "schema.name".
// Every command parses --table through it, so every command refuses a name
// the relay cannot build its objects from before it connects.
func ParseTable(s string) (Table, error) {
	schema, name := "public", s
	if i := strings.IndexByte(s, '.'); i >= 0 {
		schema, name = s[:i], s[i+1:]
	}
	for _, part := range []struct{ what, v string }{{"schema", schema}, {"table", name}} {
		if part.v == "" {
			return Table{}, fmt.Errorf("--table %q: empty %s name; use name or schema.name", s, part.what)
		}
		if len(part.v) > maxIdentifier {
			return Table{}, fmt.Errorf("--table %q: %s name is %d bytes, longer than PostgreSQL's %d; choose a shorter one", s, part.what, len(part.v), maxIdentifier)
		}
		if strings.ContainsRune(part.v, 0) || strings.Contains(part.v, ".") {
			return Table{}, fmt.Errorf("--table %q: %s name may not contain a dot or NUL; use name or schema.name", s, part.what)
		}
	}
	if limit := MaxTableName(); len(name) > limit {
		return Table{}, fmt.Errorf("--table %q: table name is %d bytes, but at most %d fit: the relay names its objects after the table (<table>_%s) and PostgreSQL cuts names at %d bytes; choose a table name of at most %d bytes",
			s, len(name), limit, longestSuffix, maxIdentifier, limit)
	}
	return Table{Schema: schema, Name: name}, nil
}

// String is the quoted, schema-qualified name, safe to splice into SQL.
func (t Table) String() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// Qualified is the unquoted schema.name, for messages and keys.
func (t Table) Qualified() string { return t.Schema + "." + t.Name }

// Derived returns the quoted name of an object that belongs to the table
// (index, constraint), in the table's schema when qualify is set. ParseTable
// keeps these names within PostgreSQL's 63-byte limit; for a Table built
// without it they are cut the same way every time, so migrations find what
// they created.
func (t Table) derived(suffix string, qualify bool) string {
	n := t.Name + "_" + suffix
	if len(n) > 63 {
		n = n[:63]
	}
	if qualify {
		return pgx.Identifier{t.Schema, n}.Sanitize()
	}
	return pgx.Identifier{n}.Sanitize()
}
