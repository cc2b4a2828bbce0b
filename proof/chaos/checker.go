package chaos

import (
	"fmt"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pglogrepl"
)

// Work ids carry who wrote them and whether the transaction was meant to
// commit, so that a message in the stream can be judged without a lookup:
// a rolled-back row in the stream is a phantom whatever else is known.
const (
	CommitPrefix   = "w-"
	RollbackPrefix = "rb-"
)

// WitnessRow is one committed outbox INSERT as the independent test_decoding
// slot saw it: the row and the end LSN of its transaction.
type WitnessRow struct {
	ID  string
	End pglogrepl.LSN
}

var insertLine = regexp.MustCompile(`^table [^ ]+\.outbox: INSERT: work_id\[text\]:'([^']*)'`)

// WitnessParser turns test_decoding output (with include-xids) into
// committed rows. Changes of a transaction are held until its COMMIT line,
// whose LSN is the transaction's end; a transaction that never commits never
// shows up in test_decoding at all.
type WitnessParser struct {
	pending map[uint32][]string
}

// Feed takes one row of pg_logical_slot_get_changes(lsn, xid, data) and
// returns the rows of a transaction when data is its COMMIT.
func (w *WitnessParser) Feed(lsn pglogrepl.LSN, xid uint32, data string) []WitnessRow {
	if w.pending == nil {
		w.pending = map[uint32][]string{}
	}
	if m := insertLine.FindStringSubmatch(data); m != nil {
		w.pending[xid] = append(w.pending[xid], m[1])
		return nil
	}
	if !strings.HasPrefix(data, "COMMIT") {
		return nil
	}
	ids := w.pending[xid]
	delete(w.pending, xid)
	rows := make([]WitnessRow, len(ids))
	for i, id := range ids {
		rows[i] = WitnessRow{ID: id, End: lsn}
	}
	return rows
}

type streamEntry struct {
	firstSeq uint64
	count    int
}

// Ledger is the checker's memory: every committed row in commit order (from
// the witness), every message in the stream (by Nats-Msg-Id), and how far G3
// has been verified. Its methods are safe for concurrent use.
type Ledger struct {
	mu        sync.Mutex
	rows      []WitnessRow // ascending End
	known     map[string]bool
	stream    map[string]*streamEntry
	streamMsg int
	lastSeq   uint64   // highest stream sequence added
	bySeq     []seqMsg // every message added, in ascending sequence, for LoseTail

	g3Pos        int          // rows[:g3Pos] were covered by an earlier check and verified
	late         []WitnessRow // rows that arrived inside rows[:g3Pos], not verified yet
	g3Checks     int
	g3Violations []string
	handoffs     int

	// takenBack are rows a former primary committed (the witness saw them
	// or a producer's commit returned) that the promoted standby does not
	// hold; promotions counts Promote calls.
	takenBack  map[string]bool
	promotions int

	// expired are the rows the table ended 'expired' (G13): never to be
	// published, so not lost when they are not in the stream.
	expired map[string]bool
	clock   Clocks
	windows []FaultWindow
}

// Clocks is what the run measured of the clocks it judges deadlines and
// fault windows with: the database's and the broker's, each against this
// process's, and how far each reading may be off (half its round trip).
type Clocks struct {
	DBMinusHost     time.Duration `json:"db_minus_host"`
	BrokerMinusHost time.Duration `json:"broker_minus_host"`
	Uncertainty     time.Duration `json:"uncertainty"`
}

// DBMinusBroker is how far the database's clock is ahead of the broker's:
// a deadline (database clock) minus it is the same moment on the broker's
// clock, which dates the stored messages.
func (c Clocks) DBMinusBroker() time.Duration { return c.DBMinusHost - c.BrokerMinusHost }

