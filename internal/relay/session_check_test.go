package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// Issue 30, item 12: the checks of the start (the table's recorded
// --ordering and --on-publish, the table's columns, the publication, the
// server) ran once per process. A change while the relay ran (another
// instance recording other settings, a column dropped) went unseen by every
// later session, after a reconnect, a takeover or a PostgreSQL restart. Now
// each session start checks again: the relay streams nothing, says which
// check failed and how to fix it, keeps running (no crash loop) and checks
// again at each attempt, and streams again once the check passes.
func TestSessionStartChecksAgain(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	for _, c := range []struct {
		name   string
		change func(h *harness)
		says   []string
		undo   func(h *harness)
	}{
		{
			name: "settings recorded by another instance",
			change: func(h *harness) {
				if _, _, err := store.RecordSettings(context.Background(), h.pool, h.opts.Table,
					store.Settings{Ordering: "none", OnPublish: store.PolicyDelete}, "run --worker-id other"); err != nil {
					h.t.Fatal(err)
				}
			},
			says: []string{"--on-publish: the table's is delete, this instance's mark", "recorded by run --worker-id other", "migrate --record-settings"},
			undo: func(h *harness) {
				if _, _, err := store.RecordSettings(context.Background(), h.pool, h.opts.Table,
					store.Settings{Ordering: "none", OnPublish: store.PolicyMark}, "test"); err != nil {
					h.t.Fatal(err)
				}
			},
		},
		{
			name:   "a column dropped",
			change: func(h *harness) { h.exec(`ALTER TABLE outbox DROP COLUMN redrive_reason`) },
			says:   []string{"lacks column(s) redrive_reason", "migrate"},
			undo:   func(h *harness) { h.exec(`ALTER TABLE outbox ADD COLUMN redrive_reason text`) },
		},
		{
			name:   "the publication altered",
			change: func(h *harness) { h.exec(`ALTER PUBLICATION outbox_relay SET (publish = 'insert, update')`) },
			says:   []string{"must publish inserts only", `SET (publish = 'insert')`},
			undo:   func(h *harness) { h.exec(`ALTER PUBLICATION outbox_relay SET (publish = 'insert')`) },
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, sharedSetup(t))
			logs := &testenv.LogBuffer{}
			h.logs = logs
			h.start()
			first := h.insertRows("first", 2, 1)
			h.waitPublished(2, 20*time.Second)

			settings := c.name == "settings recorded by another instance"
			c.change(h)
			// A new session, as after a reconnect: the walsender ends (and
			// is waited for, so that it streams nothing more).
			h.exec(`SELECT pg_terminate_backend(active_pid, 10000) FROM pg_replication_slots WHERE slot_name = $1 AND active_pid IS NOT NULL`, h.opts.Slot)
			h.exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('after', 'thing_happened', '{}')`)
			refusals := func() int { return strings.Count(logs.String(), c.says[0]) }
			waitRefusals := func(n int) {
				t.Helper()
				testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("the relay refusing %d times (or publishing the new row)", n), func() (bool, error) {
					m := h.streamCount()
					return refusals() >= n || m > 2, fmt.Errorf("refusals logged %d, stream holds %d", refusals(), m)
				})
			}
			waitRefusals(2)
			want := append(first, "after")
			if settings {
				// The poller of an instance whose settings differ from the
				// table's waits too (an unordered poller would publish a
				// held aggregate's later rows, the bug of issue 20).
				h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('after-scheduled', 'thing_happened', '{}', 'scheduled')`)
				want = append(want, "after-scheduled")
				waitRefusals(refusals() + 2) // a second or more: many poll intervals
			}
			if n := h.streamCount(); n != 2 {
				t.Errorf("after the change the stream holds %d messages, want the 2 from before: the new session streamed", n)
			}
			l := logs.String()
			for _, s := range c.says {
				if !strings.Contains(l, s) {
					t.Errorf("the log does not say %q", s)
				}
			}
			if !strings.Contains(l, "not streaming until it passes") {
				t.Errorf("the log does not say the relay waits for the check to pass")
			}
			if t.Failed() {
				t.FailNow()
			}

			// Recovery: undo the change; the same process streams again.
			c.undo(h)
			h.waitPublished(len(want), 60*time.Second)
			h.assertExactlyOnce(want)
		})
	}
}
