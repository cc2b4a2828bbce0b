package outbox_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// protobufPayload is a real Protobuf message's encoding (a Prometheus
// metric), bytes that are not JSON, nor UTF-8.
func protobufPayload(t *testing.T, value float64) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&dto.Metric{
		Label:       []*dto.LabelPair{{Name: proto.String("order"), Value: proto.String("103")}},
		Counter:     &dto.Counter{Value: proto.Float64(value)},
		TimestampMs: proto.Int64(1700000000000),
	})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// storedPayload reads a row's payload as bytes: bytea's own, json's and
// jsonb's text.
func storedPayload(t *testing.T, pool *pgxpool.Pool, ptype, workID string) []byte {
	t.Helper()
	col := "payload::text"
	if ptype == "bytea" {
		col = "payload"
	}
	var b []byte
	if err := pool.QueryRow(context.Background(), `SELECT `+col+` FROM outbox WHERE work_id = $1`, workID).Scan(&b); err != nil {
		t.Fatalf("read the payload of %s: %v", workID, err)
	}
	return b
}

// storedHeaders reads a row's headers column as an object.
func storedHeaders(t *testing.T, pool *pgxpool.Pool, workID string) map[string]string {
	t.Helper()
	var raw []byte
	if err := pool.QueryRow(context.Background(), `SELECT headers::text FROM outbox WHERE work_id = $1`, workID).Scan(&raw); err != nil {
		t.Fatalf("read the headers of %s: %v", workID, err)
	}
	var h map[string]string
	if raw != nil {
		if err := json.Unmarshal(raw, &h); err != nil {
			t.Fatalf("headers of %s: %q: %v", workID, raw, err)
		}
	}
	return h
}

// payloadCase is what a table of one payload type takes and stores.
type payloadCase struct {
	ptype string
	// given is a payload as the producer passes it, stored is what the
	// table holds of it (jsonb normalises), same is another payload of the
	// same intention, other one of a different intention.
	given, stored, same, other []byte
	contentType                string
}

func payloadCases(t *testing.T) []payloadCase {
	given := []byte(`{"b": 1,  "a":[2, 3]}`)
	return []payloadCase{
		// jsonb compares as JSON: other spacing and key order are the same.
		{ptype: "jsonb", given: given, stored: []byte(`{"a": [2, 3], "b": 1}`), same: []byte(`{"a":[2,3],"b":1}`),
			other: []byte(`{"b": 2,  "a":[2, 3]}`), contentType: "application/json"},
		// json is published byte for byte: other spacing is another message.
		{ptype: "json", given: given, stored: given, same: given, other: []byte(`{"a":[2,3],"b":1}`),
			contentType: "application/vnd.shop.order+json; charset=utf-8"},
		{ptype: "bytea", given: protobufPayload(t, 29), stored: protobufPayload(t, 29), same: protobufPayload(t, 29),
			other: protobufPayload(t, 31), contentType: "application/x-protobuf"},
	}
}

// TestPayloadTypes: for each payload column type (migrate --payload-type),
// plain and partitioned, Enqueue and EnqueueBatch store the payload as the
// type says (json and bytea byte for byte, jsonb normalised), put
// ContentType into the headers column, and tell a repeat of the same
// intention (ErrAlreadyEnqueued) from a different one (ErrConflict) by the
// column's own comparison.
func TestPayloadTypes(t *testing.T) {
	t.Parallel()
	for _, part := range []time.Duration{0, time.Hour} {
		for _, c := range payloadCases(t) {
			name := c.ptype
			if part > 0 {
				name += "/partitioned"
			}
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				testPayloadType(t, c, part)
			})
		}
	}
}

