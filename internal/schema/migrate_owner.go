package schema

import (
	"context"
	"fmt"
	"io/fs"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"

	outboxsql "github.com/outbox-relay/outbox-relay/sql"
)

// Who may migrate a table (issue 30, item 9). The companion functions are
// SECURITY DEFINER: producers and the relay call them, and they run as their
// owner, which is whoever created them, the role migrate runs as. The
// table's owner can attach code to its table (a trigger, an index
// expression, a rule) that the functions' statements on it then run with
// their privileges: run by a superuser on a table another role owns,
// migrate made that role able to become a superuser. The same holds for the
// statements migrate runs on the table itself (0012's UPDATE fires the
// owner's triggers). So migrations are applied only as the table's owner:
// every function is then the owner's and grants nothing beyond what the
// owner has anyway. A superuser's SET ROLE is no way around it: code the
// owner attached can RESET ROLE back to the superuser.
//
// A superuser's migrate of another role's table is refused, after giving
// the companions a superuser's earlier migrate created to the table's owner
// (only a superuser can: that is how an install migrated by one is
// repaired). Every other role that does not own the table is refused.

// Ownership is who owns a table and who is migrating it.
type Ownership struct {
	// Exists: the table exists; Owner is then its owner's name.
	Exists bool
	Owner  string
	// User is current_user (whom objects are created as), Session the role
	// that logged in; they differ after SET ROLE.
	User, Session               string
	Superuser, SessionSuperuser bool
}

// AsOwner reports whether migrations may run: the table is new (it will be
// the migrating role's), or the migrating role owns it and did not reach it
// by a superuser's SET ROLE.
func (o Ownership) AsOwner() bool {
	return !o.Exists || (o.User == o.Owner && (o.Session == o.Owner || !o.SessionSuperuser))
}

// ReadOwnership reads who owns table t and who this session is.
func ReadOwnership(ctx context.Context, q DBTX, t Table) (Ownership, error) {
	var o Ownership
	var owner *string
	err := q.QueryRow(ctx, `SELECT current_user, session_user,
			(SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user),
			(SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = session_user),
			(SELECT r.rolname::text FROM pg_catalog.pg_class c
				JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
				JOIN pg_catalog.pg_roles r ON r.oid = c.relowner
			 WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p'))`,
		t.Schema, t.Name).Scan(&o.User, &o.Session, &o.Superuser, &o.SessionSuperuser, &owner)
	if err != nil {
		return Ownership{}, fmt.Errorf("read the owner of %s: %w", t.Qualified(), err)
	}
	if owner != nil {
		o.Exists, o.Owner = true, *owner
	}
	return o, nil
}

// notOwner is the refusal, with the fix.
func notOwner(t Table, o Ownership, given []string) error {
	who := fmt.Sprintf("%q", o.User)
	if o.Session != o.User {
		who = fmt.Sprintf("%q (logged in as %q)", o.User, o.Session)
	}
	if o.Superuser || o.SessionSuperuser {
		who += ", a superuser"
	}
	how := "log in as it (the Helm chart's migrate hook takes its URL from the Secret's migrate-database-url key)"
	if !o.SessionSuperuser {
		how += fmt.Sprintf(", or, as a member of it, add options=-c%%20role%%3D%s to the URL (SET ROLE)", o.Owner)
	}
	done := ""
	if len(given) > 0 {
		done = fmt.Sprintf(" (first gave what an earlier migrate created as another role to %q: %s)", o.Owner, strings.Join(given, ", "))
	}
	return fmt.Errorf("migrate %s: the table is owned by role %q and this session is %s: migrate applies migrations only as the table's owner, so that the SECURITY DEFINER functions it creates run with the owner's privileges and no more, and no code the owner attached to the table runs as this role%s. Run migrate as %q: %s (docs/troubleshooting.md, \"migrate: the table is owned by role\")",
		t.Qualified(), o.Owner, who, done, o.Owner, how)
}

