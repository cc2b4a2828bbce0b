package wire_test

import (
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/wire"
)

var created = time.Date(2026, 12, 7, 12, 0, 0, 123456000, time.UTC)

func ceRow(payload string, headers string) wire.Row {
	r := wire.Row{WorkID: "order-103-ack", Kind: "order.received", Payload: []byte(payload), CreatedAt: created}
	if headers != "" {
		r.Headers = []byte(headers)
	}
	return r
}

// A row that cannot be a valid CloudEvent is that row's refusal
// (invalid_event), with what to fix; the same row is fine in the relay's
// own format, where none of it matters.
func TestCloudEventsRefusals(t *testing.T) {
	for _, c := range []struct {
		name string
		row  wire.Row
		want string
	}{
		{"reserved attribute", ceRow(`{}`, `{"ce-id": "other"}`), "the id attribute is the relay's (from the row: work_id)"},
		{"reserved specversion", ceRow(`{}`, `{"ce-specversion": "0.3"}`), "the specversion attribute is the relay's"},
		{"extension name with upper case", ceRow(`{}`, `{"ce-Tenant": "acme"}`), "not a CloudEvents extension name"},
		{"extension name too long", ceRow(`{}`, `{"ce-abcdefghijklmnopqrstu": "x"}`), "not a CloudEvents extension name"},
		{"data as an extension", ceRow(`{}`, `{"ce-data": "x"}`), "not a CloudEvents extension name"},
		{"empty extension", ceRow(`{}`, `{"ce-tenant": ""}`), "may not be empty"},
		{"content type not a media type", ceRow(`{}`, `{"Content-Type": "protobuf please"}`), "is not a media type"},
		{"two content types", ceRow(`{}`, `{"Content-Type": "application/json", "content-type": "text/plain"}`), "both set the content type"},
		{"created_at past RFC 3339", func() wire.Row {
			r := ceRow(`{}`, "")
			r.CreatedAt = time.Date(10001, 1, 1, 0, 0, 0, 0, time.UTC)
			return r
		}(), "the CloudEvents time attribute is created_at"},
	} {
		for _, mode := range []wire.Mode{wire.ModeCloudEvents, wire.ModeCloudEventsStructured} {
			f := wire.Format{SubjectPrefix: "outbox.", Mode: mode, Source: "/test"}
			_, err := f.Build(c.row, nil)
			re, ok := wire.IsRejected(err)
			if !ok || re.Reason != wire.ReasonInvalidEvent || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%s, %s: %v; want rejected: invalid_event mentioning %q", c.name, mode, err, c.want)
			}
		}
		if c.name == "created_at past RFC 3339" {
			continue // the relay's format carries no time
		}
		if _, err := (wire.Format{SubjectPrefix: "outbox.", Source: "/test"}).Build(c.row, nil); err != nil {
			t.Errorf("%s in the outbox format: %v; want it published as before", c.name, err)
		}
	}
}

// The envelope keeps the payload's bytes for every reader: JSON data only
// for a JSON content type and a JSON text without surrounding whitespace,
// base64 otherwise.
func TestStructuredEnvelopeData(t *testing.T) {
	f := wire.Format{SubjectPrefix: "outbox.", Mode: wire.ModeCloudEventsStructured, Source: "/outbox-relay/shop/public.outbox"}
	for _, c := range []struct {
		name    string
		row     wire.Row
		base64  bool
		wantCT  string
		wantSeq string
	}{
		{"jsonb", ceRow(`{"a": 1}`, ""), false, "application/json", ""},
		{"json with spacing inside", ceRow(`{"b":1,  "a":[2, 3]}`, ""), false, "application/json", ""},
		{"json with a leading space", ceRow(` {"a":1}`, ""), true, "application/json", ""},
		{"a +json type", ceRow(`{"a":1}`, `{"Content-Type": "application/vnd.shop+json"}`), true, "application/vnd.shop+json", ""},
		{"bytea", func() wire.Row { r := ceRow("\x08\x96\x01\xff", ""); r.Binary = true; return r }(), true, "application/octet-stream", ""},
		{"bytea holding JSON", func() wire.Row {
			r := ceRow(`{"a":1}`, `{"Content-Type": "application/json; charset=utf-8"}`)
			r.Binary = true
			return r
		}(), false, "application/json; charset=utf-8", ""},
		{"aggregate", func() wire.Row {
			r := ceRow(`{}`, "")
			r.AggregateType, r.AggregateID, r.AggregateSeq = "order", "103", 42
			return r
		}(), false, "application/json", "0000000000000000042"},
	} {
		m, err := f.Build(c.row, nil)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := m.Header[wire.HeaderContentType]; len(got) != 1 || got[0] != wire.MediaCloudEventsJSON {
			t.Errorf("%s: Content-Type %v, want only %s", c.name, got, wire.MediaCloudEventsJSON)
		}
		var env map[string]json.RawMessage
		if err := json.Unmarshal(m.Data, &env); err != nil {
			t.Fatalf("%s: the envelope is not JSON: %v\n%s", c.name, err, m.Data)
		}
		str := func(k string) string {
			var s string
			_ = json.Unmarshal(env[k], &s)
			return s
		}
		if str("specversion") != "1.0" || str("id") != "order-103-ack" || str("type") != "order.received" ||
			str("source") != f.Source || str("time") != "2026-12-07T12:00:00.123456Z" || str("datacontenttype") != c.wantCT || str("sequence") != c.wantSeq {
			t.Errorf("%s: envelope %s", c.name, m.Data)
		}
		_, hasData := env["data"]
		b64, hasB64 := env["data_base64"]
		if hasData == hasB64 || hasB64 != c.base64 {
			t.Errorf("%s: data %v, data_base64 %v; want base64 %v\n%s", c.name, hasData, hasB64, c.base64, m.Data)
			continue
		}
		got := []byte(env["data"])
		if hasB64 {
			var s string
			_ = json.Unmarshal(b64, &s)
			if got, err = base64.StdEncoding.DecodeString(s); err != nil {
				t.Fatal(err)
			}
		}
		if string(got) != string(c.row.Payload) {
			t.Errorf("%s: the envelope carries %q, want the payload %q", c.name, got, c.row.Payload)
		}
	}
}