// FaultWindow is one injected fault, from its start to the next one's (the
// last to the end of the run): the figures a message or a commit in it adds
// are counted for its kind. Effects can outlast a window (a copy stored
// twice after the next fault began); the attribution is a pointer to the
// logs, not a proof of cause.
type FaultWindow struct {
	N        int           `json:"n"`
	Kind     string        `json:"kind"`
	Start    time.Time     `json:"start"`     // this process's clock
	StartLSN pglogrepl.LSN `json:"start_lsn"` // the server's WAL position at the start
}

// BeforeFaults is the window before the first fault, in FaultFigures.
const BeforeFaults = "(before the first fault)"

// KindFigures are the must-be-zero figures counted in the windows of one
// fault kind.
type KindFigures struct {
	Windows      int `json:"windows"`
	Lost         int `json:"lost"`
	Phantoms     int `json:"phantoms"`
	Duplicates   int `json:"stored_duplicates"`
	PastDeadline int `json:"published_past_deadline"`
}

// NewLedger returns an empty ledger.
func NewLedger() *Ledger {
	return &Ledger{known: map[string]bool{}, stream: map[string]*streamEntry{}, takenBack: map[string]bool{}, expired: map[string]bool{}}
}

// SetClocks records the clocks' measured offsets, with which a message's
// stored time is compared with its deadline and its fault window.
func (l *Ledger) SetClocks(c Clocks) {
	l.mu.Lock()
	l.clock = c
	l.mu.Unlock()
}

// SetExpired records the rows the table ended 'expired'.
func (l *Ledger) SetExpired(ids []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		l.expired[id] = true
	}
}

// SetWindows records the faults' windows, in the order injected.
func (l *Ledger) SetWindows(w []FaultWindow) {
	l.mu.Lock()
	l.windows = append([]FaultWindow(nil), w...)
	l.mu.Unlock()
}

// AddWitness records committed rows. A row seen before is skipped: after a
// crash of PostgreSQL the witness slot may decode again what it had already
// returned, since a SQL-consumed slot's position is saved at checkpoints.
func (l *Ledger) AddWitness(rows []WitnessRow) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range rows {
		if l.known[r.ID] {
			continue
		}
		l.known[r.ID] = true
		l.insert(r)
	}
}

func (l *Ledger) insert(r WitnessRow) {
	n := len(l.rows)
	if n == 0 || l.rows[n-1].End <= r.End {
		l.rows = append(l.rows, r)
		return
	}
	// Out of order only if decoding restarted mid-way; keep the slice
	// sorted because the G3 check walks it as a prefix.
	i := sort.Search(n, func(i int) bool { return l.rows[i].End > r.End })
	l.rows = append(l.rows, WitnessRow{})
	copy(l.rows[i+1:], l.rows[i:])
	l.rows[i] = r
	if i < l.g3Pos {
		// Inside the verified prefix no prefix walk would reach it:
		// the next check verifies it on its own.
		l.g3Pos++
		l.late = append(l.late, r)
	}
}

