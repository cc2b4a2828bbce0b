package replication

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
)

// Table names the outbox table the decoder accepts; rows of other relations are ignored.
type Table struct{ Schema, Name string }

// String returns schema.name, for messages.
func (t Table) String() string { return t.Schema + "." + t.Name }

// ErrMalformedRow marks an outbox INSERT whose values the relay cannot turn
// into a Row (a NULL where a value is required, an unparsable timestamp, ...),
// so callers can tell a bad row from a broken stream or schema.
var ErrMalformedRow = errors.New("malformed outbox row")

// outboxField is a column of the outbox table that the relay reads.
type outboxField int

const (
	fWorkID outboxField = iota
	fKind
	fSubject
	fPayload
	fHeaders
	fState
	fAvailableAt
	// Optional: a table from before migration 0006 lacks them, and its
	// rows decode as having no aggregate and no deadline.
	fAggregateType
	fAggregateID
	fAggregateSeq
	fExpiresAt
	numOutboxFields
	firstOptional = fAggregateType
)

var outboxFieldNames = [numOutboxFields]string{
	fWorkID:      "work_id",
	fKind:        "kind",
	fSubject:     "subject",
	fPayload:     "payload",
	fHeaders:     "headers",
	fState:       "state",
	fAvailableAt: "available_at",
	// G12 and G13.
	fAggregateType: "aggregate_type",
	fAggregateID:   "aggregate_id",
	fAggregateSeq:  "aggregate_seq",
	fExpiresAt:     "expires_at",
}

func (f outboxField) String() string { return outboxFieldNames[f] }

// outboxColumnList is for error messages that tell an operator what the relay needs.
var outboxColumnList = strings.Join(outboxFieldNames[:firstOptional], ", ")

// relationInfo is what a Relation message told us about one relation id. For
// the outbox table idx holds the tuple position of each field, so that decoding a
// row is a few slice lookups instead of a search by name.
type relationInfo struct {
	id     uint32
	outbox bool
	ncols  int
	idx    [numOutboxFields]int
	// err is set when the outbox relation lacks a column: its inserts cannot
	// be decoded until a later Relation message describes a usable table.
	err error
}

// farFuture stands in for 'infinity': the row is never due, which is what
// PostgreSQL's own comparisons would say, without the relay special-casing it.
var farFuture = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)

// Decoder turns the pgoutput (proto_version 1, text format, streaming off)
// messages of one replication session into Events. It is not safe for
// concurrent use; a new session should start with a new Decoder, because the
// server resends Relation messages and whole transactions after a reconnect.
type Decoder struct {
	table Table
	rels  map[uint32]*relationInfo
	// last short-cuts the map lookup on the hot path: a publication for the
	// relay normally carries the outbox table alone.
	last *relationInfo

	inTxn      bool
	xid        uint32
	commitLSN  pglogrepl.LSN
	commitTime time.Time

	// scratch gathers a row's text columns so that they become one string
	// allocation, sliced per field.
	scratch []byte
}

// NewDecoder returns a Decoder that emits rows of t. An empty schema means
// "public", the schema pgoutput names for unqualified tables.
func NewDecoder(t Table) *Decoder {
	if t.Schema == "" {
		t.Schema = "public"
	}
	return &Decoder{table: t, rels: make(map[uint32]*relationInfo)}
}

// InTransaction reports whether a BEGIN was decoded and its COMMIT not yet.
func (d *Decoder) InTransaction() bool { return d.inTxn }

