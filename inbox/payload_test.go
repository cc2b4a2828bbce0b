package inbox_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// formatRows are rows as the relay reads them, one of each kind of payload
// that the formats carry differently.
var formatRows = []wire.Row{
	// jsonb's text, with an aggregate: "data" in a structured envelope.
	{WorkID: "json", Kind: "order.received", Payload: []byte(`{"order_id": 103, "total": "29.00"}`),
		AggregateType: "order", AggregateID: "103", AggregateSeq: 7},
	{WorkID: "null", Kind: "order.received", Payload: []byte(`null`)},
	// A json column keeps the producer's whitespace: data_base64.
	{WorkID: "spaced", Kind: "order.received", Payload: []byte(" {\"a\":1}\n")},
	// bytea: application/octet-stream, data_base64.
	{WorkID: "bytes", Kind: "order.received", Payload: []byte{0, 0xff, '{', '"', '\n', 0x80}, Binary: true},
	// bytea with the row's own content types.
	{WorkID: "text", Kind: "order.received", Payload: []byte(`héllo "x"`), Binary: true,
		Headers: []byte(`{"Content-Type": "text/plain; charset=utf-8", "ce-tenant": "acme"}`)},
	{WorkID: "binjson", Kind: "order.received", Payload: []byte(`{"b":[1,2]}`), Binary: true,
		Headers: []byte(`{"content-type": "application/json"}`)},
}

var modes = []wire.Mode{wire.ModeOutbox, wire.ModeCloudEvents, wire.ModeCloudEventsStructured}

// publishRow builds r in mode as the relay does (wire.Format) and
// publishes it with Nats-Msg-Id id, as the sink does; it returns whether
// the broker dropped it as a duplicate.
func (f *fixture) publishRow(r wire.Row, id string, mode wire.Mode) (dup bool) {
	f.t.Helper()
	r.WorkID = id
	r.CreatedAt = time.Date(2025, 3, 1, 12, 30, 0, 123456000, time.UTC)
	prefix := strings.TrimSuffix(f.subject, "order.received")
	m, err := wire.Format{SubjectPrefix: prefix, Mode: mode, Source: "/test"}.Build(r, nil)
	if err != nil {
		f.t.Fatalf("build %s in %s: %v", id, mode, err)
	}
	msg := &nats.Msg{Subject: m.Subject, Data: m.Data, Header: nats.Header{}}
	for k, vs := range m.Header {
		msg.Header[k] = append([]string(nil), vs...)
	}
	msg.Header.Set(jetstream.MsgIDHeader, m.ID)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := f.js.PublishMsg(ctx, msg)
	if err != nil {
		f.t.Fatalf("publish %s: %v", id, err)
	}
	return ack.Duplicate
}

// TestPayloadInEveryFormat: a row's message in each of the relay's three
// formats gives the handler the same Payload, the row's exact bytes, and the
// inbox records the same hash; the row delivered again in another format
// (--message-format changed between a publish and a republish) is a
// duplicate, not a conflict. Another payload under the same ID is still a
// conflict across formats.
func TestPayloadInEveryFormat(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{dupWindow: 100 * time.Millisecond, ackWait: 5 * time.Second})
	var rejections []inbox.Rejection
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.OnReject = func(r inbox.Rejection) { rejections = append(rejections, r) }
	})
	ctx := context.Background()

	type sent struct {
		row         wire.Row
		first, next wire.Mode
	}
	byID := map[string]sent{}
	var order []string
	for _, r := range formatRows {
		for _, a := range modes {
			for _, b := range modes {
				if a == b {
					continue
				}
				id := fmt.Sprintf("%s-%s-then-%s", r.WorkID, a, b)
				byID[id] = sent{r, a, b}
				order = append(order, id)
			}
		}
	}
	seen := map[string][]byte{}
	handler := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		p, err := inbox.Payload(msg)
		if err != nil {
			return fmt.Errorf("payload of %s: %w", id, err)
		}
		seen[id] = p
		if s := byID[id]; s.first == wire.ModeCloudEventsStructured {
			// The test reads an envelope here, not the payload itself.
			if ct := msg.Headers().Get("Content-Type"); ct != wire.MediaCloudEventsJSON || bytes.Equal(msg.Data(), p) {
				t.Errorf("%s: structured message with Content-Type %q and data %q", id, ct, msg.Data())
			}
		}
		return applyPayload(ctx, tx, id, p)
	}

	for _, id := range order {
		if f.publishRow(byID[id].row, id, byID[id].first) {
			t.Fatalf("%s: first publish dropped as a duplicate", id)
		}
	}
	for range order {
		msg := f.fetch(5 * time.Second)
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		out, err := in.Process(ctx, msg, handler)
		expect(t, id+" first delivery", out, inbox.Applied, err)
	}
	for _, id := range order {
		want := byID[id].row.Payload
		if got, ok := seen[id]; !ok || !bytes.Equal(got, want) {
			t.Errorf("%s: handler's Payload %q (seen %v), want %q", id, got, ok, want)
		}
		var sum []byte
		if err := f.pool.QueryRow(ctx, `SELECT payload_sha256 FROM inbox WHERE consumer = 'billing' AND message_id = $1`, id).Scan(&sum); err != nil {
			t.Fatal(err)
		}
		if want := sha256.Sum256(want); !bytes.Equal(sum, want[:]) {
			t.Errorf("%s: inbox hash %x, want sha256 of the payload %x", id, sum, want)
		}
	}

	// The same rows again, each in another format, after the duplicate
	// window: repeats.
	clear(seen)
	for _, id := range order {
		f.publishStoredRow(byID[id].row, id, byID[id].next)
	}
	for range order {
		msg := f.fetch(5 * time.Second)
		id := msg.Headers().Get(jetstream.MsgIDHeader)
		out, err := in.Process(ctx, msg, handler)
		expect(t, fmt.Sprintf("%s redelivered in %s", id, byID[id].next), out, inbox.Duplicate, err)
	}
	if len(seen) != 0 {
		t.Errorf("the handler ran for %d repeats", len(seen))
	}

	// Another payload under an ID already applied, in another format: a
	// conflict.
	forged := formatRows[0]
	forged.Payload = []byte(`{"order_id": 103, "total": "0.01"}`)
	f.publishStoredRow(forged, order[0], wire.ModeCloudEventsStructured)
	out, err := in.Process(ctx, f.fetch(5*time.Second), handler)
	expect(t, "another payload in another format", out, inbox.Rejected, err)
	if len(rejections) != 1 || rejections[0].Reason != "payload_mismatch" {
		t.Errorf("rejections %+v", rejections)
	}
	f.requireEffects(len(order), len(order))
	f.requireSettled()
	if s := in.Stats(); s.Applied != uint64(len(order)) || s.Duplicates != uint64(len(order)) || s.Rejected != 1 {
		t.Errorf("stats %+v", s)
	}
}

