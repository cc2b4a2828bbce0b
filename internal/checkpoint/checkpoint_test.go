package checkpoint

import (
	"math/rand"
	"testing"

	"github.com/jackc/pglogrepl"
)

func TestAdvanceWaitsForContiguousPrefix(t *testing.T) {
	c := New(100)
	a := c.Begin(1, 200)
	c.Add(a)
	c.Add(a)
	c.Commit(a, 210)
	b := c.Begin(2, 300)
	c.Add(b)
	c.Commit(b, 310)

	// b's only row settles first: a still holds the checkpoint.
	c.Settle(b)
	if got, moved := c.Advance(); moved || got != 100 {
		t.Fatalf("after settling b: got %v moved=%v, want 0/64 unmoved", got, moved)
	}
	c.Settle(a)
	if got, moved := c.Advance(); moved || got != 100 {
		t.Fatalf("after one of a's two rows: got %v moved=%v, want unmoved", got, moved)
	}
	c.Settle(a)
	if got, moved := c.Advance(); !moved || got != 310 {
		t.Fatalf("after all rows: got %v moved=%v, want %v", got, moved, pglogrepl.LSN(310))
	}
	if c.Open() != 0 {
		t.Fatalf("open = %d, want 0", c.Open())
	}
}

func TestZeroRowTransactionPassesOnCommit(t *testing.T) {
	c := New(0)
	a := c.Begin(1, 10)
	if _, moved := c.Advance(); moved {
		t.Fatal("an uncommitted transaction must hold the checkpoint")
	}
	c.Commit(a, 20)
	if got, moved := c.Advance(); !moved || got != 20 {
		t.Fatalf("got %v moved=%v, want 20", got, moved)
	}
}

func TestUncommittedTransactionHoldsEvenWhenSettled(t *testing.T) {
	c := New(0)
	a := c.Begin(1, 10)
	c.Add(a)
	c.Settle(a) // rows flow before COMMIT arrives
	if _, moved := c.Advance(); moved {
		t.Fatal("moved past a transaction whose COMMIT has not arrived")
	}
	c.Commit(a, 15)
	if got, _ := c.Advance(); got != 15 {
		t.Fatalf("got %v, want 15", got)
	}
}

func TestNeverMovesBackwards(t *testing.T) {
	c := New(500)
	a := c.Begin(1, 100) // a replayed transaction below the slot's position
	c.Commit(a, 110)
	if got, moved := c.Advance(); moved || got != 500 {
		t.Fatalf("got %v moved=%v, want 500 unmoved", got, moved)
	}
}

// Random out-of-order settles: the confirmed position is always the end of a
// transaction all of whose predecessors and itself are fully settled.
func TestRandomOrder(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	for round := 0; round < 200; round++ {
		c := New(0)
		type row struct{ txn int }
		var txns []*Txn
		var rows []row
		settled := map[int]int{}
		sizes := map[int]int{}
		for i := 0; i < 1+rng.Intn(30); i++ {
			tx := c.Begin(uint32(i), pglogrepl.LSN(i*100+1))
			n := rng.Intn(5) // zero-row transactions included
			for j := 0; j < n; j++ {
				c.Add(tx)
				rows = append(rows, row{i})
			}
			sizes[i] = n
			c.Commit(tx, pglogrepl.LSN(i*100+50))
			txns = append(txns, tx)
		}
		rng.Shuffle(len(rows), func(i, j int) { rows[i], rows[j] = rows[j], rows[i] })
		for _, r := range rows {
			c.Settle(txns[r.txn])
			settled[r.txn]++
			got, _ := c.Advance()
			// Expected: end of the last txn of the fully settled prefix.
			var want pglogrepl.LSN
			for i := range txns {
				if settled[i] < sizes[i] {
					break
				}
				want = pglogrepl.LSN(i*100 + 50)
			}
			if got != want {
				t.Fatalf("round %d: confirmed %v, want %v", round, got, want)
			}
		}
		c.Advance() // trailing zero-row transactions
		if c.Open() != 0 {
			t.Fatalf("round %d: %d transactions left open", round, c.Open())
		}
	}
}

func TestCompaction(t *testing.T) {
	c := New(0)
	for i := 0; i < 10000; i++ {
		tx := c.Begin(uint32(i), pglogrepl.LSN(i*10+1))
		c.Commit(tx, pglogrepl.LSN(i*10+5))
		c.Advance()
	}
	if c.Open() != 0 || len(c.txns) > 2048 {
		t.Fatalf("open=%d len=%d: dead transactions not released", c.Open(), len(c.txns))
	}
	if c.Confirmed() != pglogrepl.LSN(9999*10+5) {
		t.Fatalf("confirmed %v", c.Confirmed())
	}
}

func BenchmarkCheckpoint(b *testing.B) {
	b.ReportAllocs()
	c := New(0)
	for i := 0; i < b.N; i++ {
		tx := c.Begin(uint32(i), pglogrepl.LSN(i*10+1))
		c.Add(tx)
		c.Commit(tx, pglogrepl.LSN(i*10+5))
		c.Settle(tx)
		c.Advance()
	}
}
