package store

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

// ParseTable reads the --table flag: "name" (schema public) or "schema.name".
func ParseTable(s string) (Table, error) {
	schema, name := "public", s
	if i := strings.IndexByte(s, '.'); i >= 0 {
		schema, name = s[:i], s[i+1:]
	}
	for _, part := range []struct{ what, v string }{{"schema", schema}, {"table", name}} {
		if part.v == "" {
			return Table{}, fmt.Errorf("--table %q: empty %s name; use name or schema.name", s, part.what)
		}
		if len(part.v) > 63 {
			return Table{}, fmt.Errorf("--table %q: %s name longer than PostgreSQL's 63 bytes", s, part.what)
		}
		if strings.ContainsRune(part.v, 0) || strings.Contains(part.v, ".") {
			return Table{}, fmt.Errorf("--table %q: %s name may not contain a dot or NUL; use name or schema.name", s, part.what)
		}
	}
	return Table{Schema: schema, Name: name}, nil
}

// String is the quoted, schema-qualified name, safe to splice into SQL.
func (t Table) String() string { return pgx.Identifier{t.Schema, t.Name}.Sanitize() }

// Qualified is the unquoted schema.name, for messages and keys.
func (t Table) Qualified() string { return t.Schema + "." + t.Name }

// Derived returns the quoted name of an object that belongs to the table
// (index, constraint), in the table's schema when qualify is set. Names are
// cut to PostgreSQL's 63-byte limit the same way every time, so migrations
// find what they created.
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