func testPayloadType(t *testing.T, c payloadCase, part time.Duration) {
	pool, qc, _ := newDBWith(t, table.Table{}, schema.MigrateOptions{PayloadType: c.ptype, PartitionInterval: part})
	ctx := context.Background()
	p, err := outbox.New()
	if err != nil {
		t.Fatal(err)
	}
	// The layout, payload type included, is one catalog query, and then
	// no enqueue asks again.
	before := qc.n.Load()
	if err := p.Prepare(ctx, pool); err != nil {
		t.Fatal(err)
	}
	if q := qc.n.Load() - before; q != 1 {
		t.Errorf("prepare took %d statements, want 1", q)
	}
	msg := func(id string, payload []byte) outbox.Message {
		return outbox.Message{WorkID: id, Kind: "order.received", Payload: payload, ContentType: c.contentType,
			Headers: map[string]string{"traceparent": "00-" + id + "-01"}}
	}

	// Enqueue.
	first := msg("one", c.given)
	before = qc.n.Load()
	if err := p.Enqueue(ctx, pool, first); err != nil {
		t.Fatalf("enqueue: %v", err)
	}
	if q := qc.n.Load() - before; q != 1 {
		t.Errorf("enqueue took %d statements, want 1", q)
	}
	if got := storedPayload(t, pool, c.ptype, "one"); !bytes.Equal(got, c.stored) {
		t.Errorf("stored payload %q, want %q", got, c.stored)
	}
	if h := storedHeaders(t, pool, "one"); h["Content-Type"] != c.contentType || h["traceparent"] != "00-one-01" || len(h) != 2 {
		t.Errorf("stored headers %v, want Content-Type %q and the traceparent", h, c.contentType)
	}
	if err := p.Enqueue(ctx, pool, msg("one", c.same)); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Errorf("same intention again: %v, want ErrAlreadyEnqueued", err)
	}
	err = p.Enqueue(ctx, pool, msg("one", c.other))
	var ce *outbox.ConflictError
	if !errors.As(err, &ce) || !errors.Is(err, outbox.ErrConflict) || strings.Join(ce.Differs, ",") != "payload" {
		t.Fatalf("different payload: %v, want ErrConflict on the payload", err)
	}
	if c.ptype == "bytea" {
		// The stored payload in the error is bytea's text: \x and hex.
		if want := fmt.Sprintf(`\x%x`, c.stored); ce.StoredPayload != want {
			t.Errorf("conflict's stored payload %q, want %q", ce.StoredPayload, want)
		}
	} else if ce.StoredPayload != string(c.stored) {
		t.Errorf("conflict's stored payload %q, want %q", ce.StoredPayload, c.stored)
	}
	if got := storedPayload(t, pool, c.ptype, "one"); !bytes.Equal(got, c.stored) {
		t.Errorf("payload after the repeats %q, want %q", got, c.stored)
	}

	// An aggregate's message goes through its own statement.
	ordered := msg("ordered", c.given)
	ordered.Aggregate = outbox.Aggregate{Type: "order", ID: "103"}
	if err := p.Enqueue(ctx, pool, ordered); err != nil {
		t.Fatalf("enqueue ordered: %v", err)
	}
	if got := storedPayload(t, pool, c.ptype, "ordered"); !bytes.Equal(got, c.stored) {
		t.Errorf("ordered: stored payload %q, want %q", got, c.stored)
	}
	if err := p.Enqueue(ctx, pool, ordered); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Errorf("ordered again: %v, want ErrAlreadyEnqueued", err)
	}

	// EnqueueBatch: two new ones, a repeat of each kind.
	batch := []outbox.Message{msg("two", c.given), msg("one", c.same), msg("three", c.other), msg("ordered", c.other)}
	before = qc.n.Load()
	res, err := p.EnqueueBatch(ctx, pool, batch)
	if q := qc.n.Load() - before; q != 2 {
		t.Errorf("batch with repeats took %d statements, want 2 (insert, compare)", q)
	}
	want := []outbox.Result{outbox.Inserted, outbox.AlreadyEnqueued, outbox.Inserted, outbox.Conflicted}
	if fmt.Sprint(res) != fmt.Sprint(want) {
		t.Errorf("batch results %v, want %v", res, want)
	}
	if !errors.As(err, &ce) || ce.Index != 3 || strings.Join(ce.Differs, ",") != "payload" {
		t.Errorf("batch error %v, want a payload conflict of message 3", err)
	}
	for id, want := range map[string][]byte{"one": c.stored, "two": c.stored, "three": storedForm(t, pool, c, c.other)} {
		if got := storedPayload(t, pool, c.ptype, id); !bytes.Equal(got, want) {
			t.Errorf("after the batch, %s: stored payload %q, want %q", id, got, want)
		}
		if h := storedHeaders(t, pool, id); h["Content-Type"] != c.contentType {
			t.Errorf("after the batch, %s: headers %v, want Content-Type %q", id, h, c.contentType)
		}
	}
	if n := countRows(t, pool, "outbox"); n != 4 {
		t.Errorf("%d rows, want 4", n)
	}
}

