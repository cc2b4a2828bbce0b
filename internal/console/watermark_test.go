package console_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/console"
)

// Under --on-publish none a ready row the watermark covers shows as
// published (no stream sequence: "covered by the watermark at <lsn>,
// <time>") in the lists, the filters, the row page, the overview and an
// action's refusals; a ready row inserted after the watermark shows as in
// flight.
func TestCoveredRowsShowAsPublished(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	ctx := context.Background()
	f.Insert(t,
		row{ID: "cov1", State: "ready", Age: 2 * time.Minute},
		row{ID: "cov2", State: "ready", Age: time.Minute},
		row{ID: "p1", State: "published", StreamSeq: 7, Age: time.Hour},
	)
	for _, q := range []string{
		`INSERT INTO public.outbox_slots (slot_name) VALUES ('outbox_relay')`,
		`UPDATE public.outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`,
	} {
		if _, err := f.Pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var lsn string
	if err := f.Pool.QueryRow(ctx, `SELECT watermark_lsn::text FROM public.outbox_slots`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}
	f.Insert(t, row{ID: "fly", State: "ready"})
	b := f.client(t, bearer())

	code, body := b.get("/ui/rows?state=published")
	if ids := listed(t, body); code != 200 || !slices.Equal(ids, []string{"p1", "cov1", "cov2"}) {
		t.Errorf("published filter listed %q (%d), want p1, cov1, cov2", ids, code)
	}
	if !strings.Contains(body, "covered by the watermark at "+lsn) || !strings.Contains(body, "seq 7") ||
		strings.Count(body, `<tr data-state="published">`) != 3 {
		t.Errorf("published rows do not show the watermark's evidence:\n%s", body)
	}
	code, body = b.get("/ui/rows?state=ready")
	if ids := listed(t, body); code != 200 || !slices.Equal(ids, []string{"fly"}) || !strings.Contains(body, "in flight") {
		t.Errorf("ready filter listed %q (%d), want fly, in flight", ids, code)
	}

	_, body = b.get("/ui/row?id=" + enc("cov1"))
	if !strings.Contains(body, `id="row-state">published`) || !strings.Contains(body, "covered by the watermark at "+lsn+", ") {
		t.Errorf("covered row page:\n%s", body)
	}
	_, body = b.get("/ui/row?id=" + enc("fly"))
	if !strings.Contains(body, `id="row-state">ready`) || !strings.Contains(body, "in flight: not yet covered by the watermark") ||
		strings.Contains(body, "covered by the watermark at") {
		t.Errorf("in-flight row page:\n%s", body)
	}

	// Cancel of a covered row is refused as a published row's is.
	form := actionForm(b.csrf(), "cancel", "test", "cov1", "fly")
	code, body = b.post("/ui/preview", form)
	if code != 200 || !strings.Contains(body, "published (covered by the watermark, --on-publish none): the broker has it (terminal)") ||
		!strings.Contains(body, "ready: already on its way") || !strings.Contains(body, `<strong id="would-refuse">2</strong>`) {
		t.Errorf("preview of a cancel of cov1 and fly (%d):\n%s", code, body)
	}
	if s := f.State(t, "cov1"); s != "ready" {
		t.Errorf("cov1 is %s", s)
	}

	h, counts := b.health(t)
	if counts["published"] != 3 || counts["ready"] != 1 || h.PublishedByWatermark.N != 2 || h.Watermark == nil ||
		h.Watermark.LSN != lsn || h.Watermark.Slot != "outbox_relay" {
		t.Errorf("health: by state %v, by the watermark %+v, watermark %+v", counts, h.PublishedByWatermark, h.Watermark)
	}
	if _, body := b.get("/ui/"); !strings.Contains(body, `id="watermark">published includes 2 ready rows covered by the watermark`) {
		t.Errorf("overview does not show the watermark:\n%s", body)
	}
}