// Binary mode: the attributes as ce-* headers beside the relay's own, the
// data the payload itself.
func TestCloudEventsBinaryHeaders(t *testing.T) {
	f := wire.Format{SubjectPrefix: "outbox.", Mode: wire.ModeCloudEvents, Source: "https://shop.example/orders"}
	r := ceRow(`{"a":1}`, `{"ce-tenant": "acme", "traceparent": "00-abc-def-01"}`)
	r.AggregateType, r.AggregateID, r.AggregateSeq = "order", "103", 7
	m, err := f.Build(r, wire.SharedHeaders(map[string]string{wire.HeaderAttempt: "1"}))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"ce-specversion": "1.0", "ce-id": "order-103-ack", "ce-type": "order.received", "ce-source": f.Source,
		"ce-time": "2026-12-07T12:00:00.123456Z", "ce-datacontenttype": "application/json", "Content-Type": "application/json",
		"ce-partitionkey": "order/103", "ce-sequence": "0000000000000000007", "ce-tenant": "acme",
		"traceparent": "00-abc-def-01", wire.HeaderKind: "order.received", wire.HeaderAttempt: "1", wire.HeaderSequence: "7",
	}
	for k, v := range want {
		if got := m.Header[k]; len(got) != 1 || got[0] != v {
			t.Errorf("header %s: %v, want %q", k, got, v)
		}
	}
	if string(m.Data) != `{"a":1}` {
		t.Errorf("data %q, want the payload", m.Data)
	}
	if m.HeaderBytes != wire.HeaderBlockSize(r.WorkID, m.Header) {
		t.Errorf("HeaderBytes %d does not count the ce-* headers (%d)", m.HeaderBytes, wire.HeaderBlockSize(r.WorkID, m.Header))
	}
	// A bytea payload that is not UTF-8 is bytes, not a malformed text.
	b := ceRow("\xff\x00", "")
	b.Binary = true
	if _, err := f.Build(b, nil); err != nil {
		t.Errorf("bytea payload: %v", err)
	}
	b.Binary = false
	if _, err := f.Build(b, nil); err == nil {
		t.Errorf("the same bytes as jsonb text: published, want rejected: invalid_payload")
	}
}

func TestParseModeAndSource(t *testing.T) {
	for i, name := range wire.Modes {
		if m, err := wire.ParseMode(name); err != nil || int(m) != i || m.String() != name {
			t.Errorf("ParseMode(%q) = %v, %v", name, m, err)
		}
	}
	if _, err := wire.ParseMode("avro"); err == nil || !strings.Contains(err.Error(), "outbox, cloudevents, cloudevents-structured") {
		t.Errorf("ParseMode(avro): %v", err)
	}
	if got := wire.DefaultCloudEventsSource("shop db", "public.outbox"); got != "/outbox-relay/shop%20db/public.outbox" {
		t.Errorf("default source %q", got)
	}
	for _, bad := range []string{"", "a b ", "http://[::1"} {
		if (wire.Format{Mode: wire.ModeCloudEvents, Source: bad}).Validate() == nil {
			t.Errorf("source %q accepted", bad)
		}
	}
}