// Decode consumes the WALData of one XLogData message (one pgoutput logical
// replication message, v1) and returns the event it produced, if any.
func (d *Decoder) Decode(walData []byte) (ev Event, ok bool, err error) {
	if len(walData) == 0 {
		return Event{}, false, errors.New("decode pgoutput message: empty message")
	}
	switch t := pglogrepl.MessageType(walData[0]); t {
	case pglogrepl.MessageTypeBegin:
		return d.begin(walData)
	case pglogrepl.MessageTypeCommit:
		return d.commit(walData)
	case pglogrepl.MessageTypeRelation:
		return Event{}, false, d.relation(walData)
	case pglogrepl.MessageTypeInsert:
		return d.insert(walData)
	case pglogrepl.MessageTypeUpdate, pglogrepl.MessageTypeDelete, pglogrepl.MessageTypeTruncate,
		pglogrepl.MessageTypeType, pglogrepl.MessageTypeOrigin, pglogrepl.MessageTypeMessage:
		// Not parsed at all: the relay's own UPDATEs of the outbox come back
		// through the slot for every claim and publish, and would otherwise
		// cost as much as the inserts it cares about.
		return Event{}, false, nil
	case pglogrepl.MessageTypeStreamStart, pglogrepl.MessageTypeStreamStop,
		pglogrepl.MessageTypeStreamCommit, pglogrepl.MessageTypeStreamAbort:
		return Event{}, false, fmt.Errorf("decode pgoutput message: got %s message of an in-progress transaction: start replication with streaming off", t)
	default:
		// Let pglogrepl name whatever it is; it rejects what v1 does not define.
		if _, err := parseMessage(walData); err != nil {
			return Event{}, false, err
		}
		return Event{}, false, fmt.Errorf("decode pgoutput message: unexpected message type %q", byte(t))
	}
}

// parseMessage wraps pglogrepl.Parse, which indexes past the end of a truncated
// Relation or tuple instead of reporting it: a corrupt message must stop the
// stream with an error, not crash the relay.
func parseMessage(walData []byte) (m pglogrepl.Message, err error) {
	defer func() {
		if r := recover(); r != nil {
			m, err = nil, fmt.Errorf("decode pgoutput %q message of %d bytes: truncated or corrupt: %v", walData[0], len(walData), r)
		}
	}()
	m, err = pglogrepl.Parse(walData)
	if err != nil {
		return nil, fmt.Errorf("decode pgoutput %q message: %w", walData[0], err)
	}
	return m, nil
}

func (d *Decoder) begin(walData []byte) (Event, bool, error) {
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	b := m.(*pglogrepl.BeginMessage)
	if d.inTxn {
		// With streaming off pgoutput never interleaves transactions; a second
		// BEGIN means events of xid d.xid were lost or the decoder was reused
		// across sessions, and the caller's view of the open one is wrong.
		return Event{}, false, fmt.Errorf("decode begin of xid %d: transaction xid %d is still open", b.Xid, d.xid)
	}
	d.inTxn = true
	d.xid = b.Xid
	d.commitLSN = b.FinalLSN
	d.commitTime = b.CommitTime.UTC()
	return Event{Type: EventBegin, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime}, true, nil
}

func (d *Decoder) commit(walData []byte) (Event, bool, error) {
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	c := m.(*pglogrepl.CommitMessage)
	if !d.inTxn {
		return Event{}, false, fmt.Errorf("decode commit at %s: no transaction is open", c.CommitLSN)
	}
	if c.CommitLSN != d.commitLSN {
		// The slot is confirmed from commit positions: a mismatch means the
		// stream is not what the decoder thinks it is, and confirming would
		// risk skipping rows.
		return Event{}, false, fmt.Errorf("decode commit of xid %d: commit lsn %s differs from the %s announced by its begin", d.xid, c.CommitLSN, d.commitLSN)
	}
	d.inTxn = false
	return Event{
		Type:       EventCommit,
		Xid:        d.xid,
		CommitLSN:  c.CommitLSN,
		EndLSN:     c.TransactionEndLSN,
		CommitTime: c.CommitTime.UTC(),
	}, true, nil
}

