package replication

import (
	"bufio"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
)

// A pgoutput proto_version 1 encoder, written from
// https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html
// so that tests state their input message by message.

var testPGEpoch = time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)

type pgmsg []byte

func (m pgmsg) u8(v uint8) pgmsg     { return append(m, v) }
func (m pgmsg) u16(v uint16) pgmsg   { return binary.BigEndian.AppendUint16(m, v) }
func (m pgmsg) u32(v uint32) pgmsg   { return binary.BigEndian.AppendUint32(m, v) }
func (m pgmsg) u64(v uint64) pgmsg   { return binary.BigEndian.AppendUint64(m, v) }
func (m pgmsg) str(s string) pgmsg   { return append(append(m, s...), 0) }
func (m pgmsg) ts(t time.Time) pgmsg { return m.u64(uint64(t.Sub(testPGEpoch).Microseconds())) }

func encBegin(finalLSN pglogrepl.LSN, commitTime time.Time, xid uint32) []byte {
	return pgmsg{'B'}.u64(uint64(finalLSN)).ts(commitTime).u32(xid)
}

func encCommit(commitLSN, endLSN pglogrepl.LSN, commitTime time.Time) []byte {
	return pgmsg{'C'}.u8(0).u64(uint64(commitLSN)).u64(uint64(endLSN)).ts(commitTime)
}

// typeOID gives columns the types the outbox schema has, so that encoded
// Relation messages look like a server's.
func encTypeOID(col string) uint32 {
	switch {
	case col == "payload" || col == "headers":
		return 3802 // jsonb
	case strings.HasSuffix(col, "_at") || col == "lease_until":
		return 1184 // timestamptz
	case col == "attempts":
		return 23 // int4
	case col == "claim_generation" || col == "stream_seq" || col == "id":
		return 20 // int8
	}
	return 25 // text
}

func encRelation(id uint32, ns, name string, cols ...string) []byte {
	m := pgmsg{'R'}.u32(id).str(ns).str(name).u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		var flags uint8
		if c == "work_id" || c == "id" {
			flags = 1 // part of the replica identity key
		}
		m = m.u8(flags).str(c).u32(encTypeOID(c)).u32(0xffffffff)
	}
	return m
}

// val is one TupleData column: kind 'n' (NULL), 'u' (unchanged TOAST), 't'
// (text) or 'b' (binary).
type tupleVal struct {
	kind byte
	data string
}

func textVal(s string) tupleVal { return tupleVal{kind: 't', data: s} }

var (
	nullVal  = tupleVal{kind: 'n'}
	toastVal = tupleVal{kind: 'u'}
)

func (m pgmsg) tuple(vals []tupleVal) pgmsg {
	m = m.u16(uint16(len(vals)))
	for _, v := range vals {
		m = m.u8(v.kind)
		if v.kind == 't' || v.kind == 'b' {
			m = append(m.u32(uint32(len(v.data))), v.data...)
		}
	}
	return m
}

func encInsert(id uint32, vals ...tupleVal) []byte { return pgmsg{'I'}.u32(id).u8('N').tuple(vals) }
func encUpdate(id uint32, vals ...tupleVal) []byte { return pgmsg{'U'}.u32(id).u8('N').tuple(vals) }
func encDelete(id uint32, key ...tupleVal) []byte  { return pgmsg{'D'}.u32(id).u8('K').tuple(key) }

func encTruncate(ids ...uint32) []byte {
	m := pgmsg{'T'}.u32(uint32(len(ids))).u8(0)
	for _, id := range ids {
		m = m.u32(id)
	}
	return m
}

func encType(oid uint32, ns, name string) []byte { return pgmsg{'Y'}.u32(oid).str(ns).str(name) }

func encOrigin(lsn pglogrepl.LSN, name string) []byte { return pgmsg{'O'}.u64(uint64(lsn)).str(name) }

func encMessage(transactional bool, lsn pglogrepl.LSN, prefix, content string) []byte {
	var flags uint8
	if transactional {
		flags = 1
	}
	return append(pgmsg{'M'}.u8(flags).u64(uint64(lsn)).str(prefix).u32(uint32(len(content))), content...)
}

// The outbox table as the relay's migrations create it.
var testOutboxCols = []string{
	"work_id", "kind", "subject", "payload", "headers", "state", "created_at", "available_at",
	"attempts", "claim_generation", "claimed_by", "lease_until", "published_at", "stream_seq",
	"last_error", "redriven_at", "redriven_by", "redrive_reason",
}

const testOutboxRelID = 16384

var testOutboxTable = Table{Schema: "public", Name: "outbox"}

// encRow encodes an insert of vals (by column name, NULL where absent) into a
// relation whose columns are cols.
func encRow(id uint32, cols []string, vals map[string]tupleVal) []byte {
	tuple := make([]tupleVal, len(cols))
	for i, c := range cols {
		v, ok := vals[c]
		if !ok {
			v = nullVal
		}
		tuple[i] = v
	}
	return encInsert(id, tuple...)
}

func sampleOutboxVals(workID string) map[string]tupleVal {
	return map[string]tupleVal{
		"work_id":          textVal(workID),
		"kind":             textVal("order.created"),
		"subject":          textVal("orders.103"),
		"payload":          textVal(`{"total": "42.50", "order_id": 103}`),
		"headers":          textVal(`{"traceparent": "00-abc-def-01"}`),
		"state":            textVal("pending"),
		"created_at":       textVal("2026-11-30 05:04:40.5+00"),
		"available_at":     textVal("2026-11-30 05:04:42.123456+00"),
		"attempts":         textVal("0"),
		"claim_generation": textVal("0"),
	}
}

