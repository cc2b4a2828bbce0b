package relay

import (
	"sync"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/checkpoint"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Stream positions (G18, issue 41). A session replays the transactions
// from the slot's confirmed position on, and some of their messages are in
// the stream already. Where they are is a position, not a time: with each
// confirmation it records, the relay records a sequence of its stream that
// every message of a transaction committing at or past the confirmed
// position is stored after, and the next session reads back from there to
// the stream's last sequence. No clock is read: what the read covers is
// what was in flight (and what others stored meanwhile), never the recent
// traffic, and after a clean stop nothing of the relay's own.
//
// The sequence for a position is the least of:
//
//   - known: the highest sequence of the stream acknowledged to this
//     session for a new message (or the position the session read back
//     from, before any). The broker stored that message before any
//     message published after the acknowledgement arrived, so those are
//     stored past it, whatever the order of publishes, batches or
//     parked rows.
//   - the oldest open transaction's StreamAfter, known when it began: each
//     of its messages was published after that.
//   - low: below every message of an open transaction found stored by an
//     earlier session (the read-back) or answered as a duplicate of one
//     (a repeat the broker dropped). Those were stored before this
//     session, possibly before known; a next session must still find
//     them while their transactions are open.
//
// A lower sequence is always right (the read is longer); a higher one would
// miss a stored message and publish it again.

// positions is the loop's side: it belongs to the loop goroutine, except
// marks, which the stream's RecordBound reads.
type positions struct {
	on      bool // the session read the stream back and knows its identity
	stream  string
	created time.Time
	start   uint64 // where the session's read-back started: below everything it replays
	known   uint64
	low     uint64
	lowSet  bool
	// lowUntil is the commit position of the newest transaction low
	// stands for: low applies until the slot is confirmed past it.
	lowUntil replication.LSN
	marks    *posMarks
}

// begin sets t's StreamAfter: nothing of it is published yet.
func (p *positions) begin(t *checkpoint.Txn) { t.StreamAfter = p.known }

// acked notes a new message stored at seq in stream.
func (p *positions) acked(stream string, seq uint64) {
	if p.on && stream == p.stream && seq > p.known {
		p.known = seq
	}
}

// earlier notes that a message of t was stored at seq before this session
// published it (found by the read-back, or a duplicate's original).
func (p *positions) earlier(stream string, seq uint64, t *checkpoint.Txn) {
	if !p.on || stream != p.stream || seq == 0 {
		return
	}
	if !p.lowSet || seq-1 < p.low {
		p.low = seq - 1
	}
	p.lowSet = true
	if t != nil && t.CommitLSN > p.lowUntil {
		p.lowUntil = t.CommitLSN
	}
}

// after is the sequence for the position cp has confirmed.
func (p *positions) after(cp *checkpoint.Checkpoint) uint64 {
	s := p.known
	if t := cp.Oldest(); t != nil {
		s = min(s, t.StreamAfter)
	}
	if p.lowSet {
		if cp.Confirmed() > p.lowUntil {
			p.lowSet = false
		} else {
			s = min(s, p.low)
		}
	}
	return s
}

// confirmed records the sequence of a position the loop confirms, before
// the stream may record the position.
func (p *positions) confirmed(lsn replication.LSN, cp *checkpoint.Checkpoint) {
	if p.on && p.marks != nil {
		p.marks.push(lsn, p.after(cp))
	}
}

// posMarks are the positions the loop confirmed and their sequences, for
// the stream's RecordBound, which records a position some time after the
// loop confirmed it (and may record one between two of them, a keepalive:
// the sequence of the last confirmation at or before it holds there too).
type posMarks struct {
	mu      sync.Mutex
	floor   uint64 // for a position before every mark kept: the session's start
	set     bool   // the session records positions
	stream  string
	created time.Time
	lsns    []replication.LSN
	seqs    []uint64
}

// maxMarks bounds the marks kept: past it the oldest half goes, and a
// position before them all gets the floor, which is right, only longer to
// read.
const maxMarks = 4096

// start turns the recording on: the session's stream, and the sequence
// for positions before every mark.
func (m *posMarks) start(stream string, created time.Time, floor uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.stream, m.created, m.floor, m.set = stream, created, floor, true
}

// position is the stream position to record with lsn; false before the
// session knows its stream.
func (m *posMarks) position(lsn replication.LSN) (*store.StreamPos, bool) {
	m.mu.Lock()
	set, stream, created := m.set, m.stream, m.created
	m.mu.Unlock()
	if !set {
		return nil, false
	}
	return &store.StreamPos{Stream: stream, Created: created, Seq: m.at(lsn)}, true
}

func (m *posMarks) push(lsn replication.LSN, seq uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if n := len(m.lsns); n > 0 && m.lsns[n-1] == lsn {
		m.seqs[n-1] = min(m.seqs[n-1], seq)
		return
	}
	if len(m.lsns) >= maxMarks {
		half := len(m.lsns) / 2
		m.lsns = append(m.lsns[:0], m.lsns[half:]...)
		m.seqs = append(m.seqs[:0], m.seqs[half:]...)
	}
	m.lsns = append(m.lsns, lsn)
	m.seqs = append(m.seqs, seq)
}

// at returns the sequence for position lsn, and forgets the marks before
// the one it used: positions recorded later are not lower.
func (m *posMarks) at(lsn replication.LSN) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	i := -1
	for j, l := range m.lsns {
		if l > lsn {
			break
		}
		i = j
	}
	if i < 0 {
		return m.floor
	}
	seq := m.seqs[i]
	m.lsns = append(m.lsns[:0], m.lsns[i:]...)
	m.seqs = append(m.seqs[:0], m.seqs[i:]...)
	return seq
}
