package schema_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// createBareTable creates tbl as 0001 does, without its index, on conn: a
// table made by hand (or by an earlier tool) that migrate then adopts.
func createBareTable(t *testing.T, conn *pgx.Conn, tbl store.Table) {
	t.Helper()
	all, err := schema.Migrations(tbl)
	if err != nil {
		t.Fatal(err)
	}
	createTable, _, ok := strings.Cut(all[0].SQL, "\nCREATE INDEX")
	if !ok {
		t.Fatalf("0001 has no CREATE INDEX to leave out: %s", all[0].SQL)
	}
	if _, err := conn.Exec(context.Background(), createTable); err != nil {
		t.Fatal(err)
	}
}

// escalate is the owner's attack (issue 30, item 9): a trigger on its own
// table that makes it a superuser, fired by the UPDATE the SECURITY DEFINER
// park() function runs when a row is inserted parked. It runs with the
// privileges of whoever park() runs as. It returns the insert's error.
func escalate(t *testing.T, owner *pgx.Conn, tbl store.Table, role string) error {
	t.Helper()
	ctx := context.Background()
	fn := pgx.Identifier{tbl.Schema, "escalate_" + tbl.Name}.Sanitize()
	if _, err := owner.Exec(ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $fn$
		BEGIN
			EXECUTE format('ALTER ROLE %I SUPERUSER', `+"'"+role+"'"+`);
			RETURN NEW;
		END $fn$;
		CREATE TRIGGER escalate BEFORE UPDATE ON `+tbl.String()+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`); err != nil {
		t.Fatalf("the owner adds a trigger to its table: %v", err)
	}
	_, err := owner.Exec(ctx, `INSERT INTO `+tbl.String()+` (work_id, kind, payload, state) VALUES ('attack', 'k', '{}', 'failed')`)
	return err
}

func insufficientPrivilege(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42501"
}

func isSuperuser(t *testing.T, conn *pgx.Conn, role string) bool {
	t.Helper()
	var super bool
	if err := conn.QueryRow(context.Background(), `SELECT rolsuper FROM pg_roles WHERE rolname = $1`, role).Scan(&super); err != nil {
		t.Fatal(err)
	}
	return super
}

// foreignOwned lists the table's companions (tables, partitions and
// functions named <table>_...; not the version table, which every table of
// the schema shares) that its owner does not own.
func foreignOwned(t *testing.T, conn *pgx.Conn, tbl store.Table) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), `
		WITH o AS (SELECT c.relowner FROM pg_class c WHERE c.oid = to_regclass($3))
		SELECT format('%s %s (%s)', kind, name, owner) FROM (
			SELECT 'table' AS kind, c.relname::text AS name, c.relowner::regrole::text AS owner, c.relowner AS oid
			FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND c.relkind IN ('r', 'p') AND left(c.relname, length($2) + 1) = $2 || '_'
			  AND c.relname <> 'outbox_relay_migrations'
			UNION ALL
			SELECT 'function', p.proname::text, p.proowner::regrole::text, p.proowner
			FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = $1 AND left(p.proname, length($2) + 1) = $2 || '_'
		) x WHERE oid <> (SELECT relowner FROM o) ORDER BY 1`, tbl.Schema, tbl.Name, tbl.String())
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// A superuser's migrate of a table another role owns (issue 30, item 9)
// made the companion functions SECURITY DEFINER as the superuser: the
// owner's trigger, fired by park(), made the owner a superuser. Migrate now
// refuses to apply migrations as anyone but the table's owner, naming it;
// run as the owner, every function is the owner's and the same trigger runs
// with the owner's privileges only.
func TestMigrateBySuperuserOfAnotherOwnersTable(t *testing.T) {
	ctx := context.Background()
	dbURL := testenv.Shared(t).PG.CreateDatabase(t)
	super := connect(t, dbURL)
	const role = "mig_owner_super_case"
	owner := testenv.OwnerRole(t, super, dbURL, role)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	createBareTable(t, owner, tbl)

	_, err := schema.Migrate(ctx, super, tbl)
	if err == nil {
		t.Errorf("a superuser's migrate of a table %s owns succeeded; want it refused", role)
	} else {
		if msg := err.Error(); !strings.Contains(msg, `Run migrate as "`+role+`"`) {
			t.Errorf("refusal %q: want it to name the owner %q and say to run migrate as it", msg, role)
		}
		if _, err := schema.Migrate(ctx, owner, tbl); err != nil {
			t.Fatalf("migrate as the owner: %v", err)
		}
	}
	if got := foreignOwned(t, super, tbl); len(got) > 0 {
		t.Errorf("companions not owned by the table's owner %s: %v", role, got)
	}
	err = escalate(t, owner, tbl, role)
	if isSuperuser(t, super, role) {
		t.Fatalf("the table's owner %s became a superuser through its trigger and park()", role)
	}
	if !insufficientPrivilege(err) {
		t.Errorf("the owner's trigger run by park(): %v, want insufficient privilege (42501: it runs as the owner)", err)
	}
}

// An install a superuser migrated before the fix: its functions and
// companion tables are the superuser's while the table is another role's
// (here the table was handed over with ALTER TABLE ... OWNER TO, as an
// operator does). The superuser's next migrate gives them to the table's
// owner, and says migrate must now run as the owner; the owner's migrate
// then reads the version table the superuser created.
func TestMigrateGivesSuperuserFunctionsToTheOwner(t *testing.T) {
	dbURL := testenv.Shared(t).PG.CreateDatabase(t)
	super := connect(t, dbURL)
	t.Run("plain", func(t *testing.T) {
		giveSuperusersCompanions(t, super, dbURL, "mig_owner_repair_plain", store.Table{Schema: "public", Name: "outbox"}, 0)
	})
	// Its partitions too, which add_partitions made as the superuser.
	t.Run("partitioned", func(t *testing.T) {
		giveSuperusersCompanions(t, super, dbURL, "mig_owner_repair_part", store.Table{Schema: "public", Name: "hourly"}, time.Hour)
	})
}