func (d *Decoder) relation(walData []byte) error {
	m, err := parseMessage(walData)
	if err != nil {
		return err
	}
	r := m.(*pglogrepl.RelationMessage)
	rel := &relationInfo{id: r.RelationID, ncols: len(r.Columns)}
	if r.Namespace == d.table.Schema && r.RelationName == d.table.Name {
		rel.outbox = true
		for f := range rel.idx {
			rel.idx[f] = -1
		}
		for pos, c := range r.Columns {
			for f, name := range outboxFieldNames {
				if c.Name == name {
					rel.idx[f] = pos
					break
				}
			}
		}
		var missing []string
		for f, pos := range rel.idx[:firstOptional] {
			if pos < 0 {
				missing = append(missing, fmt.Sprintf("%q", outboxFieldNames[f]))
			}
		}
		if len(missing) > 0 {
			what := "column " + missing[0]
			if len(missing) > 1 {
				what = "columns " + strings.Join(missing, ", ")
			}
			rel.err = fmt.Errorf("outbox table %q.%q has no %s (the relay reads %s): restore it or run outbox-relay migrate",
				r.Namespace, r.RelationName, what, outboxColumnList)
		}
	}
	// A later description of the same id replaces the earlier one: columns
	// may have been added, dropped or reordered since.
	d.rels[rel.id] = rel
	if d.last != nil && d.last.id == rel.id {
		d.last = rel
	}
	return rel.err
}

func (d *Decoder) insert(walData []byte) (Event, bool, error) {
	if !d.inTxn {
		return Event{}, false, errors.New("decode insert: no transaction is open")
	}
	// Look the relation up before parsing, so that inserts into other tables
	// of the publication cost nothing.
	if len(walData) < 5 {
		_, err := parseMessage(walData)
		if err == nil {
			err = errors.New("decode insert: message too short")
		}
		return Event{}, false, err
	}
	id := binary.BigEndian.Uint32(walData[1:])
	rel := d.last
	if rel == nil || rel.id != id {
		rel = d.rels[id]
		if rel == nil {
			return Event{}, false, fmt.Errorf("decode insert in xid %d: relation id %d was never described by a relation message", d.xid, id)
		}
		d.last = rel
	}
	if !rel.outbox {
		return Event{}, false, nil
	}
	if rel.err != nil {
		return Event{}, false, fmt.Errorf("decode insert in xid %d: %w", d.xid, rel.err)
	}
	if err := checkInsert(walData); err != nil {
		return Event{}, false, fmt.Errorf("decode insert into %s in xid %d: %w", d.table, d.xid, err)
	}
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	row, err := d.row(rel, m.(*pglogrepl.InsertMessage).Tuple)
	if err != nil {
		return Event{}, false, err
	}
	return Event{Type: EventRow, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime, Row: row}, true, nil
}

// checkInsert walks an Insert message without allocating and reports whether
// it is whole. pglogrepl trusts the lengths it reads: a corrupt column length
// would make it allocate up to 4 GiB before noticing the message is short.
func checkInsert(walData []byte) error {
	const header = 1 + 4 + 1 + 2 // type, relation id, 'N', column count
	if len(walData) < header {
		return fmt.Errorf("message of %d bytes is too short", len(walData))
	}
	if walData[5] != 'N' {
		return fmt.Errorf("tuple type %q, want 'N'", walData[5])
	}
	ncols := int(binary.BigEndian.Uint16(walData[6:]))
	p := header
	for i := range ncols {
		if p >= len(walData) {
			return fmt.Errorf("message ends at column %d of %d", i, ncols)
		}
		kind := walData[p]
		p++
		switch kind {
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			if len(walData)-p < 4 {
				return fmt.Errorf("message ends in the length of column %d of %d", i, ncols)
			}
			n := uint64(binary.BigEndian.Uint32(walData[p:]))
			p += 4
			if n > uint64(len(walData)-p) {
				return fmt.Errorf("column %d of %d claims %d bytes, the message has %d left", i, ncols, n, len(walData)-p)
			}
			p += int(n)
		default:
			return fmt.Errorf("column %d of %d has unknown tuple data kind %q", i, ncols, kind)
		}
	}
	if p != len(walData) {
		return fmt.Errorf("%d bytes follow the last column", len(walData)-p)
	}
	return nil
}

