package store

import (
	"fmt"
	"slices"
	"strconv"
	"strings"
)

// Snapshot is a parsed pg_snapshot ("xmin:xmax:xip,..."). The relay uses it
// to tell a committed transaction that other sessions cannot see yet from one
// whose rows are visible: PostgreSQL flushes a commit record, so logical
// decoding streams the transaction, before the backend leaves the proc array
// (with a synchronous standby it stays invisible as long as the commit waits).
// An UPDATE that runs in that gap matches zero rows; only a snapshot taken by
// the same statement says whether zero means "not visible yet" or "already
// settled".
type Snapshot struct {
	xmin, xmax uint64
	xip        map[uint64]struct{}
}

// ParseSnapshot parses pg_current_snapshot()::text.
func ParseSnapshot(s string) (Snapshot, error) {
	parts := strings.SplitN(s, ":", 3)
	if len(parts) != 3 {
		return Snapshot{}, fmt.Errorf("parse snapshot %q: want xmin:xmax:xip", s)
	}
	xmin, err1 := strconv.ParseUint(parts[0], 10, 64)
	xmax, err2 := strconv.ParseUint(parts[1], 10, 64)
	if err1 != nil || err2 != nil {
		return Snapshot{}, fmt.Errorf("parse snapshot %q: bad xmin or xmax", s)
	}
	snap := Snapshot{xmin: xmin, xmax: xmax}
	if parts[2] != "" {
		snap.xip = make(map[uint64]struct{})
		for _, x := range strings.Split(parts[2], ",") {
			v, err := strconv.ParseUint(x, 10, 64)
			if err != nil {
				return Snapshot{}, fmt.Errorf("parse snapshot %q: bad xip %q", s, x)
			}
			snap.xip[v] = struct{}{}
		}
	}
	return snap, nil
}

// Visible reports whether the transaction with 32-bit id xid (as pgoutput's
// BEGIN carries it), known to have committed, had ended when the snapshot was
// taken, so its rows are visible to that snapshot's statement.
func (s Snapshot) Visible(xid uint32) bool {
	// pgoutput sends the 32-bit xid; place it in the epoch that puts it
	// nearest to xmax. The transaction is recent, so it is within 2^31.
	full := int64(s.xmax) + int64(int32(xid-uint32(s.xmax)))
	if full < 0 {
		return true
	}
	f := uint64(full)
	if f < s.xmin {
		return true
	}
	if f >= s.xmax {
		return false
	}
	_, running := s.xip[f]
	return !running
}

// Finished reports whether the transaction with full (64-bit) id xid had
// ended when the snapshot was taken, as pg_visible_in_snapshot reads it: for
// a committed transaction, whether a watermark with this snapshot covers
// its rows (G17).
func (s Snapshot) Finished(xid uint64) bool {
	if xid < s.xmin {
		return true
	}
	if xid >= s.xmax {
		return false
	}
	_, running := s.xip[xid]
	return !running
}

// FirstRunning is the lowest id in [lo, hi] that had not ended when the
// snapshot was taken; ok is false when every one in the range had.
func (s Snapshot) FirstRunning(lo, hi uint64) (xid uint64, ok bool) {
	if lo > hi {
		return 0, false
	}
	first := uint64(0)
	for x := range s.xip {
		if x >= lo && x <= hi && (!ok || x < first) {
			first, ok = x, true
		}
	}
	if top := max(lo, s.xmax); top <= hi && (!ok || top < first) {
		first, ok = top, true
	}
	return first, ok
}

// String renders s as pg_snapshot's text, which pg_snapshot's input takes
// back: xmin:xmax:xip, the ids in ascending order.
func (s Snapshot) String() string {
	xip := make([]uint64, 0, len(s.xip))
	for x := range s.xip {
		xip = append(xip, x)
	}
	slices.Sort(xip)
	var b strings.Builder
	b.WriteString(strconv.FormatUint(s.xmin, 10))
	b.WriteByte(':')
	b.WriteString(strconv.FormatUint(s.xmax, 10))
	b.WriteByte(':')
	for i, x := range xip {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatUint(x, 10))
	}
	return b.String()
}

// WithFinished is s with the transactions ids read as finished as well,
// every other id as s reads it: an id s lists as running leaves the list;
// an id at or above xmax raises xmax past it, and the ids between the old
// xmax and the new one that are not in ids are listed as running. An id
// more than grow above xmax is left out (not finished), so that the list
// stays short; skipped counts those.
//
// The watermark of a clean stop (internal/relay, watermark.go) uses it for
// the transactions the relay streamed and settled before the stop's
// position that the stop's snapshot did not see as finished yet.
func (s Snapshot) WithFinished(ids []uint64, grow uint64) (out Snapshot, skipped int) {
	done := make(map[uint64]struct{}, len(ids))
	xmax := s.xmax
	for _, x := range ids {
		if x >= s.xmax && x-s.xmax >= grow {
			skipped++
			continue
		}
		done[x] = struct{}{}
		xmax = max(xmax, x+1)
	}
	out = Snapshot{xmin: s.xmin, xmax: xmax, xip: make(map[uint64]struct{}, len(s.xip))}
	for x := range s.xip {
		if _, ok := done[x]; !ok {
			out.xip[x] = struct{}{}
		}
	}
	for x := s.xmax; x < xmax; x++ {
		if _, ok := done[x]; !ok {
			out.xip[x] = struct{}{}
		}
	}
	return out, skipped
}
