// Package repeats summarises the broker's duplicate acknowledgements in the
// log. A restart after a crash can replay tens of thousands of rows the
// stream already holds; one warning each (71,536 lines after one crash) buried
// everything else. The first repeat is logged at once, with its work ID; the
// ones after it are counted and logged as one line per period, with a few of
// their work IDs. outbox_relay_duplicate_acks_total counts every one.
package repeats

import (
	"sync"
	"time"

	"github.com/rs/zerolog"
)

// DefaultEvery is how often repeats are summarised at most.
const DefaultEvery = 10 * time.Second

// examples is how many work IDs a summary names.
const examples = 5

// Log summarises repeats; safe for concurrent use. The zero value is not
// usable: use New.
type Log struct {
	log   zerolog.Logger
	msg   string
	every time.Duration
	now   func() time.Time

	mu     sync.Mutex
	n      int64 // repeats not logged yet
	ids    []string
	last   time.Time // when a line was last written
	since  time.Time // the oldest repeat not logged yet
	logged bool
}

// New logs repeats with msg at warn level, at most one line every every
// (DefaultEvery when 0).
func New(log zerolog.Logger, msg string, every time.Duration) *Log {
	if every <= 0 {
		every = DefaultEvery
	}
	return &Log{log: log, msg: msg, every: every, now: time.Now}
}

// Add counts one repeat: the first is logged at once, the rest summarised.
func (l *Log) Add(workID, stream string, seq uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if !l.logged {
		l.logged, l.last = true, now
		l.log.Warn().Str("work_id", workID).Str("stream", stream).Uint64("stream_seq", seq).Msg(l.msg)
		return
	}
	if l.n == 0 {
		l.since = now
	}
	l.n++
	if len(l.ids) < examples {
		l.ids = append(l.ids, workID)
	}
	if now.Sub(l.last) >= l.every {
		l.flush(now)
	}
}

// Flush logs the repeats counted and not logged yet.
func (l *Log) Flush() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.flush(l.now())
}

func (l *Log) flush(now time.Time) {
	if l.n == 0 {
		return
	}
	l.log.Warn().Int64("repeats", l.n).Strs("work_ids", l.ids).Time("since", l.since).Msg(l.msg + " (summary: this many more since the last line, a few of their work IDs)")
	l.n, l.ids, l.last = 0, l.ids[:0], now
}
