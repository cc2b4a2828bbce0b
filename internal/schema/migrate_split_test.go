package schema

import (
	"fmt"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"
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
		if _, err := newMigration(99, "x", noTransactionMarker+"\n"+bad+";\n", Table{}, Layout{}); err == nil || !strings.Contains(err.Error(), "CONCURRENTLY IF NOT EXISTS") {
			t.Errorf("%q: %v; want refused with the form to use", bad, err)
		}
	}
	if m, err := newMigration(99, "x", "CREATE INDEX IF NOT EXISTS x ON t (a);", Table{}, Layout{}); err != nil || m.NoTransaction {
		t.Errorf("a migration without the marker: %+v, %v; want one transaction", m, err)
	}
}

// The embedded migrations follow the rules at the top of migrate.go, so
// that none holds a lock producers queue behind while it reads or rewrites
// a table: an index on an existing table is built CONCURRENTLY in a
// no-transaction migration, a constraint is added NOT VALID and validated
// on its own, and nothing rewrites the table. A migration written with a
// plain CREATE INDEX on the outbox table fails here with what to do.
//
// A partitioned table (migrate --partition-interval) is held to the same
// rules, but for one: PostgreSQL cannot build an index CONCURRENTLY on a
// partitioned table, so there a build on the outbox table itself is a plain
// CREATE INDEX IF NOT EXISTS, which the migrator runs only while the table
// holds no rows (a new table; see migrator.statement).
func TestMigrationsDoNotBlockProducers(t *testing.T) {
	for _, l := range []Layout{{}, {PartitionInterval: time.Hour}} {
		t.Run(fmt.Sprintf("partitioned=%v", l.Partitioned()), func(t *testing.T) { migrationsDoNotBlockProducers(t, l) })
	}
}

func migrationsDoNotBlockProducers(t *testing.T, l Layout) {
	migs, err := MigrationsFor(Table{Schema: "public", Name: "outbox"}, l)
	if err != nil {
		t.Fatal(err)
	}
	plainIndex := regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\s+IF\s+NOT\s+EXISTS\s+\S+\s+ON\s+"public"\."outbox"\s`)
	qident := identRE + `(?:\.` + identRE + `)?`
	createTable := regexp.MustCompile(`(?is)^CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?(` + qident + `)`)
	indexOn := regexp.MustCompile(`(?is)^CREATE\s+(?:UNIQUE\s+)?INDEX\b.*?\bON\s+(?:ONLY\s+)?(` + qident + `)`)
	alter := regexp.MustCompile(`(?is)^ALTER\s+TABLE\s+(?:IF\s+EXISTS\s+)?(?:ONLY\s+)?(` + qident + `)`)
	rewrites := regexp.MustCompile(`(?is)\bSET\s+NOT\s+NULL\b|\bALTER\s+COLUMN\s+\S+\s+(?:SET\s+DATA\s+)?TYPE\b|\bSTORED\b|\bSET\s+(?:UN)?LOGGED\b|\bSET\s+TABLESPACE\b`)
	forbidden := regexp.MustCompile(`(?is)^(?:VACUUM\s+FULL|CLUSTER|LOCK\s+TABLE|REINDEX)\b`)
	const outbox = `"public"."outbox"`
	for _, m := range migs {
		stmts := m.Statements
		if !m.NoTransaction {
			if stmts, err = splitStatements(m.SQL); err != nil {
				t.Fatalf("%04d_%s: %v", m.Version, m.Name, err)
			}
		}
		created := map[string]bool{}
		for _, s := range stmts {
			head := stripLeadingComments(s)
			if sub := createTable.FindStringSubmatch(head); sub != nil && sub[1] != outbox {
				created[sub[1]] = true
			}
		}
		where := fmt.Sprintf("%04d_%s", m.Version, m.Name)
		for _, s := range stmts {
			head := stripLeadingComments(s)
			short := head
			if len(short) > 100 {
				short = short[:100] + "..."
			}
			if l.Partitioned() && m.NoTransaction && createIndex.MatchString(head) && !indexBuild.MatchString(head) && !plainIndex.MatchString(head) {
				t.Errorf("%s: %q: on a partitioned table only the outbox table's own index builds lose CONCURRENTLY", where, short)
			}
			if sub := indexOn.FindStringSubmatch(head); sub != nil && !created[sub[1]] && !m.NoTransaction {
				t.Errorf("%s: %q builds an index on %s, an existing table, inside the migration's transaction, which blocks every INSERT while it builds: put %q on the migration's first line and write CREATE INDEX CONCURRENTLY IF NOT EXISTS (internal/schema/migrate.go)",
					where, short, sub[1], noTransactionMarker)
			}
			if sub := alter.FindStringSubmatch(head); sub != nil && !created[sub[1]] {
				if adds, notValid := len(regexp.MustCompile(`(?i)\bADD\s+CONSTRAINT\b`).FindAllString(head, -1)), len(regexp.MustCompile(`(?i)\bNOT\s+VALID\b`).FindAllString(head, -1)); adds > notValid {
					t.Errorf("%s: %q adds a constraint to %s that is not NOT VALID: it would read the whole table under ACCESS EXCLUSIVE; add it NOT VALID and validate it in a statement of its own", where, short, sub[1])
				}
				if rewrites.MatchString(head) {
					t.Errorf("%s: %q reads or rewrites all of %s under ACCESS EXCLUSIVE", where, short, sub[1])
				}
				if strings.Contains(strings.ToUpper(head), "VALIDATE CONSTRAINT") && (!m.NoTransaction || !validate.MatchString(head)) {
					t.Errorf("%s: %q: a validation runs alone in its statement, in a no-transaction migration (else it holds the lock of what runs beside it)", where, short)
				}
			}
			if forbidden.MatchString(head) && !regexp.MustCompile(`(?i)\bCONCURRENTLY\b`).MatchString(head) {
				t.Errorf("%s: %q takes a lock that blocks producers for as long as it runs", where, short)
			}
		}
	}
}
