package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
)

// Under --on-publish none, status counts a ready row the watermark covers
// as published and shows the watermark; cancel and redrive refuse such a
// row as published; prune deletes it when it is old enough and says how
// many, and never a ready row in flight.
func TestOpsCommandsUnderNone(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq, created_at) VALUES
		('cov-old', 'k', '{}', 'ready',     NULL, NULL, clock_timestamp() - interval '9 days'),
		('cov-new', 'k', '{}', 'ready',     NULL, NULL, clock_timestamp()),
		('pub-old', 'k', '{}', 'published', clock_timestamp() - interval '8 days', 3, clock_timestamp() - interval '9 days')`)
	mustExec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('outbox_relay')`)
	mustExec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`)
	// Inserted after the watermark: in flight, however old it claims to be.
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('fly-old', 'k', '{}', clock_timestamp() - interval '9 days')`)
	var lsn string
	if err := pool.QueryRow(context.Background(), `SELECT watermark_lsn::text FROM outbox_slots`).Scan(&lsn); err != nil {
		t.Fatal(err)
	}

	code, out, _ := run(t, "status", "--database-url", url, "--json")
	var rep statusReport
	if err := json.Unmarshal([]byte(out), &rep); code != 0 || err != nil {
		t.Fatalf("status --json: exit %d, %v\n%s", code, err, out)
	}
	if rep.ByState["ready"] != 1 || rep.ByState["published"] != 3 || rep.PublishedByWatermark != 2 || rep.PublishedByWatermarkAtLeast ||
		rep.Watermark == nil || rep.Watermark.Slot != "outbox_relay" || rep.Watermark.LSN != lsn {
		t.Errorf("status: by state %v, by the watermark %d, watermark %+v", rep.ByState, rep.PublishedByWatermark, rep.Watermark)
	}
	code, out, _ = run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "watermark  "+lsn+" of slot outbox_relay, recorded ") ||
		!strings.Contains(out, "published (watermark)=2, ready rows it covers, without stream_seq") ||
		!strings.Contains(out, "ready=1 ") || !strings.Contains(out, "published=3 ") {
		t.Errorf("status: exit %d\n%s", code, out)
	}

	for _, cmd := range []string{"cancel", "redrive"} {
		code, out, _ = run(t, cmd, "--database-url", url, "--reason", "test", "--work-id", "cov-old", "--work-id", "fly-old")
		if code != 1 || !strings.Contains(out, "cov-old: published (covered by the watermark, --on-publish none): the broker has it (terminal)") ||
			!strings.Contains(out, "fly-old: ready: already on its way through the CDC path") {
			t.Errorf("%s: exit %d, stdout %q", cmd, code, out)
		}
	}

	code, out, _ = run(t, "prune", "--database-url", url, "--older-than", "7d", "--dry-run")
	if code != 0 || !strings.Contains(out, "would prune 2 published rows (1 of them ready rows covered by the watermark") {
		t.Errorf("prune dry run: exit %d, stdout %q", code, out)
	}
	code, out, _ = run(t, "prune", "--database-url", url, "--older-than", "7d")
	if code != 0 || !strings.Contains(out, "pruned 2 published rows (1 of them ready rows covered by the watermark") {
		t.Errorf("prune: exit %d, stdout %q", code, out)
	}
	var left []string
	rows, err := pool.Query(context.Background(), `SELECT work_id || ':' || state FROM outbox ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		left = append(left, s)
	}
	if strings.Join(left, ",") != "cov-new:ready,fly-old:ready" {
		t.Errorf("rows left: %v, want cov-new and fly-old, as inserted", left)
	}
}

// The rows in flight are looked for among the newest 10,000 rows only
// (G16): when the oldest of those is in flight, status says ready and the
// oldest eligible age are lower bounds. Once a watermark covers them all,
// ready is 0 and every row counts as published, exactly on a small table.
func TestStatusReadyInFlightIsALowerBound(t *testing.T) {
	url, pool := migrated(t)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) SELECT 'old-' || g, 'k', '{}' FROM generate_series(1, 5000) g`)
	mustExec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('outbox_relay')`)
	watermark := `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`
	mustExec(t, pool, watermark)
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, available_at) SELECT 'new-' || g, 'k', '{}', clock_timestamp() - interval '1 hour' FROM generate_series(1, 10000) g`)
	code, out, _ := run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "ready=10000+ ") || !strings.Contains(out, "published=5000 ") ||
		!strings.Contains(out, "s or more (ready rows in flight reach past the newest 10000 rows looked at)") ||
		!strings.Contains(out, "published (watermark)=5000,") {
		t.Errorf("status with 10,000 rows in flight: exit %d\n%s", code, out)
	}
	mustExec(t, pool, watermark)
	code, out, _ = run(t, "status", "--database-url", url)
	if code != 0 || !strings.Contains(out, "ready=0 ") || !strings.Contains(out, "published=15000 ") ||
		!strings.Contains(out, "oldest eligible row: 0.0s\n") || !strings.Contains(out, "published (watermark)=15000,") {
		t.Errorf("status with every row covered: exit %d\n%s", code, out)
	}
}