func withCol(vals map[string]tupleVal, col string, v tupleVal) map[string]tupleVal {
	vals[col] = v
	return vals
}

func sampleOutboxRow(workID string) *Row {
	return &Row{
		WorkID:      workID,
		Kind:        "order.created",
		Subject:     "orders.103",
		Payload:     []byte(`{"total": "42.50", "order_id": 103}`),
		Headers:     []byte(`{"traceparent": "00-abc-def-01"}`),
		State:       "pending",
		AvailableAt: time.Date(2026, 11, 30, 5, 4, 42, 123456000, time.UTC),
	}
}

var (
	commitTime1 = time.Date(2026, 11, 30, 5, 11, 50, 9037000, time.UTC)
	commitTime2 = time.Date(2026, 11, 30, 5, 11, 50, 11247000, time.UTC)
)

// eventString renders an event with every field, times with their location,
// and nil apart from empty, so that comparisons and failures show everything.
func decEventString(e Event) string {
	s := fmt.Sprintf("%s xid=%d commit_lsn=%s end_lsn=%s commit_time=%s", e.Type, e.Xid, e.CommitLSN, e.EndLSN, decTimeString(e.CommitTime))
	if r := e.Row; r != nil {
		s += fmt.Sprintf(" row={work_id=%q kind=%q subject=%q payload=%s headers=%s state=%q available_at=%s}",
			r.WorkID, r.Kind, r.Subject, decBytesString(r.Payload), decBytesString(r.Headers), r.State, decTimeString(r.AvailableAt))
	}
	return s
}

func decTimeString(t time.Time) string {
	return t.Format(time.RFC3339Nano) + "@" + t.Location().String()
}

func decBytesString(b []byte) string {
	if b == nil {
		return "nil"
	}
	return strconv.Quote(string(b))
}

func wantBegin(xid uint32, lsn pglogrepl.LSN, at time.Time) string {
	return decEventString(Event{Type: EventBegin, Xid: xid, CommitLSN: lsn, CommitTime: at})
}

func wantRow(xid uint32, lsn pglogrepl.LSN, at time.Time, r *Row) string {
	return decEventString(Event{Type: EventRow, Xid: xid, CommitLSN: lsn, CommitTime: at, Row: r})
}

func wantCommit(xid uint32, lsn, end pglogrepl.LSN, at time.Time) string {
	return decEventString(Event{Type: EventCommit, Xid: xid, CommitLSN: lsn, EndLSN: end, CommitTime: at})
}

// decodeAll decodes msgs in order and renders each event, and each error as
// "error: ...", so a test can state the whole stream it expects.
func decodeAllMsgs(d *Decoder, msgs [][]byte) []string {
	var got []string
	for _, m := range msgs {
		ev, ok, err := d.Decode(m)
		switch {
		case err != nil:
			if ok {
				got = append(got, "ok=true with error")
			}
			got = append(got, "error: "+err.Error())
		case ok:
			got = append(got, decEventString(ev))
		}
	}
	return got
}

func compareEventStrings(t *testing.T, got, want []string) {
	t.Helper()
	for i := range max(len(got), len(want)) {
		var g, w string
		if i < len(got) {
			g = got[i]
		}
		if i < len(want) {
			w = want[i]
		}
		if g != w {
			t.Errorf("event %d:\n got %s\nwant %s", i, g, w)
		}
	}
}

// readHexFixture reads one pgoutput message per line, in hex, skipping
// '#' comments and blank lines.
func readHexFixture(t testing.TB, name string) [][]byte {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var msgs [][]byte
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		m, err := hex.DecodeString(line)
		if err != nil {
			t.Fatalf("%s:%d: %v", name, n, err)
		}
		msgs = append(msgs, m)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return msgs
}

const missingPayloadErrText = `outbox table "public"."outbox" has no column "payload" (the relay reads work_id, kind, subject, payload, headers, state, available_at): restore it or run outbox-relay migrate`

