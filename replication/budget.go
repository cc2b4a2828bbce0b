package replication

import "sync"

// Budget bounds, in bytes, the decoded rows a consumer of the stream holds
// (G15): the stream takes a row's Size from it before handing the row on
// and stops reading WAL while it has no room; the consumer gives the bytes
// back once it no longer holds the row's payload. Counting bytes, not
// events, is what bounds memory whatever the rows' sizes: 2,000 rows near
// the broker's 1 MB limit are 2 GB.
//
// A row larger than the whole budget still passes, alone (nothing else
// held): a budget smaller than one row must not wedge the stream.
type Budget struct {
	mu      sync.Mutex
	limit   int64
	held    int64
	peak    int64
	waiting bool
	room    chan struct{} // signalled on a release while the stream waits
	starved chan struct{} // signalled when the stream starts to wait
}

// NewBudget returns a budget of limit bytes; limit <= 0 means no limit.
func NewBudget(limit int64) *Budget {
	return &Budget{limit: limit, room: make(chan struct{}, 1), starved: make(chan struct{}, 1)}
}

// RowOverhead is what a decoded row costs beyond its strings and bytes
// (the Row and Event structs, the consumer's bookkeeping), roughly: it
// keeps many small rows from counting as nearly nothing.
const RowOverhead = 256

// Size is what r counts against a Budget.
func (r *Row) Size() int {
	if r == nil {
		return 0
	}
	n := len(r.WorkID) + len(r.Kind) + len(r.Subject) + len(r.State) + len(r.Payload) + len(r.Headers) + RowOverhead
	if r.Aggregate != nil {
		n += len(r.Aggregate.Type) + len(r.Aggregate.ID)
	}
	return n
}

// TryAcquire takes n bytes if they fit (or nothing is held) and reports
// whether it did. A failed try marks the budget as waited on until a later
// try succeeds (Waiting, Starved).
func (b *Budget) TryAcquire(n int) bool {
	if b == nil {
		return true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.limit > 0 && b.held > 0 && b.held+int64(n) > b.limit {
		if !b.waiting {
			b.waiting = true
			select {
			case b.starved <- struct{}{}:
			default:
			}
		}
		return false
	}
	b.waiting = false
	b.held += int64(n)
	b.peak = max(b.peak, b.held)
	return true
}

// Release gives back n bytes taken with TryAcquire.
func (b *Budget) Release(n int) {
	if b == nil || n == 0 {
		return
	}
	b.mu.Lock()
	b.held -= int64(n)
	if b.held < 0 {
		b.mu.Unlock()
		panic("replication: budget released more than was acquired")
	}
	w := b.waiting
	b.mu.Unlock()
	if w {
		select {
		case b.room <- struct{}{}:
		default:
		}
	}
}

// Room is signalled after a release while the stream waits: time to try
// again.
func (b *Budget) Room() <-chan struct{} { return b.room }

// Starved is signalled when the stream starts waiting for room. A consumer
// that holds rows back until more arrive (the standby gate waits for a
// transaction's Commit) must let them go instead: no more will come until
// it does.
func (b *Budget) Starved() <-chan struct{} {
	if b == nil {
		return nil
	}
	return b.starved
}

// Waiting reports whether the stream waits for room now.
func (b *Budget) Waiting() bool {
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.waiting
}

// Held is the bytes taken and not given back.
func (b *Budget) Held() int64 {
	if b == nil {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.held
}

// Peak is the most bytes held at once.
func (b *Budget) Peak() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.peak
}

// Limit is the budget's size in bytes; 0: no limit.
func (b *Budget) Limit() int64 { return b.limit }
