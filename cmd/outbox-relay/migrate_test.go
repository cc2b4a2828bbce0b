package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// migrate creates the publication with its row filter, and gives one made
// before the filter existed the filter, once.
func TestMigrateFiltersThePublication(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	filter := func() string { return testenv.PublicationRowFilter(t, pool, "outbox_relay", "outbox") }
	migrate := func() string {
		t.Helper()
		code, out, _ := run(t, "migrate", "--database-url", url)
		if code != 0 {
			t.Fatalf("migrate: exit %d", code)
		}
		return out
	}

	out := migrate()
	if got := filter(); got != replication.ReadyFilterCatalog || strings.Contains(out, "added the row filter") {
		t.Fatalf("first migrate: filter %s, output %q; want %s, created with the publication", got, out, replication.ReadyFilterCatalog)
	}
	if _, err := pool.Exec(context.Background(), `ALTER PUBLICATION outbox_relay SET TABLE outbox`); err != nil {
		t.Fatal(err)
	}
	if out := migrate(); filter() != replication.ReadyFilterCatalog || !strings.Contains(out, "publication outbox_relay: added the row filter WHERE (state = 'ready')") {
		t.Fatalf("migrate of an unfiltered publication: filter %s, output %q", filter(), out)
	}
	if out := migrate(); strings.Contains(out, "added") || !strings.Contains(out, "publishes inserts of ready rows") {
		t.Fatalf("third migrate: output %q, want nothing added", out)
	}
}
