package replication

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
)

// The decoder reads Begin, Commit and Insert in place. Its reference is the
// way it decoded them before, through pglogrepl, kept here verbatim (bar the
// receivers) so that FuzzDecodeInsert can hold the two to the same output.

// refDecode decodes msg the old way where the decoder has its own reader,
// and through Decode otherwise.
func refDecode(d *Decoder, msg []byte) (Event, bool, error) {
	if len(msg) == 0 {
		return d.Decode(msg)
	}
	switch msg[0] {
	case 'B':
		return refBegin(d, msg)
	case 'C':
		return refCommit(d, msg)
	case 'I':
		return refInsert(d, msg)
	}
	return d.Decode(msg)
}

func refBegin(d *Decoder, walData []byte) (Event, bool, error) {
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	b := m.(*pglogrepl.BeginMessage)
	if d.inTxn {
		return Event{}, false, fmt.Errorf("decode begin of xid %d: transaction xid %d is still open", b.Xid, d.xid)
	}
	d.inTxn = true
	d.xid = b.Xid
	d.commitLSN = b.FinalLSN
	d.commitTime = b.CommitTime.UTC()
	return Event{Type: EventBegin, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime}, true, nil
}

func refCommit(d *Decoder, walData []byte) (Event, bool, error) {
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	c := m.(*pglogrepl.CommitMessage)
	if !d.inTxn {
		return Event{}, false, fmt.Errorf("decode commit at %s: no transaction is open", c.CommitLSN)
	}
	if c.CommitLSN != d.commitLSN {
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

func refInsert(d *Decoder, walData []byte) (Event, bool, error) {
	if !d.inTxn {
		return Event{}, false, errors.New("decode insert: no transaction is open")
	}
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
	if err := refCheckInsert(walData); err != nil {
		return Event{}, false, fmt.Errorf("decode insert into %s in xid %d: %w", d.table, d.xid, err)
	}
	m, err := parseMessage(walData)
	if err != nil {
		return Event{}, false, err
	}
	row, err := refRow(d, rel, m.(*pglogrepl.InsertMessage).Tuple)
	if err != nil {
		return Event{}, false, err
	}
	return Event{Type: EventRow, Xid: d.xid, CommitLSN: d.commitLSN, CommitTime: d.commitTime, Row: row}, true, nil
}

func refCheckInsert(walData []byte) error {
	const header = 1 + 4 + 1 + 2
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

func refRow(d *Decoder, rel *relationInfo, tuple *pglogrepl.TupleData) (*Row, error) {
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
			null[f] = true
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
	s := append([]byte(nil), vals[fWorkID]...)
	s = append(s, vals[fKind]...)
	s = append(s, vals[fSubject]...)
	s = append(s, vals[fState]...)
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
	if !null[fCreatedAt] {
		row.CreatedAt, _ = parseTimestamptz(vals[fCreatedAt])
	}
	return row, nil
}

// Relation layouts the fuzz target decodes against, chosen by its first
// argument: where the fields sit, which optional ones exist, and relations the
// decoder must not read rows of.
var (
	refOrderedCols  = append(append([]string{}, testOutboxCols...), "aggregate_type", "aggregate_id", "aggregate_seq", "expires_at")
	refShuffledCols = []string{
		"expires_at", "trace_id", "available_at", "aggregate_seq", "headers", "tenant", "state",
		"payload", "aggregate_type", "subject", "kind", "work_id", "aggregate_id",
	}
	refNoPayloadCols = []string{"work_id", "kind", "subject", "headers", "state", "available_at"}
	refOtherCols     = []string{"id", "status"}
)

type refLayout struct {
	name  string
	ns    string
	table string
	cols  []string
	inTxn bool
}

var refLayouts = []refLayout{
	{"outbox", "public", "outbox", testOutboxCols, true},
	{"ordered", "public", "outbox", refOrderedCols, true},
	{"shuffled", "public", "outbox", refShuffledCols, true},
	{"no payload", "public", "outbox", refNoPayloadCols, true},
	{"other table", "public", "orders", refOtherCols, true},
	{"other schema", "audit", "outbox", testOutboxCols, true},
	{"no transaction", "public", "outbox", refOrderedCols, false},
}

func (l refLayout) setup() [][]byte {
	msgs := [][]byte{encRelation(testOutboxRelID, l.ns, l.table, l.cols...)}
	if l.inTxn {
		msgs = append(msgs, encBegin(0x100, commitTime1, 7))
	}
	return msgs
}

// refRandomValue returns a value for column col: mostly one that decodes, at
// times one that does not, so that every error of a row is reached.
func refRandomValue(r *rand.Rand, col string) tupleVal {
	switch r.IntN(16) {
	case 0:
		return nullVal
	case 1:
		return toastVal
	case 2:
		return tupleVal{kind: 'b', data: "\x00\x01"}
	case 3:
		return textVal("")
	case 4:
		return textVal(strings.Repeat("é\"\x00x", r.IntN(8)))
	}
	switch col {
	case "available_at", "expires_at", "created_at":
		stamps := []string{
			"2026-11-30 05:04:42.123456+00", "2026-11-30 10:34:42+05:30", "infinity", "-infinity",
			"0044-03-15 12:00:00+00 BC", "12026-11-30 05:04:42+00", "2026-11-30 04:34:27-00:30:15",
			"2026-11-30T05:04:42Z", "2026-02-30 00:00:00+00", "2026-11-30 05:04:42",
		}
		return textVal(stamps[r.IntN(len(stamps))])
	case "aggregate_seq":
		seqs := []string{"0", "3", "-1", "9223372036854775807", "9223372036854775808", "x", "+7", " 1"}
		return textVal(seqs[r.IntN(len(seqs))])
	case "payload", "headers":
		return textVal(fmt.Sprintf(`{"order_id": %d, "note": %q}`, r.IntN(1000), strings.Repeat("x", r.IntN(40))))
	}
	return textVal(fmt.Sprintf("%s-%d", col, r.IntN(1000)))
}

// refSeeds generates the messages FuzzDecodeInsert starts from: valid and
// invalid rows for every layout, each cut at every length, with bytes flipped
// and lengths corrupted, and Begin and Commit messages whole and cut.
func refSeeds() (layouts []uint8, msgs [][]byte) {
	add := func(l int, m []byte) {
		layouts = append(layouts, uint8(l))
		msgs = append(msgs, m)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for l, layout := range refLayouts {
		for n := range 40 {
			vals := make([]tupleVal, len(layout.cols))
			for i, c := range layout.cols {
				vals[i] = refRandomValue(r, c)
			}
			m := encInsert(testOutboxRelID, vals...)
			add(l, m)
			switch n % 8 {
			case 0:
				for cut := range len(m) {
					add(l, m[:cut])
				}
			case 1:
				flipped := append([]byte{}, m...)
				flipped[r.IntN(len(flipped))] = byte(r.Uint32())
				add(l, flipped)
			case 2:
				add(l, append(append([]byte{}, m...), 'n'))
			case 3:
				add(l, encInsert(testOutboxRelID, vals[:r.IntN(len(vals))]...))
			case 4:
				add(l, encInsert(testOutboxRelID, append(vals, textVal("extra"))...))
			case 5:
				other := append([]byte{}, m...)
				binary.BigEndian.PutUint32(other[1:], uint32(r.IntN(3)))
				add(l, other)
			}
		}
		good := sampleOutboxVals("w-1")
		good["aggregate_type"], good["aggregate_id"], good["aggregate_seq"] = textVal("order"), textVal("103"), textVal("3")
		good["expires_at"] = textVal("2026-12-01 10:00:00.5+01")
		m := encRow(testOutboxRelID, layout.cols, good)
		add(l, m)
		for cut := range len(m) {
			add(l, m[:cut])
		}
		add(l, append(pgmsg{'I'}.u32(testOutboxRelID).u8('N').u16(1).u8('t').u32(0xffffffff), "x"...))
		add(l, pgmsg{'I'}.u32(testOutboxRelID).u8('N').u16(0))
		add(l, append(pgmsg{'I'}.u32(testOutboxRelID).u8('K'), m[6:]...))
		add(l, encInsert(testOutboxRelID, tupleVal{kind: 'x'}))

		for _, m := range [][]byte{
			encBegin(0x100, commitTime1, 7), encBegin(0x200, time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC), 8),
			encCommit(0x100, 0x130, commitTime1), encCommit(0x200, 0x230, commitTime2),
			pgmsg{'B'}.u64(1).u64(1 << 63).u32(1), pgmsg{'C'}.u8(0).u64(0x100).u64(0x130).u64(1<<63 - 1),
		} {
			add(l, m)
			add(l, append(append([]byte{}, m...), 0))
			for cut := range len(m) {
				add(l, m[:cut])
			}
		}
	}
	return layouts, msgs
}

// refEventString renders everything an Event holds, for failure messages.
func refEventString(e Event) string {
	s := decEventString(e)
	if r := e.Row; r != nil {
		s += fmt.Sprintf(" aggregate=%+v expires_at=%s", r.Aggregate, decTimeString(r.ExpiresAt))
	}
	return s
}

// FuzzDecodeInsert checks that the decoder's own readers give exactly what
// decoding the same bytes through pglogrepl gave: the same event, or the same
// error. Its seeds alone (plain go test) cover every error of an Insert.
func FuzzDecodeInsert(f *testing.F) {
	layouts, msgs := refSeeds()
	for i := range msgs {
		f.Add(layouts[i], msgs[i])
	}
	f.Fuzz(func(t *testing.T, layout uint8, msg []byte) {
		l := refLayouts[int(layout)%len(refLayouts)]
		got, want := NewDecoder(testOutboxTable), NewDecoder(testOutboxTable)
		for _, m := range l.setup() {
			_, _, err1 := got.Decode(m)
			_, _, err2 := want.Decode(m)
			if (err1 == nil) != (err2 == nil) {
				t.Fatalf("setup %q: %v, %v", m[0], err1, err2)
			}
		}
		// The buffer is reused by the caller once decoded: decode a copy so
		// that a row the reference decoded cannot alias what the other reads.
		gotEv, gotOK, gotErr := got.Decode(append([]byte{}, msg...))
		wantEv, wantOK, wantErr := refDecode(want, append([]byte{}, msg...))
		if (gotErr == nil) != (wantErr == nil) || gotOK != wantOK || !reflect.DeepEqual(gotEv, wantEv) {
			t.Fatalf("layout %s, message %x:\n got %s, ok=%v, err=%v\nwant %s, ok=%v, err=%v",
				l.name, msg, refEventString(gotEv), gotOK, gotErr, refEventString(wantEv), wantOK, wantErr)
		}
		if gotErr != nil && gotErr.Error() != wantErr.Error() &&
			// The one message pglogrepl names differently: an Insert of no
			// columns, which it finds short and the decoder finds too narrow.
			!(strings.Contains(wantErr.Error(), "InsertMessage must have 8 bytes, got 7 bytes") &&
				strings.Contains(gotErr.Error(), "tuple has 0 columns")) {
			t.Fatalf("layout %s, message %x: error\n got %v\nwant %v", l.name, msg, gotErr, wantErr)
		}
		if errors.Is(gotErr, ErrMalformedRow) != errors.Is(wantErr, ErrMalformedRow) {
			t.Fatalf("layout %s, message %x: errors.Is(ErrMalformedRow) differs: %v, %v", l.name, msg, gotErr, wantErr)
		}
		if got.InTransaction() != want.InTransaction() {
			t.Fatalf("layout %s, message %x: InTransaction() = %v, want %v", l.name, msg, got.InTransaction(), want.InTransaction())
		}
	})
}

// TestDecodeInsertSeedsReachEveryPath guards FuzzDecodeInsert's seed corpus:
// it is only a proof if its messages reach the outcomes that matter.
func TestDecodeInsertSeedsReachEveryPath(t *testing.T) {
	layouts, msgs := refSeeds()
	want := []string{
		"row", "aggregate", "expires_at", "ignored",
		"is NULL", "unchanged-TOAST", "binary format", `"available_at" is unparsable`,
		`"aggregate_seq" is unparsable`, `"expires_at" is unparsable`,
		"tuple has", "message ends at column", "message ends in the length", "claims",
		"follow the last column", "unknown tuple data kind", "want 'N'", "never described",
		"no transaction is open", "has no column", "InsertMessage must have",
		"BeginMessage must have", "CommitMessage must have", "still open", "differs from",
	}
	seen := map[string]int{}
	for i, m := range msgs {
		d := NewDecoder(testOutboxTable)
		for _, s := range refLayouts[layouts[i]].setup() {
			d.Decode(s)
		}
		ev, ok, err := d.Decode(m)
		var out string
		switch {
		case err != nil:
			out = err.Error()
		case ok && ev.Row != nil:
			out = "row"
			if ev.Row.Aggregate != nil {
				out += " aggregate"
			}
			if !ev.Row.ExpiresAt.IsZero() {
				out += " expires_at"
			}
		case !ok:
			out = "ignored"
		}
		for _, w := range want {
			if strings.Contains(out, w) {
				seen[w]++
			}
		}
	}
	for _, w := range want {
		if seen[w] == 0 {
			t.Errorf("no seed gives %q", w)
		}
	}
	t.Logf("%d seeds", len(msgs))
}
