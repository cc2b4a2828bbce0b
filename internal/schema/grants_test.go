package schema_test

import (
	"context"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The grants script gives the relay's role REPLICATION where a login may
// give it, and on Amazon RDS or Aurora, where none may, the rds_replication
// role that stands for it there (made to look so here by creating a role of
// that name on a server of the test's own: roles are cluster-wide).
func TestGrantsGiveReplicationTheServersWay(t *testing.T) {
	ctx := context.Background()
	for _, rds := range []bool{false, true} {
		pg, err := testenv.StartPostgres(testenv.PostgresOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pg.Close)
		conn := connect(t, pg.URL("postgres"))
		if rds {
			if _, err := conn.Exec(ctx, `CREATE ROLE rds_replication`); err != nil {
				t.Fatal(err)
			}
		}
		tbl := store.Table{Schema: "public", Name: "outbox"}
		if _, err := schema.Migrate(ctx, conn, tbl); err != nil {
			t.Fatal(err)
		}
		script, err := schema.Grants(tbl, schema.Roles{Relay: "g_relay", Producer: "g_producer", Operator: "g_operator"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, script); err != nil {
			t.Fatalf("grants: %v", err)
		}
		var attr, member bool
		if err := conn.QueryRow(ctx, `SELECT rolreplication FROM pg_roles WHERE rolname = 'g_relay'`).Scan(&attr); err != nil {
			t.Fatal(err)
		}
		if rds {
			if err := conn.QueryRow(ctx, `SELECT pg_has_role('g_relay', 'rds_replication', 'MEMBER')`).Scan(&member); err != nil {
				t.Fatal(err)
			}
		}
		if rds && (attr || !member) {
			t.Errorf("on RDS: REPLICATION attribute %v, member of rds_replication %v; want false, true", attr, member)
		}
		if !rds && !attr {
			t.Errorf("on PostgreSQL: the relay's role has no REPLICATION attribute")
		}
	}
}
