package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G19 under --on-publish none, issue 31 item 3: the broker acknowledged
// messages and lost them (its newest block's tail cut). The rows stay
// 'ready', covered by the watermark; nothing would publish them again.
// republish looks each up in the stream and publishes exactly the lost
// ones: the stream then holds every row once. A dry run and a lookup cut
// short by --lookup-limit publish nothing; a row in flight (not covered)
// is not touched; a row found in the stream is not stored twice although
// the duplicate window (1 s) has passed; a 'published' row (the poller's)
// gets the new sequence.
func TestRepublishAfterBrokerLostTail(t *testing.T) {
	url, pool := migrated(t)
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	const stream, prefix = "REPUB", "repub."
	ctx := context.Background()
	js := connect(t, n.URL())
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}, Duplicates: time.Second, Storage: jetstream.FileStorage}); err != nil {
		t.Fatal(err)
	}
	const ready, published = 1500, 50
	pad := strings.Repeat("x", 200)
	mustExec(t, pool, fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload) SELECT 'r-' || lpad(g::text, 5, '0'), 'k', json_build_object('g', g, 'pad', '%s') FROM generate_series(1, %d) g`, pad, ready))
	mustExec(t, pool, fmt.Sprintf(`INSERT INTO outbox (work_id, kind, payload, state) SELECT 'p-' || lpad(g::text, 5, '0'), 'k', json_build_object('g', g, 'pad', '%s'), 'published' FROM generate_series(1, %d) g`, pad, published))
	// Published as the relay did: in creation order, Nats-Msg-Id the work ID.
	rows, err := pool.Query(ctx, `SELECT work_id, payload::text, state FROM outbox ORDER BY created_at, work_id`)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	type pub struct{ id, payload, state string }
	var all []pub
	for rows.Next() {
		var p pub
		if err := rows.Scan(&p.id, &p.payload, &p.state); err != nil {
			t.Fatal(err)
		}
		all = append(all, p)
	}
	rows.Close()
	for _, p := range all {
		m := nats.NewMsg(prefix + "k")
		m.Header.Set(jetstream.MsgIDHeader, p.id)
		m.Data = []byte(p.payload)
		ack, err := js.PublishMsg(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		if p.state == "published" {
			mustExec(t, pool, fmt.Sprintf(`UPDATE outbox SET stream_name = '%s', stream_seq = %d, published_at = clock_timestamp() WHERE work_id = '%s'`, stream, ack.Sequence, p.id))
		}
		ids = append(ids, p.id)
	}
	mustExec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('outbox_relay')`)
	mustExec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`)
	// In flight: inserted after the watermark, not published yet.
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('in-flight', 'k', '{}')`)

	js.Conn().Close()
	if err := n.Stop(); err != nil {
		t.Fatal(err)
	}
	if _, err := n.CutStreamTail(stream, 0.6); err != nil {
		t.Fatal(err)
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	js = connect(t, n.URL())
	left := streamIDs(t, js, stream)
	if len(left) == 0 || len(left) >= len(ids) {
		t.Fatalf("the cut left %d of %d messages: the test proves nothing", len(left), len(ids))
	}
	lost := len(ids) - len(left)
	t.Logf("stream holds %d of %d after the cut", len(left), len(ids))
	time.Sleep(1500 * time.Millisecond) // past the duplicate window: only the lookup keeps a found row from being stored twice

	args := []string{"republish", "--database-url", url, "--nats-url", n.URL(), "--stream", stream, "--subject-prefix", prefix, "--on-publish", "none", "--since", "1h"}
	code, out, _ := run(t, append(args, "--dry-run")...)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("would republish %d rows", lost)) ||
		!strings.Contains(out, fmt.Sprintf("checked %d, found stored %d, would republish %d, not checked 0", len(ids), len(left), lost)) {
		t.Errorf("dry run: exit %d, stdout %q", code, out)
	}
	if got := streamIDs(t, js, stream); len(got) != len(left) {
		t.Fatalf("dry run: stream holds %d, want %d as before", len(got), len(left))
	}

	code, _, errOut := run(t, append(args, "--lookup-limit", "10")...)
	if code == 0 || !strings.Contains(errOut, "not checked, not published") {
		t.Errorf("lookup cut short: exit %d, stderr %q; want an error and the rows not checked", code, errOut)
	}
	if got := streamIDs(t, js, stream); len(got) != len(left) {
		t.Fatalf("lookup cut short without --force: stream holds %d, want %d as before", len(got), len(left))
	}

	code, out, _ = run(t, args...)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("checked %d, found stored %d, republished %d, not checked 0", len(ids), len(left), lost)) {
		t.Errorf("republish: exit %d, stdout %q", code, out)
	}
	got := streamIDs(t, js, stream)
	var missing, twice []string
	for _, id := range ids {
		switch got[id] {
		case 1:
		case 0:
			missing = append(missing, id)
		default:
			twice = append(twice, id)
		}
	}
	if len(missing) > 0 || len(twice) > 0 || got["in-flight"] != 0 || len(got) != len(ids) {
		t.Errorf("after republish: %d lost (%v), %d stored twice (%v), in-flight %d, %d in all, want %d each once",
			len(missing), first(missing), len(twice), first(twice), got["in-flight"], len(got), len(ids))
	}
	// The 'published' rows were the newest, so cut: each points at its new message.
	var stale int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published' AND (last_error IS NULL OR last_error NOT LIKE 'republished:%')`).Scan(&stale); err != nil {
		t.Fatal(err)
	}
	if stale != 0 {
		t.Errorf("%d published rows without the new sequence recorded", stale)
	}
	// Again: everything is found, nothing published.
	code, out, _ = run(t, args...)
	if code != 0 || !strings.Contains(out, fmt.Sprintf("found stored %d, republished 0", len(ids))) || len(streamIDs(t, js, stream)) != len(ids) {
		t.Errorf("second run: exit %d, stdout %q", code, out)
	}
}

