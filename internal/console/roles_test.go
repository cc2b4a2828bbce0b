package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// `run --console` serves the console on the relay's own role, and the
// least-privilege relay role of sql/roles.sql (`migrate --print-grants`)
// could not read <table>_redrives: the History page answered 500
// "permission denied for table outbox_redrives", and so did every row's
// page, which shows the row's history. The relay role may read the history
// now, and a role without that grant (one granted before) gets a page that
// names the GRANT, and the row's page shows the row with that note.
func TestHistoryAsRelayRole(t *testing.T) {
	ctx := context.Background()
	f := setup(t, console.Options{Token: token})
	f.Insert(t, row{ID: "h-1", State: "failed", LastError: "rejected: max_payload", Attempts: 5})
	if res, err := f.Store.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"h-1"}}, By: "op", Reason: "limit raised"}); err != nil || len(res.Changed) != 1 {
		t.Fatalf("redrive h-1: %+v, %v", res, err)
	}
	suffix := strings.ToLower(strings.ReplaceAll(t.Name(), "/", "_")) + "_" + time.Now().Format("150405.000")
	suffix = strings.ReplaceAll(suffix, ".", "")
	roles := schema.Roles{Relay: "relay_" + suffix, Producer: "producer_" + suffix, Operator: "operator_" + suffix}
	grants, err := schema.Grants(f.Table, roles)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Pool.Exec(ctx, grants); err != nil {
		t.Fatalf("run the printed grants: %v", err)
	}
	cfg, err := pgxpool.ParseConfig(f.Pool.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.User = roles.Relay
	relayPool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		relayPool.Close()
		for _, r := range []string{roles.Relay, roles.Producer, roles.Operator} {
			id := pgx.Identifier{r}.Sanitize()
			if _, err := f.Pool.Exec(context.Background(), `DROP OWNED BY `+id+`; DROP ROLE `+id); err != nil {
				t.Errorf("drop role %s: %v", r, err)
			}
		}
	})
	c, err := console.New(console.Options{Token: token}, "127.0.0.1:0", console.Sources{Store: store.New(relayPool, f.Table, store.PolicyMark), Catalog: relayPool, Slot: "outbox_relay"})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(c)
	t.Cleanup(srv.Close)
	relay := &fixture{f.Fixture}
	relay.Server = srv
	b := relay.client(t, bearer())

	if code, body := b.get("/ui/history"); code != http.StatusOK || !strings.Contains(body, "limit raised") {
		t.Fatalf("history as %s: %d, want 200 with the redrive's reason: %s", roles.Relay, code, mainOf(body))
	}
	if code, body := b.get("/ui/row?id=" + enc("h-1")); code != http.StatusOK || !strings.Contains(body, "limit raised") {
		t.Fatalf("row page as %s: %d, want 200 with its history: %s", roles.Relay, code, mainOf(body))
	}

	// A relay role granted by an older sql/roles.sql.
	if _, err := f.Pool.Exec(ctx, `REVOKE SELECT ON public.outbox_redrives FROM `+pgx.Identifier{roles.Relay}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	want := `GRANT SELECT ON &#34;public&#34;.&#34;outbox_redrives&#34; TO &#34;` + roles.Relay + `&#34;`
	if code, body := b.get("/ui/history"); code != http.StatusForbidden || !strings.Contains(body, want) {
		t.Errorf("history without the grant: %d, want 403 naming %q: %s", code, want, mainOf(body))
	}
	if code, body := b.get("/ui/row?id=" + enc("h-1")); code != http.StatusOK || !strings.Contains(body, want) || !strings.Contains(body, `id="row-id">h-1<`) {
		t.Errorf("row page without the grant: %d, want 200 with the row and %q: %s", code, want, mainOf(body))
	}
}

// mainOf is a page's <main> part, what a failure message needs of it.
func mainOf(page string) string {
	if _, after, ok := strings.Cut(page, "<main"); ok {
		before, _, _ := strings.Cut(after, "</main>")
		return before
	}
	return page
}
