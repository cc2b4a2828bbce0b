// Package table names the outbox table and the objects derived from it.
// It is apart from the store so that the producer's package (outbox), which
// every application links, carries the name rules and nothing of the
// relay's statements.
package table

import (
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Table names the outbox table. Every identifier built from it is quoted, so
// any name PostgreSQL accepts works and none can inject SQL.
type Table struct {
	Schema string
	Name   string
}

// MaxIdentifier is PostgreSQL's identifier limit (NAMEDATALEN - 1 bytes).
// A longer name is silently truncated by the server, not refused.
const MaxIdentifier = 63

// LongestSuffix is the longest suffix the relay appends to the table's name
// (<table>_<suffix>: companions, indexes, constraints). The store's
// TestDerivedNamesFit holds it to what the migrations and the statements
// derive, so that a migration adding a longer one moves the limit with it
// instead of having its name cut.
const LongestSuffix = "redrives_work_id_idx"

// MaxName is the longest table name, in bytes, whose derived names all fit
// in an identifier. With a longer one, derived names are cut to 63 bytes
// and can collapse into the table's own name: CREATE TABLE IF NOT EXISTS
// <table>_slots then finds the outbox table and creates nothing, and run
// retries forever on `column "slot_name" does not exist`.
func MaxName() int { return MaxIdentifier - len("_"+LongestSuffix) }

// Parse reads the --table flag: "name" (schema public) or "schema.name".
// Every command parses --table through it, so every command refuses a name
// the relay cannot build its objects from before it connects.
func Parse(s string) (Table, error) {
	schema, name := "public", s
	if i := strings.IndexByte(s, '.'); i >= 0 {
		schema, name = s[:i], s[i+1:]
	}
	for _, part := range []struct{ what, v string }{{"schema", schema}, {"table", name}} {
		if part.v == "" {
			return Table{}, fmt.Errorf("--table %q: empty %s name; use name or schema.name", s, part.what)
		}
		if len(part.v) > MaxIdentifier {
			return Table{}, fmt.Errorf("--table %q: %s name is %d bytes, longer than PostgreSQL's %d; choose a shorter one", s, part.what, len(part.v), MaxIdentifier)
		}
		if strings.ContainsRune(part.v, 0) || strings.Contains(part.v, ".") {
			return Table{}, fmt.Errorf("--table %q: %s name may not contain a dot or NUL; use name or schema.name", s, part.what)
		}
	}
	if limit := MaxName(); len(name) > limit {
		return Table{}, fmt.Errorf("--table %q: table name is %d bytes, but at most %d fit: the relay names its objects after the table (<table>_%s) and PostgreSQL cuts names at %d bytes; choose a table name of at most %d bytes",
			s, len(name), limit, LongestSuffix, MaxIdentifier, limit)
	}
	return Table{Schema: schema, Name: name}, nil
}

// String is the quoted, schema-qualified name, safe to splice into SQL.
func (t Table) String() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// Qualified is the unquoted schema.name, for messages and keys.
func (t Table) Qualified() string { return t.Schema + "." + t.Name }

// Derived returns the quoted name of an object that belongs to the table
// (index, constraint, companion table or function), in the table's schema
// when qualify is set. Parse keeps these names within PostgreSQL's 63-byte
// limit; for a Table built without it they are cut the same way every time,
// so migrations find what they created.
func (t Table) Derived(suffix string, qualify bool) string {
	n := t.DerivedName(suffix)
	if qualify {
		return pgx.Identifier{t.Schema, n}.Sanitize()
	}
	return pgx.Identifier{n}.Sanitize()
}

// DerivedName is the unquoted name Derived quotes.
func (t Table) DerivedName(suffix string) string {
	n := t.Name + "_" + suffix
	if len(n) > MaxIdentifier {
		n = n[:MaxIdentifier]
	}
	return n
}
