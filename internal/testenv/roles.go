package testenv

import (
	"context"
	"net/url"
	"testing"

	"github.com/jackc/pgx/v5"
)

// OwnerRole creates role, a login role that may create objects in super's
// database and its public schema (dropped with what it owns when the test
// ends), and returns a connection to dbURL as it.
func OwnerRole(t *testing.T, super *pgx.Conn, dbURL, role string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	id := pgx.Identifier{role}.Sanitize()
	var db string
	if err := super.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	if _, err := super.Exec(ctx, `CREATE ROLE `+id+` LOGIN; GRANT CREATE ON DATABASE `+pgx.Identifier{db}.Sanitize()+` TO `+id+`; GRANT CREATE ON SCHEMA public TO `+id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = super.Exec(context.Background(), `DROP OWNED BY `+id+`; DROP ROLE IF EXISTS `+id)
	})
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	return Connect(t, u.String())
}

// Connect opens a connection to url, closed when the test ends.
func Connect(t testing.TB, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), url)
	if err != nil {
		t.Fatalf("connect: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}