// Under delete the rows are gone: republish says so and exits non-zero.
func TestRepublishRefusesUnderDelete(t *testing.T) {
	url, _ := migrated(t)
	code, _, errOut := run(t, "republish", "--database-url", url, "--on-publish", "delete", "--since", "30m")
	if code == 0 || !strings.Contains(errOut, "cannot be republished from it") {
		t.Errorf("exit %d, stderr %q", code, errOut)
	}
	code, _, errOut = run(t, "republish", "--database-url", url, "--on-publish", "none")
	if code == 0 || !strings.Contains(errOut, "--since is required") {
		t.Errorf("no --since: exit %d, stderr %q", code, errOut)
	}
}

func first(ids []string) []string { return ids[:min(len(ids), 5)] }

// --force republishes the rows the lookup did not reach: the one missing
// is stored, and one the stream does hold is stored a second time past
// the duplicate window, as the warning says. Without it neither is.
func TestRepublishForcePublishesNotChecked(t *testing.T) {
	url, pool := migrated(t)
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	js := createStream(t, env.NATS.URL(), stream, prefix, time.Second)
	ctx := context.Background()
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('f-1', 'k', '{}'), ('f-2', 'k', '{}'), ('f-3', 'k', '{}')`)
	for _, id := range []string{"f-1", "f-2"} {
		m := nats.NewMsg(prefix + "k")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = []byte(`{}`)
		if _, err := js.PublishMsg(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	mustExec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('outbox_relay')`)
	mustExec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()), watermark_at = clock_timestamp()`)
	time.Sleep(1500 * time.Millisecond)
	args := []string{"republish", "--database-url", url, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix, "--on-publish", "none", "--since", "1h", "--lookup-limit", "1"}
	code, out, _ := run(t, args...)
	if got := streamIDs(t, js, stream); code == 0 || !strings.Contains(out, "checked 1, found stored 1, republished 0, not checked 2") || got["f-2"] != 1 || got["f-3"] != 0 {
		t.Errorf("without --force: exit %d, stream %v, stdout %q", code, got, out)
	}
	code, out, errOut := run(t, append(args, "--force")...)
	if got := streamIDs(t, js, stream); code != 0 || !strings.Contains(errOut, "the broker's duplicate window is the only guard") ||
		!strings.Contains(out, "republished 2 rows: f-2, f-3") || got["f-1"] != 1 || got["f-2"] != 2 || got["f-3"] != 1 {
		t.Errorf("--force: exit %d, stream %v, stdout %q, stderr %q", code, got, out, errOut)
	}
}
