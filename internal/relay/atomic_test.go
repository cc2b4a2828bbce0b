package relay_test

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// startAtomic runs the harness's relay with --atomic-transactions and
// /metrics, and returns the metrics' base URL.
func startAtomic(t *testing.T, h *harness) string {
	t.Helper()
	h.opts.AtomicTransactions = true
	h.opts.MaxInFlight = 1024
	h.opts.HTTPAddr = "127.0.0.1:0"
	addr := make(chan string, 1)
	h.opts.Listening = func(a string) { addr <- a }
	h.start()
	return "http://" + <-addr
}

// rowSeqs reads each row's state and stream_seq.
func rowSeqs(t *testing.T, h *harness, like string) map[string]uint64 {
	t.Helper()
	rows, err := h.pool.Query(context.Background(), `SELECT work_id, coalesce(stream_seq, 0) FROM outbox WHERE work_id LIKE $1 AND state = 'published'`, like)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]uint64{}
	for rows.Next() {
		var id string
		var seq int64
		if err := rows.Scan(&id, &seq); err != nil {
			t.Fatal(err)
		}
		out[id] = uint64(seq)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// A transaction of 2,500 rows, over the server's 1,000 messages per batch,
// reaches the stream as three consecutive atomic batches of 1,000, 1,000
// and 500, in commit order, each whole; a transaction of 7 rows as one
// batch; one of a single row as a plain message. Every row's stream_seq is
// the sequence its message is stored at (the batch's answer names only
// the last), and the split transaction is counted.
func TestAtomicTransactionLargerThanABatch(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	base := startAtomic(t, h)
	h.exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'big-' || i, 'thing_happened', jsonb_build_object('n', i) FROM generate_series(0, 2499) i`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'small-' || i, 'thing_happened', jsonb_build_object('n', i) FROM generate_series(0, 6) i`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('single', 'thing_happened', '{}')`)
	h.waitPublished(2508, 60*time.Second)

	byID, counts := h.streamMsgs()
	type batch struct {
		id         string
		first, end uint64 // stream sequences
		n          int
		committed  bool
	}
	batches := map[string]*batch{}
	var order []*batch
	seqs := rowSeqs(t, h, "%")
	for id, m := range byID {
		if counts[id] != 1 {
			t.Fatalf("%s stored %d times", id, counts[id])
		}
		if seqs[id] != m.Sequence {
			t.Fatalf("%s: stream_seq %d in the table, stored at %d", id, seqs[id], m.Sequence)
		}
		bid := m.Header.Get(natssink.HeaderBatchID)
		if bid == "" {
			if id != "single" {
				t.Fatalf("%s was not published in a batch", id)
			}
			continue
		}
		b := batches[bid]
		if b == nil {
			b = &batch{id: bid, first: m.Sequence, end: m.Sequence}
			batches[bid] = b
			order = append(order, b)
		}
		b.n++
		b.first, b.end = min(b.first, m.Sequence), max(b.end, m.Sequence)
		if m.Header.Get(natssink.HeaderBatchCommit) == "1" {
			b.committed = true
		}
	}
	for id, m := range byID {
		if b := batches[m.Header.Get(natssink.HeaderBatchID)]; b != nil {
			if pos, _ := strconv.Atoi(m.Header.Get(natssink.HeaderBatchSeq)); uint64(pos) != m.Sequence-b.first+1 {
				t.Fatalf("%s: batch position %d at sequence %d of a batch from %d", id, pos, m.Sequence, b.first)
			}
		}
	}
	sort.Slice(order, func(i, j int) bool { return order[i].first < order[j].first })
	var sizes []int
	for _, b := range order {
		if uint64(b.n) != b.end-b.first+1 || !b.committed {
			t.Fatalf("batch %s: %d messages over sequences %d..%d, committed %v: want consecutive and committed", b.id, b.n, b.first, b.end, b.committed)
		}
		sizes = append(sizes, b.n)
	}
	if fmt.Sprint(sizes) != "[1000 1000 500 7]" {
		t.Fatalf("batches of %v in stream order, want [1000 1000 500 7]", sizes)
	}
	if got := scrape(t, base, `outbox_relay_atomic_split_transactions_total`); got != 1 {
		t.Fatalf("outbox_relay_atomic_split_transactions_total %v, want 1", got)
	}
	if got := scrape(t, base, `outbox_relay_atomic_batches_total`); got != 4 {
		t.Fatalf("outbox_relay_atomic_batches_total %v, want 4", got)
	}
}

// A transaction the stream holds already (a replay after a crash: every
// Nats-Msg-Id known, the batch refused whole with 10201) ends settled: its
// rows published with the sequences already stored, the stream unchanged.
// A transaction of which the stream holds some rows (published row by row
// before) ends stored once, each row.
func TestAtomicReplayOfStoredTransactionSettles(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	// The read-back (G18) would find the stored rows before any batch is
	// sent: off, to test the broker's refusal and the fallback behind it.
	h.opts.ReadBackLimit = -1
	base := startAtomic(t, h)
	ctx := context.Background()
	stored := map[string]uint64{}
	pre := func(id string) {
		ack, err := h.js.PublishMsg(ctx, &nats.Msg{Subject: h.opts.SubjectPrefix + "thing_happened", Data: []byte(`{}`),
			Header: nats.Header{jetstream.MsgIDHeader: {id}}})
		if err != nil {
			t.Fatal(err)
		}
		stored[id] = ack.Sequence
	}
	for i := range 5 {
		pre(fmt.Sprintf("replay-%d", i))
	}
	pre("part-1")
	pre("part-3")
	before := h.streamCount()

	h.exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'replay-' || i, 'thing_happened', '{}' FROM generate_series(0, 4) i`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'part-' || i, 'thing_happened', '{}' FROM generate_series(0, 3) i`)
	h.waitPublished(9, 30*time.Second)
	var end string
	if err := h.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
		t.Fatal(err)
	}

	if got := h.streamCount(); got != before+2 {
		t.Fatalf("stream holds %d messages, want %d (the 7 stored before and the 2 new rows of part)", got, before+2)
	}
	_, counts := h.streamMsgs()
	seqs := rowSeqs(t, h, "%")
	for id, seq := range stored {
		if seqs[id] != seq || counts[id] != 1 {
			t.Fatalf("%s: stream_seq %d, stored %d times; want %d, once", id, seqs[id], counts[id], seq)
		}
	}
	for _, id := range []string{"part-0", "part-2"} {
		if counts[id] != 1 || seqs[id] == 0 {
			t.Fatalf("%s: stored %d times, stream_seq %d", id, counts[id], seqs[id])
		}
	}
	if got := scrape(t, base, `outbox_relay_atomic_batches_total{result="refused"}`); got != 2 {
		t.Fatalf(`outbox_relay_atomic_batches_total{result="refused"} %v, want 2`, got)
	}
	testenv.WaitFor(t, 10*time.Second, "slot confirmed past the replayed transactions", func() (bool, error) {
		var past bool
		err := h.pool.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`, h.opts.Slot, end).Scan(&past)
		return past, err
	})
}