// companionTables and companionFunctions are the suffixes of the tables
// and functions the migrations create beside the outbox table, read from
// them so that a new migration's companion is covered.
var companionTables, companionFunctions = func() (tables, funcs []string) {
	createTable := regexp.MustCompile(`CREATE TABLE IF NOT EXISTS \{\{\.Companion "([^"]+)"\}\}`)
	createFunc := regexp.MustCompile(`CREATE OR REPLACE FUNCTION \{\{\.Companion "([^"]+)"\}\}`)
	entries, err := fs.ReadDir(outboxsql.Migrations, "migrations")
	if err != nil {
		panic("read embedded migrations: " + err.Error())
	}
	seen := map[string]bool{}
	for _, e := range entries {
		src, err := fs.ReadFile(outboxsql.Migrations, "migrations/"+e.Name())
		if err != nil {
			panic("read embedded migration " + e.Name() + ": " + err.Error())
		}
		for _, m := range createTable.FindAllStringSubmatch(string(src), -1) {
			if !seen["t"+m[1]] {
				seen["t"+m[1]] = true
				tables = append(tables, m[1])
			}
		}
		for _, m := range createFunc.FindAllStringSubmatch(string(src), -1) {
			if !seen["f"+m[1]] {
				seen["f"+m[1]] = true
				funcs = append(funcs, m[1])
			}
		}
	}
	return tables, funcs
}()

// ownedObject is a companion for ALTER <kind> <name> OWNER TO: kind TABLE
// or FUNCTION, name quoted (a function's with its argument types).
type ownedObject struct{ kind, name, owner string }

// foreignOwned lists the companions of t (its companion tables, its
// partitions, its companion functions) that its owner does not own: what
// an earlier migrate run as another role left.
func foreignOwned(ctx context.Context, q DBTX, t Table) ([]ownedObject, error) {
	var tables, funcs []string
	for _, s := range companionTables {
		tables = append(tables, t.DerivedName(s))
	}
	for _, s := range companionFunctions {
		funcs = append(funcs, t.DerivedName(s))
	}
	rows, err := q.Query(ctx, `WITH o AS (
			SELECT c.oid, c.relowner FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = $1 AND c.relname = $2 AND c.relkind IN ('r', 'p'))
		SELECT 'TABLE', pg_catalog.format('%I.%I', n.nspname, c.relname), r.rolname::text
		FROM o, pg_catalog.pg_class c
			JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
			JOIN pg_catalog.pg_roles r ON r.oid = c.relowner
		WHERE c.relkind IN ('r', 'p') AND c.relowner <> o.relowner
		  AND ((n.nspname = $1 AND c.relname = ANY($3::text[]))
		       OR c.oid IN (SELECT i.inhrelid FROM pg_catalog.pg_inherits i WHERE i.inhparent = o.oid))
		UNION ALL
		SELECT 'FUNCTION', p.oid::pg_catalog.regprocedure::text, r.rolname::text
		FROM o, pg_catalog.pg_proc p
			JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
			JOIN pg_catalog.pg_roles r ON r.oid = p.proowner
		WHERE n.nspname = $1 AND p.proname = ANY($4::text[]) AND p.proowner <> o.relowner
		ORDER BY 1, 2`, t.Schema, t.Name, tables, funcs)
	if err != nil {
		return nil, fmt.Errorf("list the companions of %s not owned by its owner: %w", t.Qualified(), err)
	}
	objs, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (ownedObject, error) {
		var o ownedObject
		err := row.Scan(&o.kind, &o.name, &o.owner)
		return o, err
	})
	if err != nil {
		return nil, fmt.Errorf("list the companions of %s not owned by its owner: %w", t.Qualified(), err)
	}
	return objs, nil
}

func describeOwned(objs []ownedObject) []string {
	out := make([]string, len(objs))
	for i, o := range objs {
		out[i] = fmt.Sprintf("%s %s (owned by %s)", strings.ToLower(o.kind), o.name, o.owner)
	}
	return out
}