// Promote replaces the committed history with a promoted standby's. held
// are the work ids in the new primary's table as of its new witness's
// consistent point at (read in the snapshot that witness exported), so
// every row committed on the new timeline before at is among them and
// every later one reaches the witness. acked are the ids producers saw
// commit so far. Rows known before that the new primary does not hold were
// taken back by the promotion and leave the history (they are not lost:
// the new primary never had them); held rows the old witness never read
// join it with at as their end LSN, an upper bound of the real one, which
// keeps the G3 check sound: it only ever checks them later than it could.
// It returns how many rows were taken back and how many joined.
func (l *Ledger) Promote(held map[string]bool, at pglogrepl.LSN, acked []string) (takenBack, joined int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.promotions++
	kept := l.rows[:0]
	pos := 0
	for i, r := range l.rows {
		if !held[r.ID] {
			// Not known any more: the history it was known in is gone.
			delete(l.known, r.ID)
			l.takenBack[r.ID] = true
			takenBack++
			continue
		}
		if i < l.g3Pos {
			pos++
		}
		kept = append(kept, r)
	}
	clear(l.rows[len(kept):])
	l.rows, l.g3Pos = kept, pos
	late := l.late[:0]
	for _, r := range l.late {
		if held[r.ID] {
			late = append(late, r)
		}
	}
	l.late = late
	for _, id := range acked {
		// An id the new primary holds, or one it commits after at (which
		// the witness reports later), is not taken back: Figures decides
		// at the end, when known is complete.
		if !held[id] && !l.known[id] && !l.takenBack[id] {
			l.takenBack[id] = true
			takenBack++
		}
	}
	ids := make([]string, 0, len(held))
	for id := range held {
		if !l.known[id] {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		l.known[id] = true
		l.insert(WitnessRow{ID: id, End: at})
		joined++
	}
	return takenBack, joined
}

// Msg is one stored message as the checker reads it.
type Msg struct {
	ID  string
	Seq uint64
	// From is what the message says of where it came from (its time,
	// commit LSN, claim generation): a row stored twice is reported with
	// each copy's, so that the copies can be matched with the relays' logs.
	From string
	// Stored is the broker's timestamp of the message (zero: unknown),
	// ExpiresAt its Outbox-Expires-At (zero: no deadline).
	Stored    time.Time
	ExpiresAt time.Time
}

type seqMsg = Msg

// AddMsg records one stored message. Messages come in ascending sequence
// (the stream is read in order).
func (l *Ledger) AddMsg(id string, seq uint64) { l.Add(Msg{ID: id, Seq: seq}) }

// AddMsgFrom is AddMsg with where the message came from (Msg.From).
func (l *Ledger) AddMsgFrom(id string, seq uint64, from string) {
	l.Add(Msg{ID: id, Seq: seq, From: from})
}

// Add records one stored message.
func (l *Ledger) Add(m Msg) {
	l.mu.Lock()
	defer l.mu.Unlock()
	id, seq := m.ID, m.Seq
	l.streamMsg++
	l.lastSeq = max(l.lastSeq, seq)
	l.bySeq = append(l.bySeq, m)
	e := l.stream[id]
	if e == nil {
		l.stream[id] = &streamEntry{firstSeq: seq, count: 1}
		return
	}
	e.count++
	e.firstSeq = min(e.firstSeq, seq)
}

// LoseTail forgets every message above seq: the broker lost them
// (nats-lose-tail) and hands their sequences out again to new messages,
// which the next read of the stream records. It returns the ids of the
// forgotten messages that are no longer stored at all, the rows that must
// be published again for nothing to be lost.
func (l *Ledger) LoseTail(seq uint64) (gone []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	i := sort.Search(len(l.bySeq), func(i int) bool { return l.bySeq[i].Seq > seq })
	for _, m := range l.bySeq[i:] {
		l.streamMsg--
		e := l.stream[m.ID]
		if e == nil {
			continue
		}
		if e.count--; e.count == 0 {
			delete(l.stream, m.ID)
			gone = append(gone, m.ID)
			continue
		}
		if e.firstSeq == m.Seq {
			// A repeat survives below the cut: its sequence is the first.
			e.firstSeq = 0
			for _, o := range l.bySeq[:i] {
				if o.ID == m.ID {
					e.firstSeq = o.Seq
					break
				}
			}
		}
	}
	clear(l.bySeq[i:])
	l.bySeq = l.bySeq[:i]
	l.lastSeq = min(l.lastSeq, seq)
	return gone
}

// StoredAt is the broker's timestamp of the first stored copy of id
// (false: not stored, or stored without a known time).
func (l *Ledger) StoredAt(id string) (time.Time, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := l.stream[id]
	if e == nil {
		return time.Time{}, false
	}
	i := sort.Search(len(l.bySeq), func(i int) bool { return l.bySeq[i].Seq >= e.firstSeq })
	if i == len(l.bySeq) || l.bySeq[i].Seq != e.firstSeq || l.bySeq[i].Stored.IsZero() {
		return time.Time{}, false
	}
	return l.bySeq[i].Stored, true
}

// Stored reports whether a message with id is in the stream as recorded.
func (l *Ledger) Stored(id string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.stream[id] != nil
}

// LastSeq is the highest stream sequence recorded.
func (l *Ledger) LastSeq() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lastSeq
}