// TestDecodeFixtures replays streams captured from PostgreSQL 15 (see the
// comments in each file for the SQL that produced them).
func TestDecodeFixtures(t *testing.T) {
	commit3 := time.Date(2026, 11, 30, 5, 11, 57, 668938000, time.UTC)
	commit4 := time.Date(2026, 11, 30, 5, 11, 57, 672558000, time.UTC)
	commit5 := time.Date(2026, 11, 30, 5, 11, 57, 872022000, time.UTC)
	tests := []struct {
		file string
		want []string
	}{
		{
			file: "order103.hex",
			want: []string{
				wantBegin(728, 0x15451B0, commitTime1),
				wantRow(728, 0x15451B0, commitTime1, &Row{
					WorkID:      "order-103-created",
					Kind:        "order.created",
					Subject:     "orders.103",
					Payload:     []byte(`{"note": "café \"x\"", "total": "42.50", "order_id": 103}`),
					Headers:     []byte(`{"traceparent": "00-abc-def-01"}`),
					State:       "pending",
					AvailableAt: time.Date(2026, 11, 30, 5, 4, 42, 123456000, time.UTC),
				}),
				wantRow(728, 0x15451B0, commitTime1, &Row{
					WorkID:      "order-103-audit",
					Kind:        "audit",
					Payload:     []byte(`[1, 2, {"a": true, "b": null}]`),
					State:       "pending",
					AvailableAt: time.Date(2026, 11, 30, 5, 4, 42, 0, time.UTC),
				}),
				wantCommit(728, 0x15451B0, 0x15451E0, commitTime1),
				wantBegin(729, 0x1545428, commitTime2),
				wantRow(729, 0x1545428, commitTime2, &Row{
					WorkID:      "order-103-later",
					Kind:        "order.reminder",
					Payload:     []byte(`{}`),
					State:       "pending",
					AvailableAt: Infinity,
				}),
				wantCommit(729, 0x1545428, 0x1545458, commitTime2),
			},
		},
		{
			file: "schema_change.hex",
			want: []string{
				wantBegin(730, 0x1545558, commit3),
				wantRow(730, 0x1545558, commit3, &Row{
					WorkID:      "order-104-created",
					Kind:        "order.created",
					Subject:     "orders.104",
					Payload:     []byte(`{"order_id": 104}`),
					State:       "pending",
					AvailableAt: NegInfinity,
				}),
				wantCommit(730, 0x1545558, 0x1545588, commit3),
				wantBegin(734, 0x1546170, commit4),
				wantRow(734, 0x1546170, commit4, &Row{
					WorkID:      "order-105-paid",
					Kind:        "order.paid",
					Subject:     "orders.105",
					Payload:     []byte(`{"order_id": 105}`),
					Headers:     []byte(`{"k": ["v"]}`),
					State:       "pending",
					AvailableAt: time.Date(2026, 12, 1, 0, 0, 0, 500000000, time.UTC),
				}),
				wantCommit(734, 0x1546170, 0x15461A0, commit4),
			},
		},
		{
			file: "dropped_payload.hex",
			want: []string{
				wantBegin(736, 0x1546550, commit5),
				"error: " + missingPayloadErrText,
				"error: decode insert in xid 736: " + missingPayloadErrText,
				wantCommit(736, 0x1546550, 0x1546580, commit5),
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.file, func(t *testing.T) {
			d := NewDecoder(testOutboxTable)
			got := decodeAllMsgs(d, readHexFixture(t, tt.file))
			compareEventStrings(t, got, tt.want)
			if d.InTransaction() {
				t.Errorf("InTransaction() = true after the last commit")
			}
		})
	}
}

func TestDecodeColumnsByName(t *testing.T) {
	cols := []string{"trace_id", "available_at", "headers", "tenant", "state", "payload", "subject", "kind", "work_id", "priority"}
	vals := withCol(withCol(sampleOutboxVals("w-1"), "trace_id", textVal("t-1")), "tenant", textVal("acme"))
	vals["priority"] = textVal("7")
	d := NewDecoder(testOutboxTable)
	got := decodeAllMsgs(d, [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRelation(testOutboxRelID, "public", "outbox", cols...),
		encRow(testOutboxRelID, cols, vals),
		encCommit(0x100, 0x130, commitTime1),
	})
	want := []string{
		wantBegin(7, 0x100, commitTime1),
		wantRow(7, 0x100, commitTime1, sampleOutboxRow("w-1")),
		wantCommit(7, 0x100, 0x130, commitTime1),
	}
	compareEventStrings(t, got, want)
}

func TestDecodeNullSubjectAndHeaders(t *testing.T) {
	vals := withCol(withCol(sampleOutboxVals("w-1"), "subject", nullVal), "headers", nullVal)
	d := NewDecoder(testOutboxTable)
	got := decodeAllMsgs(d, [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
		encRow(testOutboxRelID, testOutboxCols, vals),
	})
	want := sampleOutboxRow("w-1")
	want.Subject = ""
	want.Headers = nil
	compareEventStrings(t, got, []string{wantBegin(7, 0x100, commitTime1), wantRow(7, 0x100, commitTime1, want)})
}

func TestDecodeRelationChange(t *testing.T) {
	added := append([]string{"priority"}, testOutboxCols...)
	reordered := []string{"payload", "work_id", "priority", "state", "available_at", "kind", "headers", "subject"}
	d := NewDecoder(testOutboxTable)
	got := decodeAllMsgs(d, [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
		encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")),
		encCommit(0x100, 0x130, commitTime1),
		// ALTER TABLE ... ADD COLUMN: the new column comes first here so that
		// every position shifts.
		encBegin(0x200, commitTime2, 8),
		encRelation(testOutboxRelID, "public", "outbox", added...),
		encRow(testOutboxRelID, added, withCol(sampleOutboxVals("w-2"), "priority", textVal("1"))),
		encCommit(0x200, 0x230, commitTime2),
		// Columns dropped and re-added in another order, described mid-transaction
		// as pgoutput does before the first change that needs it.
		encBegin(0x300, commitTime2, 9),
		encRow(testOutboxRelID, added, withCol(sampleOutboxVals("w-3"), "priority", textVal("1"))),
		encRelation(testOutboxRelID, "public", "outbox", reordered...),
		encRow(testOutboxRelID, reordered, withCol(sampleOutboxVals("w-4"), "priority", textVal("1"))),
		encCommit(0x300, 0x330, commitTime2),
	})
	want := []string{
		wantBegin(7, 0x100, commitTime1),
		wantRow(7, 0x100, commitTime1, sampleOutboxRow("w-1")),
		wantCommit(7, 0x100, 0x130, commitTime1),
		wantBegin(8, 0x200, commitTime2),
		wantRow(8, 0x200, commitTime2, sampleOutboxRow("w-2")),
		wantCommit(8, 0x200, 0x230, commitTime2),
		wantBegin(9, 0x300, commitTime2),
		wantRow(9, 0x300, commitTime2, sampleOutboxRow("w-3")),
		wantRow(9, 0x300, commitTime2, sampleOutboxRow("w-4")),
		wantCommit(9, 0x300, 0x330, commitTime2),
	}
	compareEventStrings(t, got, want)
}

func TestDecodeMissingColumn(t *testing.T) {
	for _, missing := range outboxFieldNames[:firstOptional] {
		t.Run(missing, func(t *testing.T) {
			var cols []string
			for _, c := range testOutboxCols {
				if c != missing {
					cols = append(cols, c)
				}
			}
			d := NewDecoder(testOutboxTable)
			if _, _, err := d.Decode(encBegin(0x100, commitTime1, 7)); err != nil {
				t.Fatal(err)
			}
			ev, ok, err := d.Decode(encRelation(testOutboxRelID, "public", "outbox", cols...))
			want := `outbox table "public"."outbox" has no column "` + missing + `" (the relay reads work_id, kind, subject, payload, headers, state, available_at): restore it or run outbox-relay migrate`
			if err == nil || err.Error() != want || ok || ev.Type != 0 {
				t.Fatalf("Decode(relation) = %v, %v, %v; want error %q", ev, ok, err, want)
			}
			// A caller that goes on must not get rows decoded with a broken mapping.
			_, ok, err = d.Decode(encRow(testOutboxRelID, cols, sampleOutboxVals("w-1")))
			if err == nil || !strings.Contains(err.Error(), want) || ok {
				t.Fatalf("Decode(insert) = %v, %v; want error containing %q", ok, err, want)
			}
			// Once the table is fixed (migrate), the next Relation message heals it.
			ev, ok, err = d.Decode(encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...))
			if err != nil || ok {
				t.Fatalf("Decode(fixed relation) = %v, %v, %v", ev, ok, err)
			}
			ev, ok, err = d.Decode(encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")))
			if err != nil || !ok {
				t.Fatalf("Decode(insert after fix) = %v, %v, %v", ev, ok, err)
			}
		})
	}

	t.Run("several", func(t *testing.T) {
		d := NewDecoder(testOutboxTable)
		_, _, err := d.Decode(encRelation(testOutboxRelID, "public", "outbox", "work_id", "kind", "subject", "state", "available_at"))
		want := `outbox table "public"."outbox" has no columns "payload", "headers" (the relay reads work_id, kind, subject, payload, headers, state, available_at): restore it or run outbox-relay migrate`
		if err == nil || err.Error() != want {
			t.Fatalf("got %v, want %q", err, want)
		}
	})

	t.Run("other table", func(t *testing.T) {
		d := NewDecoder(testOutboxTable)
		if _, _, err := d.Decode(encRelation(2, "public", "orders", "id", "status")); err != nil {
			t.Fatalf("a table that is not the outbox needs no outbox columns, got %v", err)
		}
	})
}

func TestDecodeOtherTablesIgnored(t *testing.T) {
	d := NewDecoder(testOutboxTable)
	got := decodeAllMsgs(d, [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRelation(2, "public", "orders", "id", "status"),
		encRelation(3, "audit", "outbox", testOutboxCols...),
		encRelation(4, "public", "Outbox", testOutboxCols...),
		encRelation(5, "public", "outbox_archive", testOutboxCols...),
		encInsert(2, textVal("103"), textVal("new")),
		encRow(3, testOutboxCols, sampleOutboxVals("audit-1")),
		encRow(4, testOutboxCols, sampleOutboxVals("upper-1")),
		// Not even a well-formed outbox row: other relations are not looked at.
		encInsert(5, nullVal),
		encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
		encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")),
		encInsert(2, textVal("104"), textVal("new")),
		encCommit(0x100, 0x130, commitTime1),
	})
	want := []string{
		wantBegin(7, 0x100, commitTime1),
		wantRow(7, 0x100, commitTime1, sampleOutboxRow("w-1")),
		wantCommit(7, 0x100, 0x130, commitTime1),
	}
	compareEventStrings(t, got, want)

	t.Run("renamed away", func(t *testing.T) {
		got := decodeAllMsgs(d, [][]byte{
			encBegin(0x200, commitTime2, 8),
			encRelation(testOutboxRelID, "public", "outbox_old", testOutboxCols...),
			encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-2")),
			encCommit(0x200, 0x230, commitTime2),
		})
		compareEventStrings(t, got, []string{wantBegin(8, 0x200, commitTime2), wantCommit(8, 0x200, 0x230, commitTime2)})
	})

	t.Run("default schema", func(t *testing.T) {
		d := NewDecoder(Table{Name: "outbox"})
		got := decodeAllMsgs(d, [][]byte{
			encBegin(0x100, commitTime1, 7),
			encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
			encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")),
		})
		compareEventStrings(t, got, []string{wantBegin(7, 0x100, commitTime1), wantRow(7, 0x100, commitTime1, sampleOutboxRow("w-1"))})
	})
}

func TestDecodeIgnoredMessages(t *testing.T) {
	d := NewDecoder(testOutboxTable)
	got := decodeAllMsgs(d, [][]byte{
		encMessage(false, 0x90, "relay", "outside any transaction"),
		encBegin(0x100, commitTime1, 7),
		encOrigin(0x5000, "upstream"),
		encType(16400, "public", "order_status"),
		encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
		encUpdate(testOutboxRelID, encRowVals(testOutboxCols, sampleOutboxVals("w-1"))...),
		encDelete(testOutboxRelID, textVal("w-1")),
		encTruncate(testOutboxRelID, 2),
		encMessage(true, 0x110, "relay", "hello"),
		encCommit(0x100, 0x130, commitTime1),
	})
	compareEventStrings(t, got, []string{wantBegin(7, 0x100, commitTime1), wantCommit(7, 0x100, 0x130, commitTime1)})
}

func encRowVals(cols []string, vals map[string]tupleVal) []tupleVal {
	out := make([]tupleVal, len(cols))
	for i, c := range cols {
		out[i] = nullVal
		if v, ok := vals[c]; ok {
			out[i] = v
		}
	}
	return out
}

func TestDecoderTransactionState(t *testing.T) {
	d := NewDecoder(testOutboxTable)
	steps := []struct {
		msg    []byte
		inTxn  bool
		wantOK bool
	}{
		{encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...), false, false},
		{encBegin(0x100, commitTime1, 7), true, true},
		{encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")), true, true},
		{encRow(testOutboxRelID, testOutboxCols, withCol(sampleOutboxVals("w-2"), "payload", nullVal)), true, false},
		{encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-3")), true, true},
		{encCommit(0x100, 0x130, commitTime1), false, true},
		{encBegin(0x200, commitTime2, 8), true, true},
		{encCommit(0x200, 0x230, commitTime2), false, true},
	}
	if d.InTransaction() {
		t.Fatal("InTransaction() = true before any message")
	}
	for i, s := range steps {
		ev, ok, _ := d.Decode(s.msg)
		if ok != s.wantOK {
			t.Errorf("step %d (%c): ok = %v, want %v", i, s.msg[0], ok, s.wantOK)
		}
		if got := d.InTransaction(); got != s.inTxn {
			t.Errorf("step %d (%c): InTransaction() = %v, want %v", i, s.msg[0], got, s.inTxn)
		}
		if ok && ev.Type != EventBegin && (ev.Xid == 0 || ev.CommitLSN == 0 || ev.CommitTime.IsZero()) {
			t.Errorf("step %d: event %s lacks its transaction's xid, lsn or time", i, decEventString(ev))
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	setup := [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...),
	}
	insert := func(col string, v tupleVal) [][]byte {
		return append(setup, encRow(testOutboxRelID, testOutboxCols, withCol(sampleOutboxVals("w-1"), col, v)))
	}
	full := encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1"))
	tests := []struct {
		name      string
		msgs      [][]byte // all but the last must decode without error
		want      string   // the last one's error
		malformed bool     // errors.Is(err, ErrMalformedRow)
	}{
		{"null payload", insert("payload", nullVal), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "payload" is NULL`, true},
		{"null work_id", insert("work_id", nullVal), `malformed outbox row in public.outbox, xid 7: column "work_id" is NULL`, true},
		{"null kind", insert("kind", nullVal), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "kind" is NULL`, true},
		{"null state", insert("state", nullVal), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "state" is NULL`, true},
		{"null available_at", insert("available_at", nullVal), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "available_at" is NULL`, true},
		{"unchanged toast", insert("payload", toastVal), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "payload" is an unchanged-TOAST placeholder, not a value`, true},
		{"binary", insert("kind", tupleVal{kind: 'b', data: "x"}), `malformed outbox row in public.outbox, xid 7, work_id "w-1": column "kind" is in binary format: start replication without binary mode`, true},
		{
			"bad timestamp", insert("available_at", textVal("2026-11-30T05:04:42Z")),
			`malformed outbox row in public.outbox, xid 7, work_id "w-1": column "available_at" is unparsable: "2026-11-30T05:04:42Z" is not a timestamptz in DateStyle ISO (like "2026-11-30 05:04:42.123456+00")`, true,
		},
		{"timestamp without zone", insert("available_at", textVal("2026-11-30 05:04:42")), `column "available_at" is unparsable: "2026-11-30 05:04:42" is not a timestamptz`, true},
		{"column count", append(setup, encInsert(testOutboxRelID, textVal("w-1"), textVal("k"))), `decode insert into public.outbox in xid 7: tuple has 2 columns, its relation message described 18`, false},
		{"insert outside transaction", [][]byte{setup[1], full}, `decode insert: no transaction is open`, false},
		{"unknown relation", [][]byte{setup[0], full}, `decode insert in xid 7: relation id 16384 was never described by a relation message`, false},
		{"truncated insert", append(setup, full[:len(full)-10]), `decode insert into public.outbox in xid 7: message ends in the length of column 9 of 18`, false},
		{"truncated value", append(setup, full[:len(full)-30]), `decode insert into public.outbox in xid 7: column 7 of 18 claims 29 bytes, the message has 19 left`, false},
		{"missing columns", append(setup, encInsert(testOutboxRelID, textVal("w-1"))[:8]), `decode insert into public.outbox in xid 7: message ends at column 0 of 1`, false},
		{"corrupt length", append(setup, append(pgmsg{'I'}.u32(testOutboxRelID).u8('N').u16(1).u8('t').u32(0xffffffff), "x"...)), `column 0 of 1 claims 4294967295 bytes, the message has 1 left`, false},
		{"trailing bytes", append(setup, append(full[:len(full):len(full)], 'n')), `decode insert into public.outbox in xid 7: 1 bytes follow the last column`, false},
		{"unknown kind", append(setup, encInsert(testOutboxRelID, tupleVal{kind: 'x'})), `column 0 of 1 has unknown tuple data kind 'x'`, false},
		{"not a new tuple", append(setup, append(pgmsg{'I'}.u32(testOutboxRelID).u8('K'), full[6:]...)), `decode insert into public.outbox in xid 7: tuple type 'K', want 'N'`, false},
		{"truncated relation", [][]byte{setup[1][:37]}, `truncated or corrupt`, false},
		{"short insert", append(setup, full[:3]), `decode pgoutput 'I' message: InsertMessage must have 8 bytes, got 2 bytes`, false},
		{"short begin", [][]byte{setup[0][:10]}, `decode pgoutput 'B' message: BeginMessage must have 20 bytes, got 9 bytes`, false},
		{"empty", [][]byte{{}}, `decode pgoutput message: empty message`, false},
		{"streaming", [][]byte{{'S', 0, 0, 0, 7, 1}}, `start replication with streaming off`, false},
		{"unknown type", [][]byte{{'Z', 1}}, `decode pgoutput 'Z' message: replication message not supported`, false},
		{"commit outside transaction", [][]byte{encCommit(0x100, 0x130, commitTime1)}, `decode commit at 0/100: no transaction is open`, false},
		{"nested begin", [][]byte{setup[0], encBegin(0x200, commitTime2, 8)}, `decode begin of xid 8: transaction xid 7 is still open`, false},
		{"commit lsn mismatch", [][]byte{setup[0], encCommit(0x200, 0x230, commitTime1)}, `decode commit of xid 7: commit lsn 0/200 differs from the 0/100 announced by its begin`, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := NewDecoder(testOutboxTable)
			last := len(tt.msgs) - 1
			for i, m := range tt.msgs[:last] {
				if _, _, err := d.Decode(m); err != nil {
					t.Fatalf("message %d: %v", i, err)
				}
			}
			ev, ok, err := d.Decode(tt.msgs[last])
			if err == nil {
				t.Fatalf("got %s, ok=%v, want an error containing %q", decEventString(ev), ok, tt.want)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("got error %q, want it to contain %q", err, tt.want)
			}
			if ok || ev.Row != nil || ev.Type != 0 {
				t.Errorf("got ok=%v event %s along with the error", ok, decEventString(ev))
			}
			if got := errors.Is(err, ErrMalformedRow); got != tt.malformed {
				t.Errorf("errors.Is(err, ErrMalformedRow) = %v, want %v", got, tt.malformed)
			}
		})
	}
}

func TestDecodeTimestamps(t *testing.T) {
	want := time.Date(2026, 11, 30, 5, 4, 42, 0, time.UTC)
	tests := []struct {
		in   string
		want time.Time
	}{
		{"2026-11-30 05:04:42.123456+00", want.Add(123456 * time.Microsecond)},
		{"2026-11-30 05:04:42+00", want},
		{"2026-11-30 05:04:42.1+00", want.Add(100 * time.Millisecond)},
		{"2026-11-30 05:04:42.000001+00", want.Add(time.Microsecond)},
		{"2026-11-30 10:34:42+05:30", want},
		{"2026-11-30 10:04:42+05", want},
		{"2026-11-29 23:04:42-06", want},
		{"2026-11-30 04:34:27-00:30:15", want},
		{"2026-11-30 20:04:42.5+15", want.Add(500 * time.Millisecond)},
		{"2026-11-30 21:04:41+15:59:59", want},
		{"2024-02-29 00:00:00+00", time.Date(2024, 2, 29, 0, 0, 0, 0, time.UTC)},
		{"2000-01-01 00:00:00+00", testPGEpoch},
		{"12026-11-30 05:04:42+00", time.Date(12026, 11, 30, 5, 4, 42, 0, time.UTC)},
		{"0044-03-15 12:00:00+00 BC", time.Date(-43, 3, 15, 12, 0, 0, 0, time.UTC)},
		{"0001-02-29 00:00:00+00 BC", time.Date(0, 2, 29, 0, 0, 0, 0, time.UTC)},
		{"infinity", Infinity},
		{"-infinity", NegInfinity},
	}
	for _, tt := range tests {
		got, err := parseTimestamptz([]byte(tt.in))
		if err != nil {
			t.Errorf("parseTimestamptz(%q): %v", tt.in, err)
			continue
		}
		if !got.Equal(tt.want) || got.Location() != time.UTC {
			t.Errorf("parseTimestamptz(%q) = %s, want %s", tt.in, decTimeString(got), decTimeString(tt.want))
		}
	}

	for _, in := range []string{
		"",
		"Infinity",
		"2026-11-30T05:04:42Z",
		"2026-11-30 05:04:42",
		"2026-11-30 05:04:42Z",
		"2026-11-30 05:04:42+0530",
		"2026-11-30 05:04:42.+00",
		"2026-11-30 05:04:42.1234567890+00",
		"2026-11-30 05:04:42+00 AD",
		"2026-11-30 05:04:42+00 ",
		" 2026-11-30 05:04:42+00",
		"026-11-30 05:04:42+00",
		"2026-13-01 00:00:00+00",
		"2026-00-01 00:00:00+00",
		"2026-11-31 00:00:00+00",
		"2023-02-29 00:00:00+00",
		"2026-11-30 24:00:00+00",
		"2026-11-30 05:60:00+00",
		"2026-11-30 05:04:60+00",
		"2026-11-30 05:04:42+16",
		"2026-11-30 05:04:42+05:60",
		"2026-11-30 05:04:42+05:30:60",
		"2026-11-30 05:04:42+05:",
		"2026-11-30 5:04:42+00",
		"2026/11/30 05:04:42+00",
	} {
		if got, err := parseTimestamptz([]byte(in)); err == nil {
			t.Errorf("parseTimestamptz(%q) = %s, want an error", in, decTimeString(got))
		}
	}
}

// TestDecodeRowOwnsItsBytes checks that rows stay intact however the caller
// reuses the message buffer or appends to a Row's slices.
func TestDecodeRowOwnsItsBytes(t *testing.T) {
	d := NewDecoder(testOutboxTable)
	decodeAllMsgs(d, [][]byte{encBegin(0x100, commitTime1, 7), encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...)})
	msg := encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1"))
	ev, ok, err := d.Decode(msg)
	if err != nil || !ok {
		t.Fatalf("Decode = %v, %v", ok, err)
	}
	for i := range msg {
		msg[i] = 'X'
	}
	// The next row must not reuse the first one's memory either.
	if _, _, err := d.Decode(encRow(testOutboxRelID, testOutboxCols, withCol(sampleOutboxVals("w-2"), "kind", textVal("other")))); err != nil {
		t.Fatal(err)
	}
	_ = append(ev.Row.Payload, "XXXXXXXX"...)
	_ = append(ev.Row.Headers, "XXXXXXXX"...)
	if got, want := decEventString(ev), wantRow(7, 0x100, commitTime1, sampleOutboxRow("w-1")); got != want {
		t.Errorf("after reuse:\n got %s\nwant %s", got, want)
	}
}

// FuzzDecoder feeds any message to a decoder inside an open transaction of
// the outbox table and checks what it returns, not only that it does not
// panic: the same event, or an error where pglogrepl's parser decoding the
// same bytes gives one (refDecode, as FuzzDecodeInsert does for Inserts); a
// row that is complete and belongs to the open transaction; and an event
// that owns its bytes (the caller reuses the message buffer).
func FuzzDecoder(f *testing.F) {
	for _, file := range []string{"order103.hex", "schema_change.hex", "dropped_payload.hex"} {
		for _, m := range readHexFixture(f, file) {
			f.Add(m)
		}
	}
	f.Add(encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("w-1")))
	f.Add(encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...))
	f.Add(encCommit(0x100, 0x130, commitTime1))
	f.Add(encCommit(0x200, 0x230, commitTime1))
	f.Add(encBegin(0x200, commitTime2, 8))
	f.Fuzz(func(t *testing.T, msg []byte) {
		setup := [][]byte{encBegin(0x100, commitTime1, 7), encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...)}
		d, ref := NewDecoder(testOutboxTable), NewDecoder(testOutboxTable)
		decodeAllMsgs(d, setup)
		decodeAllMsgs(ref, setup)
		buf := append([]byte{}, msg...)
		ev, ok, err := d.Decode(buf)
		if err != nil && ok {
			t.Fatalf("ok with error %v", err)
		}
		decoded := refEventString(ev)
		for i := range buf {
			buf[i] = 'X'
		}
		if again := refEventString(ev); again != decoded {
			t.Fatalf("message %x: the event changed when the caller reused the buffer:\n was %s\n now %s", msg, decoded, again)
		}
		wantEv, wantOK, wantErr := refDecode(ref, append([]byte{}, msg...))
		if (err == nil) != (wantErr == nil) || ok != wantOK || !reflect.DeepEqual(ev, wantEv) {
			t.Fatalf("message %x:\n got %s, ok=%v, err=%v\nwant %s, ok=%v, err=%v", msg, decoded, ok, err, refEventString(wantEv), wantOK, wantErr)
		}
		if d.InTransaction() != ref.InTransaction() {
			t.Fatalf("message %x: InTransaction() = %v, want %v", msg, d.InTransaction(), ref.InTransaction())
		}
		if ok && ev.Type == EventRow {
			if ev.Row == nil || ev.Row.Payload == nil {
				t.Fatalf("incomplete row event %s", decoded)
			}
			if ev.Xid != 7 || ev.CommitLSN != 0x100 || !ev.CommitTime.Equal(commitTime1) {
				t.Fatalf("row event %s, want it in the open transaction (xid 7, commit at 0/100)", decoded)
			}
		}
	})
}

func BenchmarkDecodeInsert(b *testing.B) {
	benchmarkDecodeInsert(b, testOutboxCols, sampleOutboxVals("order-103-created"))
}

// BenchmarkDecodeInsertOrdered decodes a row with an aggregate and a deadline
// (run --ordering aggregate), which costs no more allocations than one without.
func BenchmarkDecodeInsertOrdered(b *testing.B) {
	cols := append(append([]string{}, testOutboxCols...), "aggregate_type", "aggregate_id", "aggregate_seq", "expires_at")
	vals := sampleOutboxVals("order-103-created")
	vals["aggregate_type"], vals["aggregate_id"], vals["aggregate_seq"] = textVal("order"), textVal("103"), textVal("3")
	vals["expires_at"] = textVal("2026-12-01 10:00:00.5+01")
	benchmarkDecodeInsert(b, cols, vals)
}

func benchmarkDecodeInsert(b *testing.B, cols []string, vals map[string]tupleVal) {
	d := NewDecoder(testOutboxTable)
	for _, m := range [][]byte{encBegin(0x100, commitTime1, 7), encRelation(testOutboxRelID, "public", "outbox", cols...)} {
		if _, _, err := d.Decode(m); err != nil {
			b.Fatal(err)
		}
	}
	msg := encRow(testOutboxRelID, cols, vals)
	b.SetBytes(int64(len(msg)))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := d.Decode(msg); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}

// BenchmarkDecodeTransaction decodes the Begin, Insert and Commit of a
// one-row transaction, the common shape of an outbox write.
func BenchmarkDecodeTransaction(b *testing.B) {
	d := NewDecoder(testOutboxTable)
	if _, _, err := d.Decode(encRelation(testOutboxRelID, "public", "outbox", testOutboxCols...)); err != nil {
		b.Fatal(err)
	}
	msgs := [][]byte{
		encBegin(0x100, commitTime1, 7),
		encRow(testOutboxRelID, testOutboxCols, sampleOutboxVals("order-103-created")),
		encCommit(0x100, 0x130, commitTime1),
	}
	b.ReportAllocs()
	for b.Loop() {
		for _, m := range msgs {
			if _, ok, err := d.Decode(m); !ok || err != nil {
				b.Fatal(ok, err)
			}
		}
	}
}

// The aggregate and the deadline (migration 0006) decode when the table has
// them, and a row without them, or a table without them, is unordered and
// without a deadline.
func TestDecodeAggregateAndDeadline(t *testing.T) {
	cols := append(append([]string{}, testOutboxCols...), "aggregate_type", "aggregate_id", "aggregate_seq", "expires_at")
	d := NewDecoder(testOutboxTable)
	if _, _, err := d.Decode(encBegin(0x100, commitTime1, 7)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := d.Decode(encRelation(testOutboxRelID, "public", "outbox", cols...)); err != nil {
		t.Fatal(err)
	}
	vals := sampleOutboxVals("w-1")
	vals["aggregate_type"], vals["aggregate_id"], vals["aggregate_seq"] = textVal("order"), textVal("103"), textVal("3")
	vals["expires_at"] = textVal("2026-12-01 10:00:00.5+01")
	ev, ok, err := d.Decode(encRow(testOutboxRelID, cols, vals))
	if err != nil || !ok {
		t.Fatalf("Decode(row) = %v, %v, %v", ev, ok, err)
	}
	if a := ev.Row.Aggregate; a == nil || *a != (Aggregate{Type: "order", ID: "103", Seq: 3}) {
		t.Errorf("aggregate %+v, want order/103/3", a)
	}
	if want := time.Date(2026, 12, 1, 9, 0, 0, 500000000, time.UTC); !ev.Row.ExpiresAt.Equal(want) {
		t.Errorf("expires_at %v, want %v", ev.Row.ExpiresAt, want)
	}
	ev, _, err = d.Decode(encRow(testOutboxRelID, cols, sampleOutboxVals("w-2")))
	if err != nil || ev.Row.Aggregate != nil || !ev.Row.ExpiresAt.IsZero() {
		t.Fatalf("a row without them: %+v, %v", ev.Row, err)
	}
	vals["aggregate_seq"] = textVal("x")
	if _, _, err := d.Decode(encRow(testOutboxRelID, cols, vals)); !errors.Is(err, ErrMalformedRow) {
		t.Fatalf("unparsable aggregate_seq: %v, want ErrMalformedRow", err)
	}
}

// Every deadline PostgreSQL can hold decodes to one that compares with a
// clock as PostgreSQL's does (issue 20, item 1): '-infinity' and the
// instant that is time.Time's zero have passed, they are not "no deadline".
func TestDecodeDeadlineEdges(t *testing.T) {
	cols := append(append([]string{}, testOutboxCols...), "aggregate_type", "aggregate_id", "aggregate_seq", "expires_at")
	d := NewDecoder(testOutboxTable)
	if _, _, err := d.Decode(encBegin(0x100, commitTime1, 7)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := d.Decode(encRelation(testOutboxRelID, "public", "outbox", cols...)); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for _, tt := range []struct {
		in     string
		passed bool
	}{
		{"-infinity", true},
		{"0001-01-01 00:00:00+00", true},
		{"0001-01-01 00:00:00+00 BC", true},
		{"4713-11-24 00:00:00+00 BC", true},
		{"1970-01-01 00:00:00+00", true},
		{"9999-12-31 23:59:59.999999+00", false},
		{"12026-11-30 05:04:42+00", false},
		{"infinity", false},
	} {
		vals := sampleOutboxVals("w-" + tt.in)
		vals["expires_at"] = textVal(tt.in)
		ev, ok, err := d.Decode(encRow(testOutboxRelID, cols, vals))
		if err != nil || !ok {
			t.Fatalf("Decode(expires_at %q) = %v, %v", tt.in, ok, err)
		}
		exp := ev.Row.ExpiresAt
		if exp.IsZero() {
			t.Errorf("expires_at %q decoded as no deadline", tt.in)
			continue
		}
		if passed := !exp.After(now); passed != tt.passed {
			t.Errorf("expires_at %q decoded as %s: passed %v, want %v", tt.in, decTimeString(exp), passed, tt.passed)
		}
	}
}