func giveSuperusersCompanions(t *testing.T, super *pgx.Conn, dbURL, role string, tbl store.Table, interval time.Duration) {
	ctx := context.Background()
	owner := testenv.OwnerRole(t, super, dbURL, role)
	if _, err := schema.MigrateWith(ctx, super, tbl, schema.MigrateOptions{PartitionInterval: interval}); err != nil {
		t.Fatal(err)
	}
	if _, err := super.Exec(ctx, `ALTER TABLE `+tbl.String()+` OWNER TO `+role); err != nil {
		t.Fatal(err)
	}
	if got := foreignOwned(t, super, tbl); len(got) == 0 {
		t.Fatal("setup: every companion is the owner's already")
	} else {
		t.Logf("left by the superuser's migrate: %v", got)
	}

	var progress []string
	_, err := schema.MigrateWith(ctx, super, tbl, schema.MigrateOptions{Progress: func(m string) { progress = append(progress, m) }})
	t.Logf("superuser's migrate: %v; progress %q", err, progress)
	if got := foreignOwned(t, super, tbl); len(got) > 0 {
		t.Errorf("after a superuser's migrate, companions not owned by the table's owner %s: %v", role, got)
	}
	if err == nil || !strings.Contains(err.Error(), `Run migrate as "`+role+`"`) {
		t.Errorf("superuser's migrate of %s's table: %v, want it to say to run migrate as the owner", role, err)
	}
	if applied, err := schema.Migrate(ctx, owner, tbl); err != nil || len(applied) != 0 {
		t.Errorf("the owner's migrate: applied %d, %v; want up to date", len(applied), err)
	}
	err = escalate(t, owner, tbl, role)
	if isSuperuser(t, super, role) {
		t.Fatalf("the table's owner %s became a superuser through its trigger and park()", role)
	}
	if !insufficientPrivilege(err) {
		t.Errorf("the owner's trigger run by park(): %v, want insufficient privilege (42501: it runs as the owner)", err)
	}
	// Producers still use the functions, now the owner's: next_seq writes
	// the counter table it was given with them.
	var seq int64
	if err := owner.QueryRow(ctx, `SELECT `+pgx.Identifier{tbl.Schema, tbl.Name + "_next_seq"}.Sanitize()+`('order', '1')`).Scan(&seq); err != nil || seq != 1 {
		t.Errorf("next_seq after the handover: %d, %v; want 1", seq, err)
	}
	if interval > 0 {
		if _, err := store.AddPartitions(ctx, super, tbl, time.Second); err != nil {
			t.Errorf("add_partitions after the handover: %v", err)
		}
	}
}

// Two table owners in one database (issue 30, item 9), each migrating its
// own table: the second used to fail on the version table the first one
// created (permission denied). Each now sees and writes only the records
// of tables it owns, and a role that owns neither is refused with the
// owner's name.
func TestMigrateTwoOwnersOneDatabase(t *testing.T) {
	ctx := context.Background()
	dbURL := testenv.Shared(t).PG.CreateDatabase(t)
	super := connect(t, dbURL)
	a := testenv.OwnerRole(t, super, dbURL, "mig_owner_a")
	b := testenv.OwnerRole(t, super, dbURL, "mig_owner_b")
	c := testenv.OwnerRole(t, super, dbURL, "mig_owner_c")
	ta := store.Table{Schema: "public", Name: "outbox_a"}
	tb := store.Table{Schema: "public", Name: "outbox_b"}
	all, err := schema.Migrations(ta)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, a, ta); err != nil {
		t.Fatalf("first owner: %v", err)
	}
	applied, err := schema.Migrate(ctx, b, tb)
	if err != nil {
		t.Fatalf("second owner of the same database and schema: %v", err)
	}
	if len(applied) != len(all) {
		t.Errorf("second owner applied %d migrations, want %d", len(applied), len(all))
	}
	// In a schema of its own, too.
	if _, err := super.Exec(ctx, `CREATE SCHEMA b_own AUTHORIZATION mig_owner_b`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.Migrate(ctx, b, store.Table{Schema: "b_own", Name: "outbox"}); err != nil {
		t.Errorf("second owner in its own schema: %v", err)
	}
	var seen []string
	rows, err := b.Query(ctx, `SELECT DISTINCT target FROM outbox_relay_migrations ORDER BY 1`)
	if err == nil {
		seen, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil || len(seen) != 1 || seen[0] != tb.Qualified() {
		t.Errorf("second owner reads the records of %v (%v); want only %s", seen, err, tb.Qualified())
	}
	if _, err := b.Exec(ctx, `INSERT INTO outbox_relay_migrations (target, version, name) VALUES ($1, 99, 'forged')`, ta.Qualified()); err == nil {
		t.Errorf("the second owner recorded a migration of %s, which it does not own", ta.Qualified())
	}
	if applied, err := schema.Migrate(ctx, a, ta); err != nil || len(applied) != 0 {
		t.Errorf("first owner again: applied %d, %v; want up to date", len(applied), err)
	}

	_, err = schema.Migrate(ctx, c, ta)
	if err == nil || !strings.Contains(err.Error(), `Run migrate as "mig_owner_a"`) {
		t.Errorf("migrate by a role that does not own the table: %v, want a refusal naming the owner mig_owner_a", err)
	}
}