// CheckG3 verifies one observation of the relay's slot: confirmed was read
// first, then the states of the rows not published (unsettled: work_id ->
// state) and the stream's last sequence, and the witness and the ledger's
// stream were read up to at least those points. Every committed row whose
// transaction ended at or before confirmed must then be settled: in the
// stream at or below lastSeq and marked published, or handed to the poller
// (scheduled, running, failed), which G7 allows for rows the broker refused.
// It returns how many rows this check newly covered and the violations.
func (l *Ledger) CheckG3(label string, confirmed pglogrepl.LSN, lastSeq uint64, unsettled map[string]string) (covered int, violations []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.g3Checks++
	check := func(r WitnessRow) {
		covered++
		state, unsettledRow := unsettled[r.ID]
		e := l.stream[r.ID]
		inStream := e != nil && e.firstSeq <= lastSeq
		switch {
		case unsettledRow && state == "ready":
			violations = append(violations, fmt.Sprintf("%s: %s (txn end %s) covered by confirmed_flush_lsn %s but still 'ready'", label, r.ID, r.End, confirmed))
		case unsettledRow:
			l.handoffs++
		case !inStream:
			violations = append(violations, fmt.Sprintf("%s: %s (txn end %s) covered by confirmed_flush_lsn %s but not in the stream at or below seq %d", label, r.ID, r.End, confirmed, lastSeq))
		}
	}
	var later []WitnessRow
	for _, r := range l.late {
		if r.End <= confirmed {
			check(r)
		} else {
			later = append(later, r)
		}
	}
	l.late = later
	i := l.g3Pos
	for ; i < len(l.rows) && l.rows[i].End <= confirmed; i++ {
		check(l.rows[i])
	}
	l.g3Pos = i
	l.g3Violations = append(l.g3Violations, violations...)
	return covered, violations
}

// CheckCovered verifies the watermark of --on-publish none (G17): ids are
// the rows the table counted as published (marked, or 'ready' and covered
// by the recorded watermark), read before the stream's last sequence
// lastSeq; each must be in the stream at or below it. Violations count
// with G3's: both say the table claims a publication the stream lacks.
func (l *Ledger) CheckCovered(label string, ids []string, lastSeq uint64) (violations []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, id := range ids {
		if e := l.stream[id]; e == nil || e.firstSeq > lastSeq {
			violations = append(violations, fmt.Sprintf("%s: %s counted as published by the watermark but not in the stream at or below seq %d", label, id, lastSeq))
		}
	}
	l.g3Violations = append(l.g3Violations, violations...)
	return violations
}

