package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

// G15: every decoded row the CDC path holds (in the stream's batch and
// channel, in the loop, held by the standby gate, in flight) counts against
// one byte budget, --max-buffered-bytes, and the stream stops reading WAL
// when it is spent. One transaction many times the budget is relayed with
// and without --standby-slot: the most bytes the session held stays within
// the budget plus one row, every row is stored once, the slot is confirmed
// past the commit and the budget is all given back. Rows larger than the
// whole budget pass one at a time, on both paths, instead of wedging the
// stream (with the gate, a transaction whose Commit cannot be read until
// the gate lets rows go).
//
// Without the bound (the stream counting rows but never waiting, as before)
// the session holds thousands of rows at once: a stream channel of 16
// batches of 128, 4 x --max-in-flight in the gate, 256 in flight.
func TestBufferedBytesBoundLargeTransaction(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	const budget = 256 << 10
	cases := []struct {
		name    string
		rows    int
		payload int // bytes of padding in each row's payload
		gated   bool
	}{
		{"ungated", 8000, 2000, false},
		{"standby-slot", 8000, 2000, true},
		{"rows larger than the budget", 6, 300 << 10, false},
		{"rows larger than the budget, standby-slot", 6, 300 << 10, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			h := newHarness(t, sharedSetup(t))
			h.opts.MaxBufferedBytes = budget
			standby := "standby_mem"
			if c.gated {
				h.exec(`SELECT pg_create_physical_replication_slot($1, true)`, standby)
				t.Cleanup(func() {
					_, _ = h.pool.Exec(context.Background(), `SELECT pg_drop_replication_slot($1)`, standby)
				})
				h.opts.StandbySlots = []string{standby}
			}
			h.start()
			start := time.Now()
			h.exec(`INSERT INTO outbox (work_id, kind, payload)
				SELECT 'big-' || i, 'thing_happened', jsonb_build_object('n', i, 'pad', repeat('x', $2::int))
				FROM generate_series(0, $1::int - 1) AS i`, c.rows, c.payload)
			var end string
			if err := h.pool.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&end); err != nil {
				t.Fatal(err)
			}
			peak := func() int64 {
				h.mu.Lock()
				defer h.mu.Unlock()
				return h.relay.BufferedPeak()
			}
			// The largest row's Size: the one row the stream may hold
			// beyond the budget, or the one that passes alone.
			row := int64(len(fmt.Sprintf(`{"n": %d, "pad": ""}`, c.rows)) + c.payload + len(fmt.Sprintf("big-%d", c.rows)) +
				len("thing_happened") + len("ready") + replication.RowOverhead)
			bound := max(int64(budget), row) + row
			if c.gated {
				// The standby is behind: nothing may be published, and
				// the rows waiting for it wait in the WAL, not here.
				testenv.WaitFor(t, 30*time.Second, "the relay read the transaction's first rows", func() (bool, error) {
					return peak() > 0, nil
				})
				h.gatedFor(time.Second, 0)
				if p := peak(); p > bound {
					t.Fatalf("held %d bytes of rows while the standby was behind, want at most %d (G15)", p, bound)
				}
				h.standbyKeepsUp(standby)
			}
			h.waitPublished(c.rows, 60*time.Second)
			took := time.Since(start)
			testenv.WaitFor(t, 30*time.Second, "the slot confirmed past the commit "+end, func() (bool, error) {
				var past bool
				err := h.pool.QueryRow(context.Background(), `SELECT confirmed_flush_lsn >= $2::pg_lsn FROM pg_replication_slots WHERE slot_name = $1`,
					h.opts.Slot, end).Scan(&past)
				return past, err
			})
			ids := make([]string, c.rows)
			for i := range ids {
				ids[i] = fmt.Sprintf("big-%d", i)
			}
			h.assertExactlyOnce(ids)
			p := peak()
			t.Logf("%d rows of %d bytes in one transaction: published in %v; held at most %d bytes of rows (budget %d, bound %d)",
				c.rows, row, took.Round(time.Millisecond), p, budget, bound)
			if p > bound {
				t.Fatalf("held %d bytes of rows at once, want at most %d: the budget %d plus one row of %d (G15)", p, bound, budget, row)
			}
			if p < row {
				t.Fatalf("held at most %d bytes, less than one row (%d): the budget does not count the rows", p, row)
			}
			h.mu.Lock()
			held := h.relay.BufferedHeld()
			h.mu.Unlock()
			if held != 0 {
				t.Fatalf("%d bytes still counted after every row was published and confirmed: a row's bytes were never given back", held)
			}
		})
	}
}
