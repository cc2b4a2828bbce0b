package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

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
		{"work_id with newline", with(func(m *outbox.Message) { m.WorkID = "a\nb" }), "line break"},
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
		{"reserved Nats header", with(func(m *outbox.Message) { m.Headers = map[string]string{"Nats-Rollup": "all"} }), "reserved"},
		{"reserved Outbox header", with(func(m *outbox.Message) { m.Headers = map[string]string{"outbox-kind": "x"} }), "reserved"},
		{"header name colon", with(func(m *outbox.Message) { m.Headers = map[string]string{"a:b": "x"} }), "may not be empty or hold ':'"},
		{"header name space", with(func(m *outbox.Message) { m.Headers = map[string]string{"a b": "x"} }), "whitespace"},
		{"empty header name", with(func(m *outbox.Message) { m.Headers = map[string]string{"": "x"} }), "may not be empty"},
		{"header value newline", with(func(m *outbox.Message) { m.Headers = map[string]string{"a": "x\r\ny"} }), "line breaks"},
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