// storedForm is what the table makes of payload: jsonb's text of it, or
// the bytes themselves.
func storedForm(t *testing.T, pool *pgxpool.Pool, c payloadCase, payload []byte) []byte {
	t.Helper()
	if c.ptype != "jsonb" {
		return payload
	}
	var b []byte
	if err := pool.QueryRow(context.Background(), `SELECT $1::text::jsonb::text`, string(payload)).Scan(&b); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestPayloadTypeDecidesWhatIsValid: a payload that is not JSON is refused
// for a jsonb or json table, saying so, whatever its ContentType, and
// taken as it is by a bytea table, empty too; there a ContentType that says
// JSON still asks for JSON.
func TestPayloadTypeDecidesWhatIsValid(t *testing.T) {
	t.Parallel()
	notJSON := []byte("\x08\x96\x01{\xff\x00")
	for _, ptype := range []string{"jsonb", "json", "bytea"} {
		t.Run(ptype, func(t *testing.T) {
			t.Parallel()
			pool, qc, _ := newDBWith(t, table.Table{}, schema.MigrateOptions{PayloadType: ptype})
			ctx := context.Background()
			msgs := []outbox.Message{
				{WorkID: "bad-json", Kind: "k", Payload: []byte(`{"a":`)},
				{WorkID: "protobuf", Kind: "k", Payload: notJSON, ContentType: "application/x-protobuf"},
				{WorkID: "no-type", Kind: "k", Payload: notJSON},
				{WorkID: "empty", Kind: "k", Payload: nil, ContentType: "application/x-protobuf"},
			}
			if ptype == "bytea" {
				// The first enqueue of a payload that is not JSON reads the
				// table's type: one catalog query, once.
				before := qc.n.Load()
				for i, m := range msgs {
					if err := outbox.Enqueue(ctx, pool, m); err != nil {
						t.Fatalf("enqueue %s: %v", m.WorkID, err)
					}
					if got := storedPayload(t, pool, ptype, m.WorkID); !bytes.Equal(got, m.Payload) || got == nil {
						t.Errorf("%s: stored %q, want %q", m.WorkID, got, m.Payload)
					}
					if i == 0 {
						if q := qc.n.Load() - before; q != 3 {
							t.Errorf("first enqueue and read back took %d statements, want 3 (layout, insert, read)", q)
						}
					}
				}
				if q := qc.n.Load() - before; q != 1+2*int64(len(msgs)) {
					t.Errorf("%d enqueues and read backs took %d statements, want %d", len(msgs), q, 1+2*len(msgs))
				}
				// Again in a batch, as new rows.
				for i := range msgs {
					msgs[i].WorkID += "-batch"
				}
				res, err := outbox.EnqueueBatch(ctx, pool, msgs)
				if err != nil || fmt.Sprint(res) != fmt.Sprint([]outbox.Result{outbox.Inserted, outbox.Inserted, outbox.Inserted, outbox.Inserted}) {
					t.Fatalf("batch: %v, %v", res, err)
				}
				for _, m := range msgs {
					if got := storedPayload(t, pool, ptype, m.WorkID); !bytes.Equal(got, m.Payload) {
						t.Errorf("%s: stored %q, want %q", m.WorkID, got, m.Payload)
					}
				}
				// Content that says JSON is held to it.
				declared := outbox.Message{WorkID: "declared", Kind: "k", Payload: notJSON, ContentType: "application/json"}
				if err := outbox.Enqueue(ctx, pool, declared); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "says JSON") {
					t.Errorf("bytea, ContentType application/json, not JSON: %v, want ErrInvalid", err)
				}
				return
			}
			for _, m := range msgs {
				err := outbox.Enqueue(ctx, pool, m)
				if !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "payload column of public.outbox is "+ptype) ||
					!strings.Contains(err.Error(), "--payload-type bytea") {
					t.Errorf("%s: %v, want ErrInvalid naming the column's type", m.WorkID, err)
				}
			}
			res, err := outbox.EnqueueBatch(ctx, pool, append(msgs, order(1)))
			if res != nil || !errors.Is(err, outbox.ErrInvalid) {
				t.Fatalf("batch: %v, %v; want refused", res, err)
			}
			for i := range msgs {
				if !strings.Contains(err.Error(), fmt.Sprintf("message %d: ", i)) {
					t.Errorf("batch error %q does not name message %d", err, i)
				}
			}
			if n := countRows(t, pool, "outbox"); n != 0 {
				t.Errorf("%d rows, want none", n)
			}
		})
	}
}

// TestContentType: ContentType lands in the headers column as
// Content-Type; a header that agrees stays as the caller named it, one that
// disagrees is refused.
func TestContentType(t *testing.T) {
	t.Parallel()
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	m := order(1)
	m.ContentType = "application/json; charset=utf-8"
	if err := outbox.Enqueue(ctx, pool, m); err != nil {
		t.Fatal(err)
	}
	if h := storedHeaders(t, pool, m.WorkID); len(h) != 1 || h["Content-Type"] != m.ContentType {
		t.Errorf("headers %v, want only Content-Type %q", h, m.ContentType)
	}
	agrees := order(2)
	agrees.ContentType = "application/json"
	agrees.Headers = map[string]string{"content-type": "application/json", "traceparent": "00-2-01"}
	if err := outbox.Enqueue(ctx, pool, agrees); err != nil {
		t.Fatal(err)
	}
	if h := storedHeaders(t, pool, agrees.WorkID); len(h) != 2 || h["content-type"] != "application/json" {
		t.Errorf("headers %v, want the caller's content-type and traceparent", h)
	}
	// The caller's map is left alone.
	plain := order(3)
	plain.ContentType = "application/json"
	plain.Headers = map[string]string{"traceparent": "00-3-01"}
	if err := outbox.Enqueue(ctx, pool, plain); err != nil {
		t.Fatal(err)
	}
	if len(plain.Headers) != 1 {
		t.Errorf("Enqueue changed the caller's headers: %v", plain.Headers)
	}
	disagrees := order(4)
	disagrees.ContentType = "application/json"
	disagrees.Headers = map[string]string{"Content-TYPE": "text/plain"}
	if err := outbox.Enqueue(ctx, pool, disagrees); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "disagree") {
		t.Errorf("disagreeing Content-Type header: %v, want ErrInvalid", err)
	}
	if _, err := outbox.EnqueueBatch(ctx, pool, []outbox.Message{order(5), disagrees}); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "message 1: ") {
		t.Errorf("batch with a disagreeing Content-Type header: %v, want ErrInvalid", err)
	}
	if n := countRows(t, pool, "outbox"); n != 3 {
		t.Errorf("%d rows, want 3", n)
	}
}
