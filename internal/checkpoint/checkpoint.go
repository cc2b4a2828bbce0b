// Package checkpoint tracks which position the replication slot may be
// confirmed to: the end LSN of the longest prefix of transactions, in commit
// order, whose rows are all settled (acked by the broker and their new state
// committed, or handed to the poller). Acks arrive in any order; the
// checkpoint only ever moves forward over a contiguous settled prefix, which
// is what makes confirming it safe (G3).
package checkpoint

import (
	"time"

	"github.com/jackc/pglogrepl"
)

// Txn is one transaction between its BEGIN and the moment the checkpoint
// passes it.
type Txn struct {
	Xid        uint32
	CommitLSN  pglogrepl.LSN
	CommitTime time.Time // for lag in seconds; the checkpoint itself only uses LSNs
	// StreamAfter is a sequence of the relay's stream every message of
	// this transaction is stored after (set by the relay at its Begin; the
	// checkpoint does not read it).
	StreamAfter uint64
	endLSN      pglogrepl.LSN
	pending     int
	committed   bool
}

// Pending is the number of rows not yet settled.
func (t *Txn) Pending() int { return t.pending }

// Checkpoint is not safe for concurrent use: it belongs to the relay loop.
type Checkpoint struct {
	txns      []*Txn // commit order; txns[head:] are live
	head      int
	confirmed pglogrepl.LSN
}

// New starts from the slot's confirmed position.
func New(confirmed pglogrepl.LSN) *Checkpoint {
	return &Checkpoint{confirmed: confirmed}
}

// Begin opens a transaction. Transactions must begin in commit order, which
// is the order pgoutput sends them in.
func (c *Checkpoint) Begin(xid uint32, commitLSN pglogrepl.LSN) *Txn {
	t := &Txn{Xid: xid, CommitLSN: commitLSN}
	c.txns = append(c.txns, t)
	return t
}

// Add counts one more row of t that must settle before t can be confirmed.
func (c *Checkpoint) Add(t *Txn) { t.pending++ }

// Settle records that one row of t is done.
func (c *Checkpoint) Settle(t *Txn) {
	if t.pending <= 0 {
		panic("checkpoint: settle on a transaction with no pending rows")
	}
	t.pending--
}

// Commit closes t at endLSN, the end of its commit record. A transaction can
// only be passed once it is committed, so rows that are still arriving keep
// the checkpoint behind it.
func (c *Checkpoint) Commit(t *Txn, endLSN pglogrepl.LSN) {
	t.committed = true
	t.endLSN = endLSN
}

// Advance moves past every leading transaction that is committed with no
// pending rows and reports the new confirmable position, and whether it moved.
func (c *Checkpoint) Advance() (pglogrepl.LSN, bool) {
	moved := false
	for c.head < len(c.txns) {
		t := c.txns[c.head]
		if !t.committed || t.pending > 0 {
			break
		}
		c.txns[c.head] = nil
		c.head++
		if t.endLSN > c.confirmed {
			c.confirmed = t.endLSN
			moved = true
		}
	}
	// Compact once the dead prefix dominates, so memory follows the window
	// of open transactions rather than the session's history.
	if c.head > 1024 && c.head*2 > len(c.txns) {
		n := copy(c.txns, c.txns[c.head:])
		clear(c.txns[n:])
		c.txns = c.txns[:n]
		c.head = 0
	}
	return c.confirmed, moved
}

// Confirmed is the position the slot may be confirmed to.
func (c *Checkpoint) Confirmed() pglogrepl.LSN { return c.confirmed }

// Oldest is the first transaction not yet passed, nil when there is none:
// how far behind the slot is, in commit time.
func (c *Checkpoint) Oldest() *Txn {
	if c.head < len(c.txns) {
		return c.txns[c.head]
	}
	return nil
}

// Open is the number of transactions not yet passed.
func (c *Checkpoint) Open() int { return len(c.txns) - c.head }
