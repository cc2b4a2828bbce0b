package replication

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/outbox-relay/outbox-relay/internal/wire"
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
	// Optional too (migration 0013): NULL or missing reads as 0.
	fXactID
	// Optional: what CloudEvents' time attribute says; zero when missing.
	fCreatedAt
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
	// G17.
	fXactID: "xact_id",
	// The message formats (issue 45).
	fCreatedAt: "created_at",
}

func (f outboxField) String() string { return outboxFieldNames[f] }

// outboxColumnList is for error messages that tell an operator what the relay needs.
var outboxColumnList = strings.Join(outboxFieldNames[:firstOptional], ", ")

// relationInfo is what a Relation message told us about one relation id. For
// the outbox table idx holds the tuple position of each field, and fieldAt the
// reverse (field+1 per position, 0 for a column the relay does not read), so
// that one pass over an Insert finds every value without a search by name.
type relationInfo struct {
	id      uint32
	outbox  bool
	ncols   int
	idx     [numOutboxFields]int
	fieldAt []uint8
	// err is set when the outbox relation lacks a column: its inserts cannot
	// be decoded until a later Relation message describes a usable table.
	err error
	// binary says the payload column is bytea: its text is hex, decoded to
	// the bytes (slot.go pins bytea_output).
	binary bool
}

// byteaOID is bytea's type OID; jsonb (3802) and json (114) payloads are
// text, and so is any other type, as before payload types were chosen.
const byteaOID = 17

// Infinity and NegInfinity are how a Row's times carry PostgreSQL's
// 'infinity' and '-infinity': past the largest and before the smallest
// timestamp PostgreSQL holds, so every comparison with a clock comes out as
// PostgreSQL's own would (available_at 'infinity' is never due, expires_at
// '-infinity' has always passed), and no stored value is mistaken for them.
// The poller's path reads them the same way (internal/store).
var (
	Infinity    = wire.Infinity
	NegInfinity = wire.NegInfinity
)

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

	// createdAt: parse created_at into Row.CreatedAt (StreamConfig.CreatedAt).
	createdAt bool

	inTxn      bool
	xid        uint32
	commitLSN  pglogrepl.LSN
	commitTime time.Time
}

// NewDecoder returns a Decoder that emits rows of t. An empty schema means
// "public", the schema pgoutput names for unqualified tables.
func NewDecoder(t Table) *Decoder { return newDecoder(t, true) }