// applyPayload records one effect with the payload's bytes in hex (a
// payload need not be text).
func applyPayload(ctx context.Context, tx pgx.Tx, id string, p []byte) error {
	_, err := tx.Exec(ctx, `INSERT INTO effects (msg_id, data) VALUES ($1, encode($2::bytea, 'hex'))`, id, p)
	return err
}

func (f *fixture) publishStoredRow(r wire.Row, id string, mode wire.Mode) {
	f.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for f.publishRow(r, id, mode) {
		if time.Now().After(deadline) {
			f.t.Fatalf("publish %s: still dropped as a duplicate after 30s", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestPayloadOfEnvelopes: Payload reads structured events it did not
// build (media type parameters, another header spelling, data as a JSON
// string of a text type, no data), and Process terminates a message whose
// envelope it cannot read, as malformed_event, without running the handler.
func TestPayloadOfEnvelopes(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureOpts{})
	var reasons []string
	in := f.newInbox(f.pool, func(c *inbox.Config) {
		c.OnReject = func(r inbox.Rejection) { reasons = append(reasons, r.Reason) }
	})
	ctx := context.Background()
	var got []byte
	handler := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		p, err := inbox.Payload(msg)
		if err != nil {
			return err
		}
		got = p
		return applyPayload(ctx, tx, msg.Headers().Get(jetstream.MsgIDHeader), p)
	}
	const head = `{"specversion":"1.0","id":"x","source":"/s","type":"t"`
	for i, c := range []struct {
		header, ct, data string
		want             string // payload; "!" for malformed_event
	}{
		{"Content-Type", "application/cloudevents+json; charset=utf-8", head + `,"data_base64":"aMOpbGxv"}`, "héllo"},
		{"content-type", "Application/CloudEvents+JSON", head + `,"data": {"a": [1, 2]} }`, `{"a": [1, 2]}`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"datacontenttype":"text/plain","data":"h\u00e9 \"x\""}`, `hé "x"`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"datacontenttype":"application/vnd.x+json","data":"{\"s\":1}"}`, `{"s":1}`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"datacontenttype":"application/vnd.x+json","data":{"s": 1}}`, `{"s": 1}`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"datacontenttype":"application/json; charset=utf-8","data":"s"}`, `"s"`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"data":null}`, `null`},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `}`, ``},
		// Not an envelope: the data is the payload.
		{"Content-Type", "application/json", `{"specversion":"1.0","data":1}`, `{"specversion":"1.0","data":1}`},
		{"Content-Type", wire.MediaCloudEventsJSON, `not json`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, `[1]`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, `null`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, `{"id":"x","data":1}`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, `{"specversion":"0.3","data":1}`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"data":1,"data_base64":"AA=="}`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"data_base64":"!!"}`, "!"},
		{"Content-Type", wire.MediaCloudEventsJSON, head + `,"data_base64":1}`, "!"},
	} {
		got = nil
		id := fmt.Sprintf("envelope-%d", i)
		f.publish(id, c.data, map[string]string{c.header: c.ct})
		msg := f.fetch(5 * time.Second)
		if _, ok := msg.Headers()[c.header]; !ok {
			t.Fatalf("%s: header %q arrived as %v", id, c.header, msg.Headers())
		}
		out, err := in.Process(ctx, msg, handler)
		if c.want == "!" {
			expect(t, id+" "+c.data, out, inbox.Rejected, err)
			if reasons[len(reasons)-1] != "malformed_event" || got != nil {
				t.Errorf("%s: reasons %v, handler saw %q", id, reasons, got)
			}
			continue
		}
		expect(t, id+" "+c.data, out, inbox.Applied, err)
		if string(got) != c.want {
			t.Errorf("%s %s: payload %q, want %q", id, c.data, got, c.want)
		}
	}
	f.requireSettled()
}
