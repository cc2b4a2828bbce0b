package relay_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Hostile rows (issue 16) on both paths: inserted 'ready' they meet the CDC
// path, inserted 'scheduled' the poller. The table's CHECKs (migration 0005)
// would refuse most of them at insert; they are dropped here, as on a table
// that holds such rows from before the migration, so the relay's own
// defence is what is tested. Every hostile row ends failed with its reason,
// nothing reaches the server's API or another stream, the rows after them
// flow, and every published row points at a stored message that is exactly
// its own.
func TestHostileRowsNeverDriveTheBrokerOrCollapse(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	for _, path := range []string{"ready", "scheduled"} {
		t.Run(path, func(t *testing.T) {
			h := newHarness(t, sharedSetup(t))
			h.opts.MaxAttempts = 2
			ctx := context.Background()
			victim := h.opts.Stream + "_VICTIM"
			if _, err := h.js.CreateStream(ctx, jetstream.StreamConfig{Name: victim, Subjects: []string{victim + ".>"}}); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = h.js.DeleteStream(context.Background(), victim) })
			for range 5 {
				if _, err := h.js.Publish(ctx, victim+".x", []byte(`{}`)); err != nil {
					t.Fatal(err)
				}
			}
			h.exec(`ALTER TABLE outbox DROP CONSTRAINT outbox_work_id_wire_check, DROP CONSTRAINT outbox_kind_wire_check, DROP CONSTRAINT outbox_subject_wire_check`)
			h.start()
			before := h.insertRows("before", 5, 1)

			type bad struct{ id, kind, subject, headers, reason string }
			bigHeaders := `(SELECT jsonb_object_agg('h' || g, repeat('v', 1000)) FROM generate_series(1, 100) g)`
			rows := []bad{
				{"purge", "k", "$JS.API.STREAM.PURGE." + victim, "NULL", "reserved_subject"},
				{"delete", "k", "$JS.API.STREAM.DELETE." + h.opts.Stream, "NULL", "reserved_subject"},
				{"inbox", "k", "_INBOX.reply", "NULL", "reserved_subject"},
				{"other-stream", "k", victim + ".y", "NULL", "stream_not_allowed"},
				{"col-x ", "k", "", "NULL", "invalid_work_id"},
				{"col-x\n", "k", "", "NULL", "invalid_work_id"},
				{"\tcol-x", "k", "", "NULL", "invalid_work_id"},
				{" ", "k", "", "NULL", "invalid_work_id"},
				{"x\x1b[2K\r\nredrove 0 rows; all good", "k", "", "NULL", "invalid_work_id"},
				{strings.Repeat("w", 70<<10), "k", "", "NULL", "invalid_work_id"},
				{"kind-70kb", strings.Repeat("k", 70<<10), h.opts.SubjectPrefix + "x", "NULL", "invalid_kind"},
				{"kind-crlf", "k\r\nNats-Rollup: all", h.opts.SubjectPrefix + "x", "NULL", "invalid_kind"},
				{"headers-100k", "k", "", bigHeaders, "header_too_large"},
				{"header-name", "k", "", `'{"ümlaut":"v"}'`, "invalid_header"},
			}
			// col-x itself is a good row, committed first: the variants must
			// not collapse into its message.
			h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('col-x', 'k', '{"n":"col-x"}', $1)`, path)
			for i, b := range rows {
				var subject any
				if b.subject != "" {
					subject = b.subject
				}
				h.exec(`INSERT INTO outbox (work_id, kind, subject, payload, headers, state) VALUES ($1, $2, $3, jsonb_build_object('n', $4::int), `+b.headers+`, $5)`,
					b.id, b.kind, subject, i, path)
			}
			after := h.insertRows("after", 5, 1)

			testenv.WaitFor(t, 60*time.Second, "every hostile row failed and the good ones published", func() (bool, error) {
				return h.countState("failed") == len(rows) && h.countState("published") == 11, nil
			})
			for _, b := range rows {
				var lastErr, state string
				if err := h.pool.QueryRow(ctx, `SELECT state, last_error FROM outbox WHERE work_id = $1`, b.id).Scan(&state, &lastErr); err != nil {
					t.Fatal(err)
				}
				if state != "failed" || !strings.HasPrefix(lastErr, "rejected: "+b.reason+": ") {
					t.Errorf("%.40q: %s, %q; want failed with rejected: %s", b.id, state, lastErr, b.reason)
				}
			}
			// The server's API was never called: both streams are intact.
			for name, want := range map[string]uint64{victim: 5, h.opts.Stream: 11} {
				st, err := h.js.Stream(ctx, name)
				if err != nil {
					t.Fatalf("stream %s: %v", name, err)
				}
				if n := st.CachedInfo().State.Msgs; n != want {
					t.Errorf("stream %s holds %d messages, want %d", name, n, want)
				}
			}
			h.assertExactlyOnce(append(append(before, "col-x"), after...))
			assertPublishedAreTheirOwn(t, h)
		})
	}
}

// assertPublishedAreTheirOwn checks the invariant of issue 16: every row
// marked published points at a stored message whose Nats-Msg-Id and data
// are exactly its own.
func assertPublishedAreTheirOwn(t *testing.T, h *harness) {
	t.Helper()
	ctx := context.Background()
	st, err := h.js.Stream(ctx, h.opts.Stream)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := h.pool.Query(ctx, `SELECT work_id, payload::text, stream_seq FROM outbox WHERE state = 'published'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var id, payload string
		var seq int64
		if err := rows.Scan(&id, &payload, &seq); err != nil {
			t.Fatal(err)
		}
		m, err := st.GetMsg(ctx, uint64(seq))
		if err != nil {
			t.Errorf("%q: stream_seq %d: %v", id, seq, err)
			continue
		}
		if got := m.Header.Get(jetstream.MsgIDHeader); got != id || string(m.Data) != payload {
			t.Errorf("row %q (payload %s) points at seq %d holding %q with %s", id, payload, seq, got, m.Data)
		}
		n++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d published rows each point at their own message", n)
}
