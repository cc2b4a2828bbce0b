package console_test

import (
	"context"
	"html"
	"strings"
	"testing"

	"github.com/outbox-relay/outbox-relay/internal/console"
)

// The overview's blocked aggregates and a row's page print an aggregate as
// "type"/"id", each part quoted: type a/b with id c and type a with id b/c
// used to read a/b/c on both pages.
func TestAggregatesShownUnambiguously(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	for _, a := range []struct{ id, typ, agg, age string }{
		{"x", "a/b", "c", "2 hours"}, {"y", "a", "b/c", "1 hour"},
	} {
		if _, err := f.Pool.Exec(context.Background(), `INSERT INTO `+f.Table.String()+`
			(work_id, kind, payload, state, last_error, created_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
			($1 || '-1', 'k', '{}', 'failed', 'rejected: x', clock_timestamp() - $4::interval, $2, $3, 1),
			($1 || '-2', 'k', '{}', 'scheduled', NULL, clock_timestamp() - $4::interval, $2, $3, 2)`, a.id, a.typ, a.agg, a.age); err != nil {
			t.Fatal(err)
		}
	}
	b := f.client(t, bearer())
	pages := map[string][]string{
		"/ui/":                     {`"a/b"/"c"`, `"a"/"b/c"`},
		"/ui/row?id=" + enc("x-2"): {`"a/b"/"c"`},
		"/ui/row?id=" + enc("y-2"): {`"a"/"b/c"`},
	}
	for path, wants := range pages {
		code, body := b.get(path)
		if code != 200 {
			t.Fatalf("GET %s: %d", path, code)
		}
		body = html.UnescapeString(body)
		for _, want := range wants {
			if !strings.Contains(body, "<code>"+want+"</code>") {
				t.Errorf("%s does not show the aggregate as <code>%s</code>", path, want)
			}
		}
		if strings.Contains(body, "a/b/c") {
			t.Errorf("%s shows an aggregate as a/b/c", path)
		}
	}
}