// G20 with G14: --atomic-transactions behind --standby-slot. A standby
// that is behind (a physical slot nobody advances) holds each transaction
// back whole, and once it flushed them each goes as one batch: the rows of
// a transaction at consecutive stream sequences, every row once. (Without
// the standby slot the held rows are published within the window and the
// test fails there.)
func TestAtomicTransactionsWaitForTheStandby(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	h.exec(`SELECT pg_create_physical_replication_slot('standby_atomic', true)`)
	t.Cleanup(func() {
		_, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot('standby_atomic')`)
	})
	h.opts.StandbySlots = []string{"standby_atomic"}
	startAtomic(t, h)
	warm := h.insertRows("sbwarm", 1, 1)
	h.walSent()
	latency := h.releaseLatency("standby_atomic", 1)
	window := max(5*latency, time.Second)

	const txs, perTx = 3, 4
	held := h.insertRows("sbheld", txs*perTx, perTx)
	h.walSent()
	h.gatedFor(window, 1)
	h.releaseLatency("standby_atomic", 1+txs*perTx)
	h.assertExactlyOnce(append(warm, held...))
	seqs := rowSeqs(t, h, "sbheld-%")
	for tx := 0; tx < txs; tx++ {
		first := seqs[fmt.Sprintf("sbheld-%d", tx*perTx)]
		for j := 1; j < perTx; j++ {
			id := fmt.Sprintf("sbheld-%d", tx*perTx+j)
			if seqs[id] != first+uint64(j) {
				t.Errorf("transaction %d: %s at sequence %d, want %d (its transaction's rows consecutive from %d): %v", tx, id, seqs[id], first+uint64(j), first, seqs)
			}
		}
	}
}
