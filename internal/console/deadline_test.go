package console_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/console"
)

// Rows a producer could write before migration 0008 (issue 20, item 4):
// the scheduled list, the row's page and the overview show 'infinity' and
// '-infinity' instead of answering 500, and cancel frees the aggregate the
// row held. A redrive to a deadline already past is refused with the
// reason, the row untouched (item 3).
func TestInfiniteTimesOnPages(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	ctx := context.Background()
	for _, q := range []string{
		`ALTER TABLE public.outbox DISABLE TRIGGER outbox_times_check`,
		`INSERT INTO public.outbox (work_id, kind, payload, state, available_at, expires_at, aggregate_type, aggregate_id, aggregate_seq) VALUES
			('never-due', 'k', '{}', 'scheduled', 'infinity', '-infinity', 'order', '7', 1),
			('behind',    'k', '{}', 'scheduled', clock_timestamp(), NULL, 'order', '7', 2),
			('always',    'k', '{}', 'ready', '-infinity', NULL, NULL, NULL, NULL),
			('dead',      'k', '{}', 'failed', clock_timestamp(), NULL, NULL, NULL, NULL)`,
		`ALTER TABLE public.outbox ENABLE TRIGGER outbox_times_check`,
	} {
		if _, err := f.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	b := f.client(t, bearer())
	code, body := b.get("/ui/rows?state=scheduled")
	if ids := listed(t, body); code != http.StatusOK || len(ids) != 2 || !strings.Contains(body, "infinity") {
		t.Fatalf("scheduled list: %d, %v; want 200 with never-due and behind, 'infinity' shown: %.400s", code, ids, body)
	}
	code, body = b.get("/ui/row?id=" + enc("never-due"))
	if code != http.StatusOK || !strings.Contains(body, "<td>infinity</td>") || !strings.Contains(body, "<td>-infinity</td>") {
		t.Fatalf("never-due's page: %d; want 200 with available infinity, expires -infinity: %.600s", code, body)
	}
	if code, body = b.get("/ui/row?id=" + enc("always")); code != http.StatusOK || !strings.Contains(body, "-infinity") {
		t.Fatalf("always's page: %d: %.400s", code, body)
	}
	if code, body = b.get("/ui/"); code != http.StatusOK {
		t.Fatalf("overview: %d: %.400s", code, body)
	}

	csrf := b.csrf()
	if _, body = b.post("/ui/apply", actionForm(csrf, "cancel", "never due", "never-due")); !strings.Contains(body, `<strong id="changed-count">1</strong>`) {
		t.Fatalf("cancel never-due: %.600s", body)
	}
	if got := f.State(t, "never-due"); got != "cancelled" {
		t.Fatalf("never-due: %s, want cancelled", got)
	}
	var blocked int
	if err := f.Pool.QueryRow(ctx, `SELECT count(*) FROM public.outbox WHERE aggregate_id = '7' AND state IN ('scheduled', 'failed', 'running') AND aggregate_seq < 2`).Scan(&blocked); err != nil || blocked != 0 {
		t.Fatalf("rows still ahead of behind: %d, %v", blocked, err)
	}

	form := actionForm(csrf, "redrive", "retry", "dead")
	form.Set("deadline", "new")
	form.Set("expires_at", time.Now().Add(-time.Hour).UTC().Format(time.RFC3339))
	for _, path := range []string{"/ui/preview", "/ui/apply"} {
		if _, body = b.post(path, form); !strings.Contains(body, "not in the future on the database clock") {
			t.Errorf("%s redrive to a past deadline: want it refused with the reason: %.600s", path, body)
		}
	}
	if got := f.State(t, "dead"); got != "failed" || f.historyCount(t) != 1 {
		t.Errorf("dead after the refused redrive: %s, %d history rows; want failed, untouched", got, f.historyCount(t))
	}
}
