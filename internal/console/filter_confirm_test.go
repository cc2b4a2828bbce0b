package console_test

import (
	"context"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/console"
)

// Issue 20, item 14: a filter's confirmation carries the filter and a
// digest, not every work ID.

var confirmFormRe = regexp.MustCompile(`(?s)<form method="post" action="/ui/apply" id="confirm-form">(.*?)</form>`)
var hiddenRe = regexp.MustCompile(`<input type="hidden" name="([a-z_]+)" value="([^"]*)">`)

// confirmForm is what a browser submits from a preview's confirm button.
func confirmForm(t *testing.T, body string) url.Values {
	t.Helper()
	m := confirmFormRe.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("the preview has no confirmation form: %.500s", body)
	}
	v := url.Values{}
	for _, h := range hiddenRe.FindAllStringSubmatch(m[1], -1) {
		v.Add(h[1], html.UnescapeString(h[2]))
	}
	return v
}

// TestFilterConfirmByDigest: 500 rows of 1000-byte work IDs previewed by a
// filter are confirmed by the filter and a digest (the IDs would be 668 KB
// of form), and a row that joins the set in between makes the confirmation
// change nothing.
func TestFilterConfirmByDigest(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	var rows []row
	for i := range 500 {
		id := fmt.Sprintf("%04d-", i) + strings.Repeat("w", 995)
		rows = append(rows, row{ID: id, Kind: "big", State: "failed", LastError: "rejected: x", Age: time.Hour + time.Duration(500-i)*time.Millisecond})
	}
	f.Insert(t, rows...)
	f.Insert(t, row{ID: "other-kind", Kind: "small", State: "failed", LastError: "rejected: x", Age: 2 * time.Hour})
	b := f.client(t, bearer())
	csrf := b.csrf()
	preview := url.Values{"csrf": {csrf}, "action": {"redrive"}, "reason": {"INC-9: all of kind big"}, "scope": {"filter"}, "state": {"failed"}, "kind": {"big"}}
	code, body := b.post("/ui/preview", preview)
	if code != 200 || !strings.Contains(body, `<strong id="would-change">500</strong>`) {
		t.Fatalf("filter preview: %d %.300s", code, body)
	}
	confirm := confirmForm(t, body)
	code, body = b.post("/ui/apply", confirm)
	if code != 200 || !strings.Contains(body, `<strong id="changed-count">500</strong>`) {
		t.Fatalf("confirm (%d bytes): %d %.300s", len(confirm.Encode()), code, body)
	}
	if len(confirm["id"]) != 0 || confirm.Get("digest") == "" || confirm.Get("scope") != "filter" || confirm.Get("kind") != "big" || len(confirm.Encode()) > 4<<10 {
		t.Errorf("the filter's confirmation carries %d IDs, digest %q, scope %q, kind %q, %d bytes: want the filter and a digest",
			len(confirm["id"]), confirm.Get("digest"), confirm.Get("scope"), confirm.Get("kind"), len(confirm.Encode()))
	}
	var scheduled int
	if err := f.Pool.QueryRow(context.Background(), `SELECT count(*) FROM public.outbox WHERE kind = 'big' AND state = 'scheduled' AND redrive_reason = 'INC-9: all of kind big'`).Scan(&scheduled); err != nil {
		t.Fatal(err)
	}
	if scheduled != 500 || f.historyCount(t) != 500 || f.State(t, "other-kind") != "failed" {
		t.Errorf("after the confirmation: %d of 500 scheduled, %d history rows, other-kind %s", scheduled, f.historyCount(t), f.State(t, "other-kind"))
	}

	// The set changes between preview and confirmation: nothing changes.
	f.Insert(t, row{ID: "c1", Kind: "late", State: "failed", LastError: "rejected: x", Age: 3 * time.Second},
		row{ID: "c2", Kind: "late", State: "failed", LastError: "rejected: x", Age: 2 * time.Second})
	preview.Set("kind", "late")
	preview.Set("action", "cancel")
	_, body = b.post("/ui/preview", preview)
	confirm = confirmForm(t, body)
	f.Insert(t, row{ID: "c3", Kind: "late", State: "failed", LastError: "rejected: x", Age: time.Second})
	before := f.historyCount(t)
	code, body = b.post("/ui/apply", confirm)
	if code != http.StatusConflict || !strings.Contains(body, "the set changed, preview again") {
		t.Errorf("confirm after a row joined the set: %d %.400s, want 409 saying to preview again", code, body)
	}
	for _, id := range []string{"c1", "c2", "c3"} {
		if got := f.State(t, id); got != "failed" {
			t.Errorf("%s is %s after a refused confirmation, want failed", id, got)
		}
	}
	if n := f.historyCount(t); n != before {
		t.Errorf("a refused confirmation wrote %d history rows", n-before)
	}
	// A confirmation edited to another action is the same refusal.
	forged := confirmForm(t, body0(t, b, preview))
	forged.Set("action", "redrive")
	if code, _ := b.post("/ui/apply", forged); code != http.StatusConflict {
		t.Errorf("confirmation edited from cancel to redrive: %d, want 409", code)
	}
	for _, id := range []string{"c1", "c2", "c3"} {
		if got := f.State(t, id); got != "failed" {
			t.Errorf("%s is %s, want failed", id, got)
		}
	}
	// The rows leave the filter altogether: the same refusal.
	gone := confirmForm(t, body0(t, b, preview))
	if _, err := f.Pool.Exec(context.Background(), `UPDATE public.outbox SET kind = 'moved' WHERE kind = 'late'`); err != nil {
		t.Fatal(err)
	}
	if code, body := b.post("/ui/apply", gone); code != http.StatusConflict || !strings.Contains(body, "the set changed, preview again") {
		t.Errorf("confirmation after every row left the filter: %d %.300s, want 409", code, body)
	}
	if _, err := f.Pool.Exec(context.Background(), `UPDATE public.outbox SET kind = 'late' WHERE kind = 'moved'`); err != nil {
		t.Fatal(err)
	}
	// Previewed again, it goes through.
	confirm = confirmForm(t, body0(t, b, preview))
	if _, body = b.post("/ui/apply", confirm); !strings.Contains(body, `<strong id="changed-count">3</strong>`) {
		t.Fatalf("confirm after a new preview: %.300s", body)
	}
	for _, id := range []string{"c1", "c2", "c3"} {
		if got := f.State(t, id); got != "cancelled" {
			t.Errorf("%s is %s, want cancelled", id, got)
		}
	}
}

func body0(t *testing.T, c *client, form url.Values) string {
	t.Helper()
	code, body := c.post("/ui/preview", form)
	if code != 200 {
		t.Fatalf("preview: %d %.300s", code, body)
	}
	return body
}
