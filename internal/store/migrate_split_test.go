package store

import (
	"reflect"
	"strings"
	"testing"
)

// A no-transaction migration is cut at the semicolons that end statements,
// and at no other: not in strings (with either escape), quoted
// identifiers, dollar-quoted bodies or comments.
func TestSplitStatements(t *testing.T) {
	src := `-- outbox-relay: no-transaction
-- a comment; with a semicolon and a quote '
CREATE TABLE "odd;name" (a text CHECK (a <> ';'), b text CHECK (b !~ E'\\\';x'));
/* a block; /* nested; */ still; */ ALTER TABLE t ADD COLUMN IF NOT EXISTS c text;
CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS $fn$ SELECT 1; SELECT 2 $fn$;
CREATE FUNCTION g() RETURNS text LANGUAGE sql AS $$ SELECT 'x;y' $$;
SELECT 'it''s; fine', a$b FROM t
-- trailing comment only;
`
	got, err := splitStatements(src)
	if err != nil {
		t.Fatal(err)
	}
	heads := make([]string, len(got))
	for i, s := range got {
		heads[i] = stripLeadingComments(s)
	}
	want := []string{
		`CREATE TABLE "odd;name" (a text CHECK (a <> ';'), b text CHECK (b !~ E'\\\';x'))`,
		`ALTER TABLE t ADD COLUMN IF NOT EXISTS c text`,
		`CREATE OR REPLACE FUNCTION f() RETURNS int LANGUAGE sql AS $fn$ SELECT 1; SELECT 2 $fn$`,
		`CREATE FUNCTION g() RETURNS text LANGUAGE sql AS $$ SELECT 'x;y' $$`,
		"SELECT 'it''s; fine', a$b FROM t\n-- trailing comment only;",
	}
	if !reflect.DeepEqual(heads, want) {
		t.Errorf("statements:\n%q\nwant\n%q", heads, want)
	}
	for _, bad := range []string{`SELECT 'open`, `SELECT "open`, `SELECT $x$ open`, `/* open`} {
		if _, err := splitStatements(bad); err == nil {
			t.Errorf("%q: split without error, want unterminated", bad)
		}
	}
}

// The embedded no-transaction migrations split into the statements they
// were written as, and a no-transaction migration may build an index only
// in the form a retry can repeat.
func TestNoTransactionMigrations(t *testing.T) {
	migs, err := Migrations(Table{Schema: "public", Name: "outbox"})
	if err != nil {
		t.Fatal(err)
	}
	counts := map[int]int{}
	for _, m := range migs {
		if m.NoTransaction {
			counts[m.Version] = len(m.Statements)
		}
	}
	// 0006: the columns, the state check, its validation, the index, the
	// counter table, two functions with their REVOKEs, the redrives column.
	if counts[1] != 2 || counts[6] != 10 {
		t.Errorf("statements per no-transaction migration: %v; want 0001: 2, 0006: 10", counts)
	}
	for _, m := range migs {
		if m.Version == 6 && !strings.Contains(m.Statements[2], "VALIDATE CONSTRAINT") {
			t.Errorf("0006 statement 3: %q, want the validation", m.Statements[2])
		}
	}
	for _, bad := range []string{
		"CREATE INDEX IF NOT EXISTS x ON t (a)",
		"CREATE INDEX CONCURRENTLY x ON t (a)",
		"create unique index concurrently on t (a)",
	} {
		if _, err := newMigration(99, "x", noTransactionMarker+"\n"+bad+";\n"); err == nil || !strings.Contains(err.Error(), "CONCURRENTLY IF NOT EXISTS") {
			t.Errorf("%q: %v; want refused with the form to use", bad, err)
		}
	}
	if m, err := newMigration(99, "x", "CREATE INDEX IF NOT EXISTS x ON t (a);"); err != nil || m.NoTransaction {
		t.Errorf("a migration without the marker: %+v, %v; want one transaction", m, err)
	}
}
