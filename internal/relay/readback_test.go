package relay_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
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
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.DuplicateWindow = time.Second
	ctx := context.Background()
	stored, byID := replayPublished(t, h, func(byID map[string]*jetstream.RawStreamMsg) string {
		at := byID["second-0"].Header.Get(wire.HeaderCommitLSN)
		if at == "" || at == byID["first-0"].Header.Get(wire.HeaderCommitLSN) {
			t.Fatalf("commit LSNs: first %q, second %q", byID["first-0"].Header.Get(wire.HeaderCommitLSN), at)
		}
		// Confirmed up to the second transaction's commit record: the
		// first is behind it, the second is replayed.
		return at
	})

	h.start()
	more := h.insertRows("after", 1, 1)
	waitStored(t, h, "after-0")
	h.stop()
	h.assertExactlyOnce(append(stored, more...))
	var seq uint64
	if err := h.pool.QueryRow(ctx, `SELECT stream_seq FROM outbox WHERE work_id = 'second-0'`).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	if seq != byID["second-0"].Sequence {
		t.Fatalf("second-0 points at sequence %d, want the stored %d", seq, byID["second-0"].Sequence)
	}
}

// A read-back that fails does not let the replay through: the session ends
// as in an outage and the next one reads again. Before, the session
// published what it could not check (a read hung for its whole minute
// across a cut NATS connection, and the replay after it stored 119 rows
// twice: chaos seed 1796245287009604072).
func TestReadBackThatFailsHoldsTheReplay(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.DuplicateWindow = time.Second
	var failing atomic.Bool
	var attempts atomic.Int32
	h.opts.CDCSink = func(s *natssink.Sink) sinks.Sink {
		return &failingReadBack{Sink: s, failing: &failing, attempts: &attempts}
	}
	stored, _ := replayPublished(t, h, func(map[string]*jetstream.RawStreamMsg) string { return "" })

	failing.Store(true)
	before := h.streamCount()
	h.start()
	testenv.WaitFor(t, 30*time.Second, "two failed read-backs, or a publish", func() (bool, error) {
		return attempts.Load() >= 2 || h.streamCount() != before, nil
	})
	if got := h.streamCount(); got != before {
		t.Fatalf("stream holds %d messages, %d before: the session published a replay it could not check", got, before)
	}
	failing.Store(false)
	more := h.insertRows("after", 1, 1)
	waitStored(t, h, "after-0")
	h.stop()
	h.assertExactlyOnce(append(stored, more...))
}

// failingReadBack is the relay's sink with a read-back that fails while
// failing is set.
type failingReadBack struct {
	*natssink.Sink
	failing  *atomic.Bool
	attempts *atomic.Int32
}

func (f *failingReadBack) ReadStored(ctx context.Context, from sinks.From, limit int, each func(sinks.Stored) bool) (sinks.ReadResult, error) {
	if f.failing.Load() {
		f.attempts.Add(1)
		return sinks.ReadResult{}, errors.New("read back: test failure")
	}
	return f.Sink.ReadStored(ctx, from, limit, each)
}

// replayPublished publishes rows (first-0..1 in one transaction, second-0..2
// in the next) and puts the slot back before them, as after a crash that
// confirmed none of them, then (at, when not empty) confirmed up to at; it
// waits until the broker forgot their IDs. It returns every row published
// and the stream's messages by ID.
func replayPublished(t *testing.T, h *harness, confirmAt func(map[string]*jetstream.RawStreamMsg) string) ([]string, map[string]*jetstream.RawStreamMsg) {
	t.Helper()
	h.start()
	warm := h.insertRows("warm", 1, 1)
	h.waitPublished(1, 30*time.Second)
	h.stop()

	saved := h.opts.Slot + "_saved"
	h.exec(`SELECT pg_copy_logical_replication_slot($1, $2)`, h.opts.Slot, saved)
	t.Cleanup(func() { _, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, saved) })
	first := h.insertRows("first", 2, 2)
	second := h.insertRows("second", 3, 3)
	h.start()
	h.waitPublished(6, 30*time.Second)
	h.stop()
	byID, _ := h.streamMsgs()

	h.exec(`SELECT pg_drop_replication_slot($1)`, h.opts.Slot)
	h.exec(`SELECT pg_copy_logical_replication_slot($1, $2)`, saved, h.opts.Slot)
	if at := confirmAt(byID); at != "" {
		h.exec(`SELECT pg_replication_slot_advance($1, $2::pg_lsn)`, h.opts.Slot, at)
		if lsn, _ := h.slotConfirmed(); lsn != at {
			t.Fatalf("slot confirmed at %s, want %s", lsn, at)
		}
	}
	time.Sleep(3 * h.opts.DuplicateWindow) // the broker forgets the IDs
	return append(append(warm, first...), second...), byID
}

func waitStored(t *testing.T, h *harness, id string) {
	t.Helper()
	testenv.WaitFor(t, 30*time.Second, id+" in the stream", func() (bool, error) {
		byID, _ := h.streamMsgs()
		return byID[id] != nil, nil
	})
}