func newDecoder(t Table, createdAt bool) *Decoder {
	if t.Schema == "" {
		t.Schema = "public"
	}
	return &Decoder{table: t, rels: make(map[uint32]*relationInfo), createdAt: createdAt}
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

// Begin and Commit have fixed layouts and come with every transaction, so
// they are read in place; only a short one goes through pglogrepl, for the
// same error it has always produced.
const (
	beginLen  = 1 + 8 + 8 + 4     // type, final LSN, commit time, xid
	commitLen = 1 + 1 + 8 + 8 + 8 // type, flags, commit LSN, end LSN, commit time
)

// microsecFromUnixEpochToY2K is where pgoutput's timestamps count from.
const microsecFromUnixEpochToY2K = 946684800 * 1000000

// pgTime converts a pgoutput timestamp (microseconds since 2000-01-01 UTC)
// with the same arithmetic as pglogrepl, so that an out-of-range value wraps
// exactly as it did when pglogrepl decoded these messages.
func pgTime(b []byte) time.Time {
	us := int64(binary.BigEndian.Uint64(b))
	return time.Unix(0, (microsecFromUnixEpochToY2K+us)*1000).UTC()
}

// shortMessage is the error for a message below its fixed size, in
// pglogrepl's words, which are what callers and operators have seen so far.
func shortMessage(walData []byte) error {
	if _, err := parseMessage(walData); err != nil {
		return err
	}
	return fmt.Errorf("decode pgoutput %q message: message of %d bytes is too short", walData[0], len(walData))
}

func (d *Decoder) begin(walData []byte) (Event, bool, error) {
	if len(walData) < beginLen {
		return Event{}, false, shortMessage(walData)
	}
	finalLSN := pglogrepl.LSN(binary.BigEndian.Uint64(walData[1:]))
	xid := binary.BigEndian.Uint32(walData[17:])
	if d.inTxn {
		// With streaming off pgoutput never interleaves transactions; a second
		// BEGIN means events of xid d.xid were lost or the decoder was reused
		// across sessions, and the caller's view of the open one is wrong.
		return Event{}, false, fmt.Errorf("decode begin of xid %d: transaction xid %d is still open", xid, d.xid)
	}
	d.inTxn = true
	d.xid = xid
	d.commitLSN = finalLSN
	d.commitTime = pgTime(walData[9:])
	return Event{Type: EventBegin, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime}, true, nil
}

func (d *Decoder) commit(walData []byte) (Event, bool, error) {
	if len(walData) < commitLen {
		return Event{}, false, shortMessage(walData)
	}
	commitLSN := pglogrepl.LSN(binary.BigEndian.Uint64(walData[2:]))
	if !d.inTxn {
		return Event{}, false, fmt.Errorf("decode commit at %s: no transaction is open", commitLSN)
	}
	if commitLSN != d.commitLSN {
		// The slot is confirmed from commit positions: a mismatch means the
		// stream is not what the decoder thinks it is, and confirming would
		// risk skipping rows.
		return Event{}, false, fmt.Errorf("decode commit of xid %d: commit lsn %s differs from the %s announced by its begin", d.xid, commitLSN, d.commitLSN)
	}
	d.inTxn = false
	return Event{
		Type:       EventCommit,
		Xid:        d.xid,
		CommitLSN:  commitLSN,
		EndLSN:     pglogrepl.LSN(binary.BigEndian.Uint64(walData[10:])),
		CommitTime: pgTime(walData[18:]),
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
		rel.fieldAt = make([]uint8, len(r.Columns))
		for pos, c := range r.Columns {
			for f, name := range outboxFieldNames {
				if c.Name == name {
					rel.idx[f] = pos
					rel.fieldAt[pos] = uint8(f) + 1
					if outboxField(f) == fPayload {
						rel.binary = c.DataType == byteaOID
					}
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
	var vals fieldValues
	ncols, err := readInsert(walData, rel.fieldAt, &vals)
	if err != nil {
		return Event{}, false, fmt.Errorf("decode insert into %s in xid %d: %w", d.table, d.xid, err)
	}
	if ncols != rel.ncols {
		return Event{}, false, fmt.Errorf("decode insert into %s in xid %d: tuple has %d columns, its relation message described %d",
			d.table, d.xid, ncols, rel.ncols)
	}
	row, err := d.row(walData, &vals, rel.binary)
	if err != nil {
		return Event{}, false, err
	}
	return Event{Type: EventRow, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime, Row: row}, true, nil
}

// fieldValue locates one field's column in the Insert message being decoded.
// kind 0 means the table has no such column, which decodes as NULL.
type fieldValue struct {
	kind       byte
	start, end int
}

type fieldValues [numOutboxFields]fieldValue

// bytes returns the value's bytes in msg; never nil, because rowErr tells a
// known work_id from none by nil-ness and an empty work_id is still known.
func (v fieldValue) bytes(msg []byte) []byte { return msg[v.start:v.end] }

// readInsert walks an Insert message once, in place, checking that it is
// whole, and records in vals where the columns of the outbox fields are.
// Every length is checked against what is left of the message first: a
// corrupt one must stop the stream with an error, not a panic. fieldAt maps
// tuple positions to fields; when the tuple's column count differs from it
// nothing is recorded, and the caller reports the mismatch once the message
// is known to be whole, so that a truncated message is reported as such.
func readInsert(walData []byte, fieldAt []uint8, vals *fieldValues) (ncols int, err error) {
	const header = 1 + 4 + 1 + 2 // type, relation id, 'N', column count
	if len(walData) < header {
		return 0, fmt.Errorf("message of %d bytes is too short", len(walData))
	}
	if walData[5] != 'N' {
		return 0, fmt.Errorf("tuple type %q, want 'N'", walData[5])
	}
	ncols = int(binary.BigEndian.Uint16(walData[6:]))
	if ncols != len(fieldAt) {
		fieldAt = nil
	}
	p := header
	for i := range ncols {
		if p >= len(walData) {
			return 0, fmt.Errorf("message ends at column %d of %d", i, ncols)
		}
		kind := walData[p]
		p++
		start := p
		switch kind {
		case pglogrepl.TupleDataTypeNull, pglogrepl.TupleDataTypeToast:
		case pglogrepl.TupleDataTypeText, pglogrepl.TupleDataTypeBinary:
			if len(walData)-p < 4 {
				return 0, fmt.Errorf("message ends in the length of column %d of %d", i, ncols)
			}
			n := uint64(binary.BigEndian.Uint32(walData[p:]))
			p += 4
			if n > uint64(len(walData)-p) {
				return 0, fmt.Errorf("column %d of %d claims %d bytes, the message has %d left", i, ncols, n, len(walData)-p)
			}
			start = p
			p += int(n)
		default:
			return 0, fmt.Errorf("column %d of %d has unknown tuple data kind %q", i, ncols, kind)
		}
		if i < len(fieldAt) {
			if f := fieldAt[i]; f != 0 {
				vals[f-1] = fieldValue{kind: kind, start: start, end: p}
			}
		}
	}
	if p != len(walData) {
		return 0, fmt.Errorf("%d bytes follow the last column", len(walData)-p)
	}
	return ncols, nil
}

// rowAndAggregate lets a row of an aggregate cost the same one allocation
// as a row without one.
type rowAndAggregate struct {
	row Row
	agg Aggregate
}

// row turns the located values into a Row. Everything a Row keeps is copied
// out of msg, whose buffer pgconn reuses for the next message: the text
// fields into one string and the jsonb ones into one buffer. They are apart
// so that a work_id or aggregate key kept after the row is settled (the held
// aggregates of G12) does not keep a large payload alive.
func (d *Decoder) row(msg []byte, vals *fieldValues, binary bool) (*Row, error) {
	var (
		null   [numOutboxFields]bool
		workID []byte
	)
	for f := range numOutboxFields {
		switch vals[f].kind {
		case pglogrepl.TupleDataTypeText:
		case 0, pglogrepl.TupleDataTypeNull:
			null[f] = true
		case pglogrepl.TupleDataTypeToast:
			return nil, d.rowErr(workID, f, "is an unchanged-TOAST placeholder, not a value")
		case pglogrepl.TupleDataTypeBinary:
			return nil, d.rowErr(workID, f, "is in binary format: start replication without binary mode")
		default:
			// readInsert lets no other kind through.
			return nil, d.rowErr(workID, f, fmt.Sprintf("has unknown tuple data kind %q", vals[f].kind))
		}
		if null[f] && f != fSubject && f != fHeaders && f < firstOptional {
			return nil, d.rowErr(workID, f, "is NULL")
		}
		if f == fWorkID {
			workID = vals[f].bytes(msg)
		}
	}
	at, err := parseTimestamptz(vals[fAvailableAt].bytes(msg))
	if err != nil {
		return nil, d.rowErr(workID, fAvailableAt, "is unparsable: "+err.Error())
	}
	ordered := !null[fAggregateType] && !null[fAggregateID] && !null[fAggregateSeq]
	var seq int64
	if ordered {
		seq, err = strconv.ParseInt(string(vals[fAggregateSeq].bytes(msg)), 10, 64)
		if err != nil {
			return nil, d.rowErr(workID, fAggregateSeq, "is unparsable: "+err.Error())
		}
	}
	var exp time.Time
	if !null[fExpiresAt] {
		exp, err = parseTimestamptz(vals[fExpiresAt].bytes(msg))
		if err != nil {
			return nil, d.rowErr(workID, fExpiresAt, "is unparsable: "+err.Error())
		}
		if exp.IsZero() {
			// 0001-01-01 00:00:00 UTC is time.Time's zero, which a Row
			// reads as "no deadline"; a nanosecond earlier (finer than
			// PostgreSQL keeps) it is the deadline that has passed.
			exp = exp.Add(-time.Nanosecond)
		}
	}

	var created time.Time
	if d.createdAt && !null[fCreatedAt] {
		// Only CloudEvents' time attribute reads it: a value the relay
		// cannot parse is left out there rather than refusing the row here.
		created, _ = parseTimestamptz(vals[fCreatedAt].bytes(msg))
	}

	var xact uint64
	if !null[fXactID] {
		// Written by the database (a default and a trigger), so a value
		// that does not parse is not the producer's to answer for: it
		// reads as unknown, and the row is marked as under --on-publish
		// mark instead of being left to the watermark.
		xact, _ = strconv.ParseUint(string(vals[fXactID].bytes(msg)), 10, 64)
	}

	// A NULL or missing field's value is empty, so it adds nothing.
	parts := [...][]byte{
		vals[fWorkID].bytes(msg), vals[fKind].bytes(msg), vals[fSubject].bytes(msg), vals[fState].bytes(msg),
		nil, nil,
	}
	if ordered {
		parts[4], parts[5] = vals[fAggregateType].bytes(msg), vals[fAggregateID].bytes(msg)
	}
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	var sb strings.Builder
	sb.Grow(n)
	var ends [len(parts)]int
	for i, p := range parts {
		sb.Write(p)
		ends[i] = sb.Len()
	}
	text := sb.String()

	payload, headers := vals[fPayload].bytes(msg), vals[fHeaders].bytes(msg)
	np := len(payload)
	if binary {
		np, err = byteaLen(payload)
		if err != nil {
			return nil, d.rowErr(workID, fPayload, err.Error())
		}
	}
	buf := make([]byte, np+len(headers))
	if binary {
		if _, err := hex.Decode(buf[:np], payload[2:]); err != nil {
			return nil, d.rowErr(workID, fPayload, "is not bytea's hex text: "+err.Error())
		}
	} else {
		copy(buf, payload)
	}
	copy(buf[np:], headers)

	var row *Row
	if ordered {
		ra := &rowAndAggregate{agg: Aggregate{Type: text[ends[3]:ends[4]], ID: text[ends[4]:ends[5]], Seq: seq}}
		row = &ra.row
		row.Aggregate = &ra.agg
	} else {
		row = new(Row)
	}
	row.WorkID = text[:ends[0]]
	row.Kind = text[ends[0]:ends[1]]
	row.Subject = text[ends[1]:ends[2]]
	row.State = text[ends[2]:ends[3]]
	// Capped, so that appending to one cannot write into the other.
	row.Payload = buf[:np:np]
	if !null[fHeaders] {
		row.Headers = buf[np:]
	}
	row.Binary = binary
	row.AvailableAt = at
	row.ExpiresAt = exp
	row.CreatedAt = created
	row.XactID = xact
	return row, nil
}

// byteaLen is the length of the bytes bytea's hex text b stands for.
func byteaLen(b []byte) (int, error) {
	if len(b) < 2 || b[0] != '\\' || b[1] != 'x' {
		return 0, fmt.Errorf("is bytea in a form other than hex (%q...): the relay sets bytea_output=hex on its replication connection", clipValue(b))
	}
	if len(b)%2 != 0 {
		return 0, fmt.Errorf("is bytea hex text of odd length %d", len(b))
	}
	return (len(b) - 2) / 2, nil
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
		return Infinity, nil
	case "-infinity":
		return NegInfinity, nil
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

// digits reads between lo and hi decimal digits. It works on locals because
// it runs a dozen times per timestamp and the parser's fields live in memory.
func (p *tsParser) digits(lo, hi int) int {
	start := p.pos
	end := min(len(p.b), start+hi)
	n, i := 0, start
	for ; i < end; i++ {
		c := p.b[i] - '0'
		if c > 9 {
			break
		}
		n = n*10 + int(c)
	}
	if i-start < lo {
		p.bad = true
	}
	p.pos = i
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