func (d *Decoder) row(rel *relationInfo, tuple *pglogrepl.TupleData) (*Row, error) {
	cols := tuple.Columns
	if len(cols) != rel.ncols {
		return nil, fmt.Errorf("decode insert into %s in xid %d: tuple has %d columns, its relation message described %d",
			d.table, d.xid, len(cols), rel.ncols)
	}
	var (
		vals [numOutboxFields][]byte
		null [numOutboxFields]bool
	)
	var workID []byte
	for f := range numOutboxFields {
		if rel.idx[f] < 0 {
			null[f] = true // an optional column the table does not have
			continue
		}
		c := cols[rel.idx[f]]
		switch c.DataType {
		case pglogrepl.TupleDataTypeText:
			vals[f] = c.Data
		case pglogrepl.TupleDataTypeNull:
			null[f] = true
		case pglogrepl.TupleDataTypeToast:
			return nil, d.rowErr(workID, f, "is an unchanged-TOAST placeholder, not a value")
		case pglogrepl.TupleDataTypeBinary:
			return nil, d.rowErr(workID, f, "is in binary format: start replication without binary mode")
		default:
			return nil, d.rowErr(workID, f, fmt.Sprintf("has unknown tuple data kind %q", c.DataType))
		}
		if null[f] && f != fSubject && f != fHeaders && f < firstOptional {
			return nil, d.rowErr(workID, f, "is NULL")
		}
		if f == fWorkID {
			workID = vals[f]
		}
	}
	at, err := parseTimestamptz(vals[fAvailableAt])
	if err != nil {
		return nil, d.rowErr(workID, fAvailableAt, "is unparsable: "+err.Error())
	}

	// One string for the text fields and one buffer for the jsonb ones keeps
	// a row at three allocations; nothing may alias the message buffer.
	s := append(d.scratch[:0], vals[fWorkID]...)
	s = append(s, vals[fKind]...)
	s = append(s, vals[fSubject]...)
	s = append(s, vals[fState]...)
	d.scratch = s
	text := string(s)
	i, j, k := len(vals[fWorkID]), len(vals[fWorkID])+len(vals[fKind]), len(s)-len(vals[fState])

	np, nh := len(vals[fPayload]), len(vals[fHeaders])
	buf := make([]byte, np+nh)
	copy(buf, vals[fPayload])
	copy(buf[np:], vals[fHeaders])

	row := &Row{
		WorkID:      text[:i],
		Kind:        text[i:j],
		Subject:     text[j:k],
		State:       text[k:],
		Payload:     buf[:np:np],
		AvailableAt: at,
	}
	if !null[fHeaders] {
		row.Headers = buf[np:]
	}
	if !null[fAggregateType] && !null[fAggregateID] && !null[fAggregateSeq] {
		seq, err := strconv.ParseInt(string(vals[fAggregateSeq]), 10, 64)
		if err != nil {
			return nil, d.rowErr(workID, fAggregateSeq, "is unparsable: "+err.Error())
		}
		row.Aggregate = &Aggregate{Type: string(vals[fAggregateType]), ID: string(vals[fAggregateID]), Seq: seq}
	}
	if !null[fExpiresAt] {
		exp, err := parseTimestamptz(vals[fExpiresAt])
		if err != nil {
			return nil, d.rowErr(workID, fExpiresAt, "is unparsable: "+err.Error())
		}
		row.ExpiresAt = exp
	}
	return row, nil
}

// rowErr describes a bad value of field f in the row being decoded, naming the
// row by work_id once that is known so an operator can find it.
func (d *Decoder) rowErr(workID []byte, f outboxField, problem string) error {
	if workID == nil {
		return fmt.Errorf("%w in %s, xid %d: column %q %s", ErrMalformedRow, d.table, d.xid, f, problem)
	}
	return fmt.Errorf("%w in %s, xid %d, work_id %q: column %q %s", ErrMalformedRow, d.table, d.xid, workID, f, problem)
}

