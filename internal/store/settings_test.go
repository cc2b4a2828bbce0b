package store_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// The table's settings (issue 20, item 5) in the store: of two first
// instances starting at once with different settings, exactly one records
// its own and the other is refused; a missing <table>_settings and a role
// that may not read it are named with their fix.
func TestSettingsRecordAndRefuse(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.Migrate(ctx, connect(t, url), tbl); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := store.New(pool, tbl, store.PolicyMark)

	var wg sync.WaitGroup
	errs := make([]error, 2)
	recorded := make([]bool, 2)
	for i, ordering := range []string{"none", "aggregate"} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, recorded[i], errs[i] = st.CheckSettings(ctx, store.Settings{Ordering: ordering, OnPublish: store.PolicyMark}, fmt.Sprint("instance ", i))
		}()
	}
	wg.Wait()
	if (errs[0] == nil) == (errs[1] == nil) || recorded[0] == recorded[1] {
		t.Fatalf("two first instances with different settings: errors %v, recorded %v; want one recorded and one refused", errs, recorded)
	}
	for i, err := range errs {
		if err != nil && (!errors.Is(err, store.ErrSettingsDiffer) || !strings.Contains(err.Error(), "recorded by instance "+fmt.Sprint(1-i))) {
			t.Errorf("instance %d: %v; want ErrSettingsDiffer naming instance %d's record", i, err, 1-i)
		}
	}
	// The default values compare as what they mean.
	if _, _, err := st.CheckSettings(ctx, store.Settings{}, "defaults"); recorded[0] && err != nil {
		t.Errorf("empty settings against none/mark: %v", err)
	}

	// A role without grants on <table>_settings.
	role := fmt.Sprintf("settings_nogrant_%d", os.Getpid())
	id := pgx.Identifier{role}.Sanitize()
	if _, err := pool.Exec(ctx, `CREATE ROLE `+id+` LOGIN; GRANT USAGE ON SCHEMA public TO `+id); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP OWNED BY `+id+`; DROP ROLE IF EXISTS `+id) })
	other, err := pgxpool.New(ctx, strings.Replace(url, "postgres://postgres@", "postgres://"+role+"@", 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	_, _, err = store.New(other, tbl, store.PolicyMark).CheckSettings(ctx, store.Settings{}, "x")
	if err == nil || !strings.Contains(err.Error(), `GRANT SELECT, INSERT ON "public"."outbox_settings" TO the relay's role`) {
		t.Errorf("role without grants: %v; want the GRANT that fixes it", err)
	}

	// Migrated by an older version: no <table>_settings.
	if _, err := pool.Exec(ctx, `DROP TABLE outbox_settings`); err != nil {
		t.Fatal(err)
	}
	_, _, err = st.CheckSettings(ctx, store.Settings{}, "x")
	if !errors.Is(err, store.ErrTableMissing) || !strings.Contains(err.Error(), "migration 0009") || !strings.Contains(err.Error(), "run `outbox-relay migrate`") {
		t.Errorf("no settings table: %v; want ErrTableMissing naming migration 0009 and migrate", err)
	}
}