// giveToOwner gives the companions that another role owns to the table's
// owner. Each ALTER takes the companion's ACCESS EXCLUSIVE lock for a
// catalog change, so each is committed on its own and its wait bounded by
// lock_timeout: producers (next_seq's counter table, a partition) queue
// behind one wait at most. An interrupted run leaves the rest to the next
// one. No code of the owner's runs: ALTER ... OWNER TO fires no trigger.
func (r *migrator) giveToOwner(ctx context.Context, owner string) ([]string, error) {
	objs, err := foreignOwned(ctx, r.conn, r.t)
	if err != nil || len(objs) == 0 {
		return nil, err
	}
	var given []string
	err = r.withLockTimeout(ctx, func() error {
		for _, o := range objs {
			if _, err := r.conn.Exec(ctx, `ALTER `+o.kind+` `+o.name+` OWNER TO `+pgx.Identifier{owner}.Sanitize()); err != nil {
				return r.explain(ctx, fmt.Sprintf("give %s %s to the table's owner %s", strings.ToLower(o.kind), o.name, owner), err)
			}
			g := describeOwned([]ownedObject{o})[0]
			r.opts.Progress("gave " + g + " to the table's owner " + owner)
			given = append(given, g)
		}
		return nil
	})
	return given, err
}

// versionTableName is the table of applied migrations, one per schema,
// shared by the tables of that schema (its target column).
const versionTableName = "outbox_relay_migrations"

// versionPolicy lets a role read and write the records of the tables it
// owns (or has the privileges of) and no others: another table's owner in
// the same schema then migrates its own table, and cannot mark this one's
// migrations done or undone. A target is schema.name, neither with a dot
// (ParseTable).
const versionPolicy = `outbox_relay_owners`

// versionTable creates the version table if it is missing and opens it,
// under its policy, to every table's owner; it returns its quoted name.
// Whoever may alter it does that once (enabling row security takes its
// lock, which only migrates, under their advisory lock, ask for); a role
// that may not, on a table nobody opened yet, is told whom to ask.
func (r *migrator) versionTable(ctx context.Context) (string, error) {
	ver := pgx.Identifier{r.t.Schema, versionTableName}.Sanitize()
	var schemaExists, tableExists bool
	if err := r.conn.QueryRow(ctx, `SELECT to_regnamespace($1) IS NOT NULL, to_regclass($2) IS NOT NULL`,
		pgx.Identifier{r.t.Schema}.Sanitize(), ver).Scan(&schemaExists, &tableExists); err != nil {
		return "", fmt.Errorf("migrate %s: look for the version table: %w", r.t.Qualified(), err)
	}
	// Only when missing: CREATE ... IF NOT EXISTS checks the privilege to
	// create before it looks, and a table's owner may have none on the
	// database or the schema.
	if !schemaExists {
		if err := r.exclusive(ctx, func(q DBTX) error {
			_, err := q.Exec(ctx, `CREATE SCHEMA IF NOT EXISTS `+pgx.Identifier{r.t.Schema}.Sanitize())
			return err
		}); err != nil {
			return "", r.explain(ctx, "create schema", err)
		}
	}
	if !tableExists {
		if err := r.exclusive(ctx, func(q DBTX) error {
			_, err := q.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+ver+` (
			target     text        NOT NULL,
			version    integer     NOT NULL,
			name       text        NOT NULL,
			applied_at timestamptz NOT NULL DEFAULT clock_timestamp(),
			PRIMARY KEY (target, version))`)
			return err
		}); err != nil {
			return "", r.explain(ctx, "create version table", err)
		}
	}
	var owner string
	var opened, canAlter, canUse bool
	if err := r.conn.QueryRow(ctx, `SELECT r.rolname::text,
			c.relrowsecurity AND EXISTS (SELECT 1 FROM pg_catalog.pg_policy p WHERE p.polrelid = c.oid AND p.polname = $2),
			pg_catalog.pg_has_role(c.relowner, 'USAGE'),
			pg_catalog.has_table_privilege(c.oid, 'SELECT') AND pg_catalog.has_table_privilege(c.oid, 'INSERT')
		FROM pg_catalog.pg_class c JOIN pg_catalog.pg_roles r ON r.oid = c.relowner
		WHERE c.oid = to_regclass($1)`, ver, versionPolicy).Scan(&owner, &opened, &canAlter, &canUse); err != nil {
		return "", fmt.Errorf("migrate %s: read the version table's owner: %w", r.t.Qualified(), err)
	}
	switch {
	case opened:
	case canAlter:
		// One transaction: never enabled without its policy.
		if err := r.exclusive(ctx, func(q DBTX) error {
			_, err := q.Exec(ctx, `ALTER TABLE `+ver+` ENABLE ROW LEVEL SECURITY;
			DROP POLICY IF EXISTS `+versionPolicy+` ON `+ver+`;
			CREATE POLICY `+versionPolicy+` ON `+ver+` USING (EXISTS (
				SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
				WHERE n.nspname = pg_catalog.split_part(target, '.', 1) AND c.relname = pg_catalog.split_part(target, '.', 2)
				  AND c.relkind IN ('r', 'p') AND pg_catalog.pg_has_role(c.relowner, 'USAGE')));
			GRANT SELECT, INSERT, DELETE ON `+ver+` TO PUBLIC`)
			return err
		}); err != nil {
			return "", r.explain(ctx, "open the version table to each table's owner", err)
		}
	case !canUse:
		return "", fmt.Errorf("migrate %s: the version table %s.%s, which every outbox table of the schema shares, is owned by role %q, and role %q may not read it: run this version's migrate once as %q or a superuser (it lets each table's owner read and write the records of its own tables), then again as %q",
			r.t.Qualified(), r.t.Schema, versionTableName, owner, currentUser(ctx, r.conn), owner, currentUser(ctx, r.conn))
	}
	return ver, nil
}

