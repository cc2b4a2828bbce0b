package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// The publication streams only rows inserted 'ready': a row inserted
// 'scheduled' is the poller's, and the slot does not send it (the relay
// used to decode it only to drop it). Counted in what pgoutput itself emits
// for the publication, on a second slot of the same database; and every
// row, of either state, still ends in the stream once. A publication made
// before the filter keeps working and migrate's FilterPublication adds it.
func TestPublicationStreamsReadyRowsOnly(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.start()
	ctx := context.Background()

	filter := func() string { return testenv.PublicationRowFilter(t, h.pool, "outbox_relay", "outbox") }
	if got := filter(); got != replication.ReadyFilterCatalog {
		t.Fatalf("row filter of the relay's publication = %s, want %s", got, replication.ReadyFilterCatalog)
	}

	var db string
	if err := h.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	peek := "peek_" + db
	h.exec(`SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, peek)
	t.Cleanup(func() { h.exec(`SELECT pg_drop_replication_slot($1)`, peek) })
	// Inserts pgoutput sends for the publication since the peek slot began
	// ('I' messages, protocol 1).
	streamed := func() int {
		t.Helper()
		var n int
		if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
				'proto_version', '1', 'publication_names', 'outbox_relay') WHERE substr(data, 1, 1) = 'I'`, peek).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	insert := func(prefix string, ready, scheduled int) {
		t.Helper()
		h.insertRows(prefix+"-ready", ready, 1)
		for i := 0; i < scheduled; i++ {
			h.exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ($1, 'thing_happened', '{}', 'scheduled')`,
				fmt.Sprintf("%s-scheduled-%d", prefix, i))
		}
	}

	insert("a", 2, 3)
	h.waitPublished(5, 20*time.Second)
	if n := streamed(); n != 2 {
		t.Fatalf("filtered publication: pgoutput sent %d inserts for 2 ready and 3 scheduled rows, want 2", n)
	}

	// A publication from before the filter: the relay accepts it and drops
	// the scheduled rows itself.
	h.stop()
	h.exec(`ALTER PUBLICATION outbox_relay SET TABLE outbox`)
	h.start()
	insert("b", 1, 1)
	h.waitPublished(7, 20*time.Second)
	if n := streamed(); n != 4 {
		t.Fatalf("unfiltered publication: pgoutput sent %d inserts in all, want 4", n)
	}

	// What migrate does to it, with the relay streaming.
	if _, err := replication.EnsurePublication(ctx, h.pool, "outbox_relay", "public", "outbox"); err != nil {
		t.Fatal(err)
	}
	if err := replication.FilterPublication(ctx, h.pool, "outbox_relay", "public", "outbox"); err != nil {
		t.Fatal(err)
	}
	if got := filter(); got != replication.ReadyFilterCatalog {
		t.Fatalf("row filter after FilterPublication = %s, want %s", got, replication.ReadyFilterCatalog)
	}
	insert("c", 1, 2)
	h.waitPublished(10, 20*time.Second)
	if n := streamed(); n != 5 {
		t.Fatalf("after FilterPublication: pgoutput sent %d inserts in all, want 5", n)
	}
	byID, counts := h.streamMsgs()
	if len(byID) != 10 {
		t.Fatalf("stream holds %d distinct work IDs, want 10", len(byID))
	}
	for id, c := range counts {
		if c != 1 {
			t.Errorf("%s stored %d times", id, c)
		}
	}
}