// Figures are the end-of-run counts from the ledger.
type Figures struct {
	CommittedRows     int `json:"committed_rows"`
	StreamMsgs        int `json:"stream_msgs"`
	StreamDistinct    int `json:"stream_distinct_ids"`
	Lost              int `json:"lost"`
	Phantoms          int `json:"phantoms"`
	StoredDuplicates  int `json:"stored_duplicates"`
	UnknownMsgs       int `json:"unknown_msgs"`
	WitnessGaps       int `json:"witness_gaps"`
	G3Checks          int `json:"g3_checks"`
	G3Violations      int `json:"g3_violations"`
	G3PollerHandoffs  int `json:"g3_poller_handoffs"`
	Promotions        int `json:"promotions,omitempty"`
	TakenBack         int `json:"taken_back_by_promotion,omitempty"`
	TakenBackInStream int `json:"published_but_taken_back"`
	// PastDeadline counts the stored messages whose broker timestamp is
	// later than their row's deadline (Outbox-Expires-At, a database-clock
	// time) moved to the broker's clock by the measured difference, past
	// the measurement's uncertainty (G13).
	PastDeadline int `json:"published_past_deadline"`
	// PastDeadlineAfterPause counts those stored in a relay-paused window:
	// written by the relay before it was stopped, read by the broker after.
	PastDeadlineAfterPause int `json:"published_past_deadline_after_pause,omitempty"`
	DeadlineMsgs           int `json:"deadline_msgs"`      // stored messages with a deadline
	Expired                int `json:"expired"`            // rows that ended 'expired' and were never stored
	ExpiredButStored       int `json:"expired_but_stored"` // ended 'expired' with a copy stored before the deadline (an ack that never came)
	// MaxPastDeadline is the latest a message was stored after its
	// deadline, and MinDeadlineLeft the least time any message had left.
	MaxPastDeadline    time.Duration `json:"max_past_deadline,omitempty"`
	MinDeadlineLeft    time.Duration `json:"min_deadline_left,omitempty"`
	LostSample         []string      `json:"lost_sample,omitempty"`
	PhantomSample      []string      `json:"phantom_sample,omitempty"`
	DuplicateSample    []string      `json:"duplicate_sample,omitempty"`
	G3ViolationSample  []string      `json:"g3_violation_sample,omitempty"`
	WitnessGapSample   []string      `json:"witness_gap_sample,omitempty"`
	UnknownMsgSample   []string      `json:"unknown_msg_sample,omitempty"`
	TakenBackSample    []string      `json:"published_taken_back_sample,omitempty"`
	PastDeadlineSample []string      `json:"past_deadline_sample,omitempty"`
	// ByFault counts lost rows (by their transaction's end LSN), phantoms,
	// second copies and messages past their deadline (by stored time) in
	// the windows of each fault kind (FaultWindow).
	ByFault map[string]*KindFigures `json:"by_fault,omitempty"`
}

const sampleSize = 20

func addSample(s *[]string, v string) {
	if len(*s) < sampleSize {
		*s = append(*s, v)
	}
}

// windowAt is the kind of the fault window in effect at t (this process's
// clock) or, with byLSN, at the WAL position lsn.
func (l *Ledger) windowAt(t time.Time, lsn pglogrepl.LSN, byLSN bool) string {
	kind := BeforeFaults
	for _, w := range l.windows {
		if byLSN && w.StartLSN > lsn || !byLSN && w.Start.After(t) {
			break
		}
		kind = w.Kind
	}
	return kind
}