func currentUser(ctx context.Context, q DBTX) string {
	var u string
	if err := q.QueryRow(ctx, `SELECT current_user`).Scan(&u); err != nil {
		return "?"
	}
	return u
}

// checkOwnership refuses to migrate as anyone but the table's owner (see
// the top of this file); a superuser first gives the table's owner what an
// earlier migrate made as another role, and opens the version table.
func (r *migrator) checkOwnership(ctx context.Context) (Ownership, error) {
	o, err := ReadOwnership(ctx, r.conn, r.t)
	if err != nil {
		return o, fmt.Errorf("migrate %s: %w", r.t.Qualified(), err)
	}
	if o.AsOwner() {
		return o, nil
	}
	if !o.Superuser {
		return o, notOwner(r.t, o, nil)
	}
	given, err := r.giveToOwner(ctx, o.Owner)
	if err != nil {
		return o, err
	}
	if err := r.withLockTimeout(ctx, func() error { _, err := r.versionTable(ctx); return err }); err != nil {
		return o, err
	}
	return o, notOwner(r.t, o, given)
}

// warnForeignOwned says, after a migrate as the owner, which companions
// another role owns (a superuser's migrate before issue 30): only a
// superuser can give them back.
func (r *migrator) warnForeignOwned(ctx context.Context, owner string) error {
	objs, err := foreignOwned(ctx, r.conn, r.t)
	if err != nil || len(objs) == 0 {
		return err
	}
	r.opts.Progress(fmt.Sprintf("warning: %s: not owned by the table's owner %q, so its SECURITY DEFINER functions run with another role's privileges (a superuser's: then the table's owner can make itself one); run this migrate once as a superuser, which gives them to %q (docs/troubleshooting.md, \"migrate: the table is owned by role\")",
		strings.Join(describeOwned(objs), ", "), owner, owner))
	return nil
}

// withLockTimeout runs fn with lock_timeout set to the migrate's bound,
// then puts the session's back.
func (r *migrator) withLockTimeout(ctx context.Context, fn func() error) error {
	var prev string
	if err := r.conn.QueryRow(ctx, `SELECT current_setting('lock_timeout')`).Scan(&prev); err != nil {
		return fmt.Errorf("migrate %s: read lock_timeout: %w", r.t.Qualified(), err)
	}
	if err := r.setLockTimeout(ctx, r.timeoutSetting()); err != nil {
		return err
	}
	err := fn()
	if rerr := r.setLockTimeout(context.Background(), prev); err == nil {
		err = rerr
	}
	return err
}
