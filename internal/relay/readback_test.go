package relay_test

import (
	"context"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// G18 at the confirmed position itself. PostgreSQL replays a transaction
// whose commit record starts at the slot's confirmed position (it skips
// only those that start before it), and that position is often exactly a
// commit LSN: a transaction's end LSN, confirmed, is where the next
// commit record begins when that transaction's rows were written before
// its predecessor committed (two producers at once). The read-back took a
// stored message whose Outbox-Commit-LSN equals the confirmed position as
// confirmed and not replayed, so the replayed transaction was published
// again: found by chaos seed 1796243499885875007 (8 rows of one
// transaction stored twice after a takeover, 5.4 s apart with a 2 s
// window). Here the slot is put at that position by hand: a copy of it
// taken before the rows, advanced to the second transaction's commit LSN.
func TestReadBackFindsTheTransactionAtTheConfirmedPosition(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.opts.DuplicateWindow = time.Second
	ctx := context.Background()
	h.start()
	warm := h.insertRows("warm", 1, 1)
	h.waitPublished(1, 30*time.Second)
	h.stop()

	const saved = "outbox_relay_at_commit"
	h.exec(`SELECT pg_copy_logical_replication_slot($1, $2)`, h.opts.Slot, saved)
	t.Cleanup(func() { _, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, saved) })
	first := h.insertRows("first", 2, 2)
	second := h.insertRows("second", 3, 3)
	h.start()
	h.waitPublished(6, 30*time.Second)
	h.stop()
	byID, _ := h.streamMsgs()
	at := byID["second-0"].Header.Get(wire.HeaderCommitLSN)
	if at == "" || at == byID["first-0"].Header.Get(wire.HeaderCommitLSN) {
		t.Fatalf("commit LSNs: first %q, second %q", byID["first-0"].Header.Get(wire.HeaderCommitLSN), at)
	}

	// The slot back where it was before the rows, then confirmed up to the
	// second transaction's commit record: the first is behind it, the
	// second is replayed.
	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	h.exec(`SELECT pg_copy_logical_replication_slot($1, $2)`, saved, h.opts.Slot)
	h.exec(`SELECT pg_replication_slot_advance($1, $2::pg_lsn)`, h.opts.Slot, at)
	if lsn, _ := h.slotConfirmed(); lsn != at {
		t.Fatalf("slot confirmed at %s, want %s", lsn, at)
	}
	time.Sleep(3 * h.opts.DuplicateWindow) // the broker forgets the IDs

	h.start()
	more := h.insertRows("after", 1, 1)
	testenv.WaitFor(t, 30*time.Second, "after-0 in the stream", func() (bool, error) {
		byID, _ := h.streamMsgs()
		return byID["after-0"] != nil, nil
	})
	h.stop()
	h.assertExactlyOnce(append(append(append(warm, first...), second...), more...))
	var seq uint64
	if err := h.pool.QueryRow(ctx, `SELECT stream_seq FROM outbox WHERE work_id = 'second-0'`).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	if seq != byID["second-0"].Sequence {
		t.Fatalf("second-0 points at sequence %d, want the stored %d", seq, byID["second-0"].Sequence)
	}
}
