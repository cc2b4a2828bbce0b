package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// TestValidate: what is refused before the database, and that the message
// says what to fix.
func TestValidate(t *testing.T) {
	ok := outbox.Message{WorkID: "order-103-ack", Kind: "order.received", Payload: json.RawMessage(`{"a":1}`)}
	with := func(f func(m *outbox.Message)) outbox.Message {
		m := ok
		f(&m)
		return m
	}
	for _, tc := range []struct {
		name string
		m    outbox.Message
		want string // "" means valid
	}{
		{"valid", ok, ""},
		{"explicit subject", with(func(m *outbox.Message) { m.Subject = "shop.orders.103" }), ""},
		{"kind not a subject but subject set", with(func(m *outbox.Message) { m.Kind = "order received"; m.Subject = "shop.orders" }), ""},
		{"scalar payload", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`"text"`) }), ""},
		{"headers", with(func(m *outbox.Message) { m.Headers = map[string]string{"traceparent": "00-1-2-01", "X-Tenant": "a b"} }), ""},
		{"empty work_id", with(func(m *outbox.Message) { m.WorkID = "" }), "work_id is empty"},
		{"work_id with newline", with(func(m *outbox.Message) { m.WorkID = "a\nb" }), "control character"},
		{"work_id trailing space", with(func(m *outbox.Message) { m.WorkID = "col-x " }), "whitespace"},
		{"work_id trailing newline", with(func(m *outbox.Message) { m.WorkID = "col-x\n" }), "control character"},
		{"work_id leading tab", with(func(m *outbox.Message) { m.WorkID = "\tcol-x" }), "control character"},
		{"work_id blank", with(func(m *outbox.Message) { m.WorkID = " " }), "whitespace"},
		{"work_id 70 KB", with(func(m *outbox.Message) { m.WorkID = strings.Repeat("w", 70<<10) }), "over the 1024-byte limit"},
		{"work_id escape", with(func(m *outbox.Message) { m.WorkID = "x\x1b[2K" }), "control character"},
		{"work_id inner space", with(func(m *outbox.Message) { m.WorkID = "order 103" }), ""},
		{"kind with CRLF", with(func(m *outbox.Message) { m.Kind = "a\r\nb"; m.Subject = "shop.orders" }), "control character"},
		{"kind 70 KB", with(func(m *outbox.Message) { m.Kind = strings.Repeat("k", 70<<10); m.Subject = "shop.orders" }), "over the 256-byte limit"},
		{"subject JetStream API", with(func(m *outbox.Message) { m.Subject = "$JS.API.STREAM.DELETE.OUTBOX" }), "server's own namespace"},
		{"subject system", with(func(m *outbox.Message) { m.Subject = "$SYS.REQ.SERVER.PING" }), "server's own namespace"},
		{"subject inbox", with(func(m *outbox.Message) { m.Subject = "_INBOX.abc" }), "server's own namespace"},
		{"kind JetStream API", with(func(m *outbox.Message) { m.Kind = "$JS.API.INFO" }), "server's own namespace"},
		{"empty kind", with(func(m *outbox.Message) { m.Kind = "" }), "kind is empty"},
		{"kind with space", with(func(m *outbox.Message) { m.Kind = "order received" }), "cannot form the default subject"},
		{"kind wildcard", with(func(m *outbox.Message) { m.Kind = "order.>" }), "wildcard"},
		{"kind trailing dot", with(func(m *outbox.Message) { m.Kind = "order." }), "empty token"},
		{"subject space", with(func(m *outbox.Message) { m.Subject = "shop orders" }), "whitespace"},
		{"subject star", with(func(m *outbox.Message) { m.Subject = "shop.*.x" }), "wildcard"},
		{"subject gt", with(func(m *outbox.Message) { m.Subject = "shop.>" }), "wildcard"},
		{"subject double dot", with(func(m *outbox.Message) { m.Subject = "shop..x" }), "empty token"},
		{"subject leading dot", with(func(m *outbox.Message) { m.Subject = ".shop" }), "empty token"},
		{"empty payload", with(func(m *outbox.Message) { m.Payload = nil }), "payload is empty"},
		{"bad payload", with(func(m *outbox.Message) { m.Payload = json.RawMessage(`{"a":`) }), "not valid JSON"},
		{"payload that is not UTF-8", with(func(m *outbox.Message) { m.Payload = json.RawMessage("{\"a\":\"\xff\"}") }), "not valid UTF-8"},
		{"reserved Nats header", with(func(m *outbox.Message) { m.Headers = map[string]string{"Nats-Rollup": "all"} }), "reserved"},
		{"reserved Outbox header", with(func(m *outbox.Message) { m.Headers = map[string]string{"outbox-kind": "x"} }), "reserved"},
		{"header name colon", with(func(m *outbox.Message) { m.Headers = map[string]string{"a:b": "x"} }), "printable ASCII"},
		{"header name non-ASCII", with(func(m *outbox.Message) { m.Headers = map[string]string{"ümlaut": "x"} }), "printable ASCII"},
		{"header name control", with(func(m *outbox.Message) { m.Headers = map[string]string{"a\x01": "x"} }), "printable ASCII"},
		{"header value leading space", with(func(m *outbox.Message) { m.Headers = map[string]string{"a": " x"} }), "whitespace"},
		{"header value NUL", with(func(m *outbox.Message) { m.Headers = map[string]string{"a": "x\x00y"} }), "control character"},
		{"header value inner tab", with(func(m *outbox.Message) { m.Headers = map[string]string{"a": "x\ty"} }), ""},
		{"header name space", with(func(m *outbox.Message) { m.Headers = map[string]string{"a b": "x"} }), "without spaces"},
		{"empty header name", with(func(m *outbox.Message) { m.Headers = map[string]string{"": "x"} }), "1 to 256"},
		// ContentType (a media type) decides whether Validate checks the
		// payload as JSON; the table decides at Enqueue.
		{"protobuf", with(func(m *outbox.Message) {
			m.ContentType = "application/x-protobuf"
			m.Payload = []byte("\x08\x96\x01\xff")
		}), ""},
		{"protobuf, empty", with(func(m *outbox.Message) { m.ContentType = "application/x-protobuf"; m.Payload = nil }), ""},
		{"protobuf by header", with(func(m *outbox.Message) {
			m.Headers = map[string]string{"content-type": "application/x-protobuf"}
			m.Payload = []byte("\x08\x96\x01")
		}), ""},
		{"JSON content type, not JSON", with(func(m *outbox.Message) { m.ContentType = "application/json; charset=utf-8"; m.Payload = []byte("\x08") }), "not valid JSON"},
		{"+json content type, not JSON", with(func(m *outbox.Message) { m.ContentType = "application/vnd.shop+json"; m.Payload = []byte("{") }), "not valid JSON"},
		{"text/json content type, empty", with(func(m *outbox.Message) { m.ContentType = "text/json"; m.Payload = nil }), "payload is empty"},
		{"header not a media type, not JSON", with(func(m *outbox.Message) {
			m.Headers = map[string]string{"Content-Type": "protobuf please"}
			m.Payload = []byte("\x08")
		}), "not valid JSON"},
		{"content type not a media type", with(func(m *outbox.Message) { m.ContentType = "x-protobuf; =" }), "is not a media type"},
		{"content type without subtype", with(func(m *outbox.Message) { m.ContentType = "protobuf" }), "no subtype"},
		{"content type with newline", with(func(m *outbox.Message) { m.ContentType = "application/json\r\nX: y" }), "control character"},
		{"content type and header agree", with(func(m *outbox.Message) {
			m.ContentType = "application/json"
			m.Headers = map[string]string{"CONTENT-TYPE": "application/json"}
		}), ""},
		{"content type and header disagree", with(func(m *outbox.Message) {
			m.ContentType = "application/json"
			m.Headers = map[string]string{"content-type": "application/json; charset=utf-8"}
		}), "disagree"},
		{"header value newline", with(func(m *outbox.Message) { m.Headers = map[string]string{"a": "x\r\ny"} }), "control character"},
		// Times (issue 20, items 2 and 4): what RFC 3339 can write, as
		// migration 0008 refuses the rest at insert.
		{"deadline year 9999", with(func(m *outbox.Message) { m.ExpiresAt = time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC) }), ""},
		{"deadline year 10000", with(func(m *outbox.Message) { m.ExpiresAt = time.Date(10000, 1, 1, 0, 0, 0, 0, time.UTC) }), "ExpiresAt 10000-01-01T00:00:00Z is out of range"},
		{"deadline year 10000 in a zone", with(func(m *outbox.Message) {
			m.ExpiresAt = time.Date(9999, 12, 31, 23, 0, 0, 0, time.FixedZone("-02", -2*3600))
		}), "is out of range"},
		{"deadline BC", with(func(m *outbox.Message) { m.ExpiresAt = time.Date(-43, 3, 15, 0, 0, 0, 0, time.UTC) }), "ExpiresAt"},
		{"available year 12026", with(func(m *outbox.Message) { m.AvailableAt = time.Date(12026, 1, 1, 0, 0, 0, 0, time.UTC) }), "AvailableAt 12026"},
		{"available in a year", with(func(m *outbox.Message) { m.AvailableAt = time.Now().AddDate(1, 0, 0) }), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.m.Validate()
			if tc.want == "" {
				if err != nil {
					t.Fatalf("Validate: %v", err)
				}
				return
			}
			if !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate = %v, want ErrInvalid mentioning %q", err, tc.want)
			}
			// Enqueue refuses it without touching the database (nil would panic).
			if err := outbox.Enqueue(context.Background(), nil, tc.m); !errors.Is(err, outbox.ErrInvalid) {
				t.Fatalf("Enqueue = %v, want ErrInvalid", err)
			}
		})
	}
}