// parseTimestamptz parses a timestamptz as PostgreSQL prints it with DateStyle
// ISO, which the relay pins on its connection: "2026-11-30 05:04:42.123456+00",
// an offset of +HH, +HH:MM or +HH:MM:SS, years beyond 9999 and a " BC" suffix.
// It is hand-written because it runs for every row and must accept all of
// those shapes, which would take several time.Parse layouts.
func parseTimestamptz(b []byte) (time.Time, error) {
	switch string(b) {
	case "infinity":
		return farFuture, nil
	case "-infinity":
		return time.Time{}, nil
	}
	p := tsParser{b: b}
	year := p.digits(4, 9)
	p.lit('-')
	month := p.digits(2, 2)
	p.lit('-')
	day := p.digits(2, 2)
	p.lit(' ')
	hour := p.digits(2, 2)
	p.lit(':')
	minute := p.digits(2, 2)
	p.lit(':')
	sec := p.digits(2, 2)
	nsec := 0
	if p.peek('.') {
		p.pos++
		start := p.pos
		frac := p.digits(1, 9)
		for range 9 - (p.pos - start) {
			frac *= 10
		}
		nsec = frac
	}
	sign := 0
	switch {
	case p.peek('+'):
		sign = 1
	case p.peek('-'):
		sign = -1
	default:
		p.bad = true
	}
	p.pos++
	offH, offM, offS := p.digits(2, 2), 0, 0
	if p.peek(':') {
		p.pos++
		offM = p.digits(2, 2)
		if p.peek(':') {
			p.pos++
			offS = p.digits(2, 2)
		}
	}
	if p.peek(' ') {
		p.pos++
		p.lit('B')
		p.lit('C')
		year = 1 - year // 1 BC is year 0 on Go's proleptic calendar
	}
	if p.bad || p.pos != len(b) ||
		month < 1 || month > 12 || day < 1 || day > daysInMonth(month, year) ||
		hour > 23 || minute > 59 || sec > 59 || offH > 15 || offM > 59 || offS > 59 {
		return time.Time{}, fmt.Errorf("%q is not a timestamptz in DateStyle ISO (like \"2026-11-30 05:04:42.123456+00\")", clipValue(b))
	}
	t := time.Date(year, time.Month(month), day, hour, minute, sec, nsec, time.UTC)
	off := time.Duration(sign*(offH*3600+offM*60+offS)) * time.Second
	return t.Add(-off), nil
}

type tsParser struct {
	b   []byte
	pos int
	bad bool
}

func (p *tsParser) peek(c byte) bool { return p.pos < len(p.b) && p.b[p.pos] == c }

func (p *tsParser) lit(c byte) {
	if !p.peek(c) {
		p.bad = true
	}
	p.pos++
}

// digits reads between lo and hi decimal digits.
func (p *tsParser) digits(lo, hi int) int {
	n, start := 0, p.pos
	for p.pos < len(p.b) && p.pos-start < hi && '0' <= p.b[p.pos] && p.b[p.pos] <= '9' {
		n = n*10 + int(p.b[p.pos]-'0')
		p.pos++
	}
	if p.pos-start < lo {
		p.bad = true
	}
	return n
}

func daysInMonth(month, year int) int {
	switch month {
	case 2:
		if year%4 == 0 && (year%100 != 0 || year%400 == 0) {
			return 29
		}
		return 28
	case 4, 6, 9, 11:
		return 30
	}
	return 31
}

// clipValue keeps error messages readable when a value is not a timestamp at all.
func clipValue(b []byte) string {
	const limit = 64
	if len(b) > limit {
		return string(b[:limit]) + "..."
	}
	return string(b)
}
