package replication

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"
)

// encRelationPayload is encRelation with the payload column of type oid.
func encRelationPayload(id uint32, oid uint32, cols ...string) []byte {
	m := pgmsg{'R'}.u32(id).str("public").str("outbox").u8('d').u16(uint16(len(cols)))
	for _, c := range cols {
		t := encTypeOID(c)
		if c == "payload" {
			t = oid
		}
		var flags uint8
		if c == "work_id" {
			flags = 1
		}
		m = m.u8(flags).str(c).u32(t).u32(0xffffffff)
	}
	return m
}

func decodePayload(t *testing.T, oid uint32, text string) (*Row, error) {
	t.Helper()
	d := NewDecoder(testOutboxTable)
	decodeAllMsgs(d, [][]byte{encBegin(0x100, commitTime1, 7), encRelationPayload(testOutboxRelID, oid, testOutboxCols...)})
	vals := sampleOutboxVals("w-1")
	vals["payload"] = textVal(text)
	ev, ok, err := d.Decode(encRow(testOutboxRelID, testOutboxCols, vals))
	if err != nil {
		return nil, err
	}
	if !ok || ev.Row == nil {
		t.Fatalf("no row from %q", text)
	}
	return ev.Row, nil
}

// A bytea payload arrives as its hex text (bytea_output is pinned on the
// replication connection) and is published as the bytes; json's text and
// jsonb's are taken as they are.
func TestDecoderPayloadTypes(t *testing.T) {
	raw := []byte{0x08, 0x96, 0x01, 0x00, 0xff, '"', '\\'}
	row, err := decodePayload(t, byteaOID, `\x`+hex.EncodeToString(raw))
	if err != nil {
		t.Fatal(err)
	}
	if !row.Binary || !bytes.Equal(row.Payload, raw) {
		t.Errorf("bytea: binary %v payload %x, want the bytes %x", row.Binary, row.Payload, raw)
	}
	if string(row.Headers) != `{"traceparent": "00-abc-def-01"}` {
		t.Errorf("bytea: headers %q beside the decoded payload", row.Headers)
	}
	if row, err := decodePayload(t, byteaOID, `\x`); err != nil || row.Payload == nil || len(row.Payload) != 0 {
		t.Errorf("empty bytea: %v, %x; want an empty payload", err, row.Payload)
	}
	for _, oid := range []uint32{114, 3802} { // json, jsonb
		text := `{"b": 1,  "a":[2, 3]}`
		if row, err := decodePayload(t, oid, text); err != nil || row.Binary || string(row.Payload) != text {
			t.Errorf("type %d: %v, binary %v, payload %q; want the text as it is", oid, err, row != nil && row.Binary, row.Payload)
		}
	}
	for text, want := range map[string]string{
		`\001\002`: "in a form other than hex",
		`\x0`:      "odd length",
		`\xzz`:     "not bytea's hex text",
		`{"a": 1}`: "in a form other than hex",
		"":         "in a form other than hex",
	} {
		_, err := decodePayload(t, byteaOID, text)
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), `work_id "w-1"`) {
			t.Errorf("bytea text %q: %v; want a malformed row naming w-1 and %q", text, err, want)
		}
	}
}

// A bytea payload costs its hex decoding and nothing more: compare with
// BenchmarkDecodeInsert (the same row, jsonb).
func BenchmarkDecodeInsertBytea(b *testing.B) {
	d := NewDecoder(testOutboxTable)
	decodeAllMsgs(d, [][]byte{encBegin(0x100, commitTime1, 7), encRelationPayload(testOutboxRelID, byteaOID, testOutboxCols...)})
	vals := sampleOutboxVals("order-103-created")
	vals["payload"] = textVal(`\x` + hex.EncodeToString([]byte(`{"total": "42.50", "order_id": 103}`)))
	msg := encRow(testOutboxRelID, testOutboxCols, vals)
	b.SetBytes(int64(len(msg)))
	b.ReportAllocs()
	for b.Loop() {
		if _, ok, err := d.Decode(msg); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}