// Figures compares the committed rows with the stream. acked are the work
// ids whose commit the producers saw succeed: each must be in the witness,
// or the witness (and so every other figure) is incomplete.
func (l *Ledger) Figures(acked []string) Figures {
	l.mu.Lock()
	defer l.mu.Unlock()
	f := Figures{
		CommittedRows:    len(l.rows),
		StreamMsgs:       l.streamMsg,
		StreamDistinct:   len(l.stream),
		G3Checks:         l.g3Checks,
		G3Violations:     len(l.g3Violations),
		G3PollerHandoffs: l.handoffs,
		Promotions:       l.promotions,
	}
	by := func(kind string) *KindFigures {
		if f.ByFault == nil {
			f.ByFault = map[string]*KindFigures{}
		}
		k := f.ByFault[kind]
		if k == nil {
			k = &KindFigures{}
			f.ByFault[kind] = k
		}
		return k
	}
	for _, w := range l.windows {
		by(w.Kind).Windows++
	}
	// A message's window is found on this process's clock.
	hostTime := func(stored time.Time) time.Time { return stored.Add(-l.clock.BrokerMinusHost) }
	// A row a producer saw commit on a former primary can turn up on the
	// new one after all (its WAL reached the standby after the acked ids
	// were read): then it was not taken back.
	takenBack := func(id string) bool { return l.takenBack[id] && !l.known[id] }
	for id := range l.takenBack {
		if takenBack(id) {
			f.TakenBack++
		}
	}
	for _, v := range l.g3Violations {
		addSample(&f.G3ViolationSample, v)
	}
	for _, id := range acked {
		if !l.known[id] && !takenBack(id) {
			f.WitnessGaps++
			addSample(&f.WitnessGapSample, id)
		}
	}
	for _, r := range l.rows {
		switch {
		case l.stream[r.ID] != nil && l.expired[r.ID]:
			f.ExpiredButStored++
		case l.stream[r.ID] != nil:
		case l.expired[r.ID]:
			f.Expired++
		default:
			f.Lost++
			if len(l.windows) > 0 {
				by(l.windowAt(time.Time{}, r.End, true)).Lost++
			}
			addSample(&f.LostSample, fmt.Sprintf("%s (txn end %s)", r.ID, r.End))
		}
	}
	ids := make([]string, 0, len(l.stream))
	for id := range l.stream {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	copies := map[string][]string{}
	seen := map[string]bool{}
	for _, m := range l.bySeq {
		e := l.stream[m.ID]
		if e == nil {
			continue
		}
		first := !seen[m.ID]
		seen[m.ID] = true
		if e.count > 1 {
			c := fmt.Sprintf("seq %d", m.Seq)
			if m.From != "" {
				c += " " + m.From
			}
			copies[m.ID] = append(copies[m.ID], c)
			if !first && len(l.windows) > 0 {
				by(l.windowAt(hostTime(m.Stored), 0, false)).Duplicates++
			}
		}
		if first && strings.HasPrefix(m.ID, RollbackPrefix) && len(l.windows) > 0 {
			by(l.windowAt(hostTime(m.Stored), 0, false)).Phantoms++
		}
		if m.ExpiresAt.IsZero() || m.Stored.IsZero() {
			continue
		}
		f.DeadlineMsgs++
		// The deadline on the broker's clock, which dated the message.
		deadline := m.ExpiresAt.Add(-l.clock.DBMinusBroker())
		left := deadline.Sub(m.Stored)
		if f.DeadlineMsgs == 1 || left < f.MinDeadlineLeft {
			f.MinDeadlineLeft = left
		}
		if -left <= l.clock.Uncertainty {
			continue
		}
		if len(l.windows) > 0 && l.windowAt(hostTime(m.Stored), 0, false) == FaultRelayPaused {
			// Bytes a relay wrote before it was stopped (SIGSTOP) reach the
			// broker when it is continued: it decided to publish before
			// the deadline, and no process can take back what it wrote
			// before it was frozen. Counted apart, not a failure (the
			// deadline is checked at publish: a row the continued relay
			// still held is not published, TestDeadlineAskedAgainAtPublish).
			f.PastDeadlineAfterPause++
			continue
		}
		f.PastDeadline++
		f.MaxPastDeadline = max(f.MaxPastDeadline, -left)
		if len(l.windows) > 0 {
			by(l.windowAt(hostTime(m.Stored), 0, false)).PastDeadline++
		}
		addSample(&f.PastDeadlineSample, fmt.Sprintf("%s seq %d stored %s, %s after its deadline %s (database clock; %s on the broker's)",
			m.ID, m.Seq, m.Stored.UTC().Format("15:04:05.000"), (-left).Round(time.Millisecond),
			m.ExpiresAt.UTC().Format("15:04:05.000"), deadline.UTC().Format("15:04:05.000")))
	}
	for _, id := range ids {
		e := l.stream[id]
		if e.count > 1 {
			f.StoredDuplicates += e.count - 1
			addSample(&f.DuplicateSample, fmt.Sprintf("%s stored %d times: %s", id, e.count, strings.Join(copies[id], "; ")))
		}
		switch {
		case strings.HasPrefix(id, RollbackPrefix):
			f.Phantoms++
			addSample(&f.PhantomSample, id)
		case takenBack(id):
			f.TakenBackInStream++
			addSample(&f.TakenBackSample, id+" (committed on a former primary, not on the promoted one)")
		case !l.known[id]:
			f.UnknownMsgs++
			addSample(&f.UnknownMsgSample, id)
		}
	}
	return f
}
