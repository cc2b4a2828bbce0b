package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/proto"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// Every message format with every payload type it matters for, on both
// paths and through republish: rows committed before the slot existed go
// through the poller (the backfill), rows committed while run streams
// through the CDC path, and republish publishes them all again after the
// stream lost them. Each message is read as its consumers read it: the
// payload's bytes exactly as the producer wrote them (json, bytea), or as
// PostgreSQL keeps them (jsonb); in the CloudEvents formats, an event the
// CloudEvents SDK for Go accepts, with the attributes taken from the row.
func TestMessageFormats(t *testing.T) {
	for _, c := range []struct {
		payloadType, format, source string
	}{
		{"json", "outbox", ""},
		{"bytea", "outbox", ""},
		{"jsonb", "cloudevents", ""},
		{"bytea", "cloudevents", "https://shop.example/orders"},
		{"jsonb", "cloudevents-structured", "https://shop.example/orders"},
		{"bytea", "cloudevents-structured", ""},
	} {
		t.Run(c.payloadType+"/"+c.format, func(t *testing.T) {
			t.Parallel()
			testMessageFormat(t, c.payloadType, c.format, c.source)
		})
	}
}

// formatRow is one row of the test and what its message must say.
type formatRow struct {
	id, kind, contentType, extension string
	aggregate                        bool
	payload                          []byte
}

func testMessageFormat(t *testing.T, payloadType, mode, source string) {
	env := testenv.Shared(t)
	ctx := context.Background()
	dbURL := env.PG.CreateDatabase(t)
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	if source == "" {
		source = "/outbox-relay/" + strings.TrimPrefix(u.Path, "/") + "/public.outbox"
	}
	stream, prefix := env.StreamName(t)
	common := []string{"--database-url", dbURL, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix,
		"--message-format", mode, "--slot", strings.NewReplacer("/", "_", "-", "_").Replace("formats_" + payloadType + "_" + mode)}
	if !strings.HasPrefix(source, "/outbox-relay/") {
		common = append(common, "--cloudevents-source", source)
	}
	if code, out, errOut := run(t, "migrate", "--database-url", dbURL, "--payload-type", payloadType); code != 0 {
		t.Fatalf("migrate --payload-type %s exited %d\n%s\n%s", payloadType, code, out, errOut)
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	// The producer's bytes: JSON with its own key order and spacing, or a
	// Protobuf message (and bytes that are no text at all).
	payload := []byte(`{"total": "29.00",  "order_id":103, "lines":[ 1,2 ]}`)
	ct := "application/vnd.shop.order+json"
	if payloadType == "bytea" {
		name, help, v := "orders_total", "a Protobuf message", 29.0
		pb, err := proto.Marshal(&dto.Metric{Label: []*dto.LabelPair{{Name: &name, Value: &help}}, Gauge: &dto.Gauge{Value: &v}})
		if err != nil {
			t.Fatal(err)
		}
		payload = append(pb, 0x00, 0xff, 0xfe)
		ct = "application/x-protobuf"
	}
	rows := func(pfx string) []formatRow {
		return []formatRow{
			{id: pfx + "-plain", kind: "order.created", payload: payload},
			{id: pfx + "-typed", kind: "order.created", payload: payload, contentType: ct},
			{id: pfx + "-aggregate", kind: "order.paid", payload: payload, aggregate: true},
			{id: pfx + "-extension", kind: "order.shipped", payload: payload, extension: "acme"},
		}
	}
	insert := func(rs []formatRow) {
		t.Helper()
		for i, r := range rs {
			var headers *string
			switch {
			case r.contentType != "":
				h := fmt.Sprintf(`{"Content-Type": %q}`, r.contentType)
				headers = &h
			case r.extension != "":
				h := fmt.Sprintf(`{"ce-tenant": %q}`, r.extension)
				headers = &h
			}
			var aggType, aggID *string
			var aggSeq *int64
			if r.aggregate {
				ty, id, seq := "order", r.id, int64(i+1)
				aggType, aggID, aggSeq = &ty, &id, &seq
			}
			if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, headers, aggregate_type, aggregate_id, aggregate_seq)
				VALUES ($1, $2, $3, $4::text::jsonb, $5, $6, $7)`, r.id, r.kind, r.payload, headers, aggType, aggID, aggSeq); err != nil {
				t.Fatalf("insert %s: %v", r.id, err)
			}
		}
	}
	early, streamed := rows("early"), rows("cdc")
	insert(early) // before the slot: the backfill hands them to the poller
	all := append(append([]formatRow{}, early...), streamed...)

	runOne(t, append([]string{"run", "--duplicate-window", "1s"}, common...), func() {
		insert(streamed)
		if payloadType == "bytea" {
			// The broker's limit holds for bytes as for text: a payload over
			// max_payload (1 MB here) is that row's refusal, and the stream
			// goes on. In structured mode base64 makes a payload a third
			// larger: 800 kB of bytes no longer fit.
			big := bytes.Repeat([]byte{0xff, 0x00}, 550<<10)
			exec := func(id string, p []byte) {
				if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'order.created', $2)`, id, p); err != nil {
					t.Fatal(err)
				}
			}
			exec("too-big", big)
			exec("big-envelope", big[:800<<10])
			insert([]formatRow{{id: "after-big", kind: "order.created", payload: payload}})
			all = append(all, formatRow{id: "after-big", kind: "order.created", payload: payload})
			wantRefused := map[string]bool{"too-big": true, "big-envelope": mode == "cloudevents-structured"}
			if !wantRefused["big-envelope"] {
				all = append(all, formatRow{id: "big-envelope", kind: "order.created", payload: big[:800<<10]})
			}
			testenv.WaitFor(t, 60*time.Second, "the payloads over max_payload refused", func() (bool, error) {
				for id, refused := range wantRefused {
					var state, lastErr string
					if err := pool.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM outbox WHERE work_id = $1`, id).Scan(&state, &lastErr); err != nil {
						return false, err
					}
					if refused && (state == "published" || !strings.HasPrefix(lastErr, "rejected: max_payload")) {
						return false, nil
					}
					if !refused && state != "published" {
						return false, nil
					}
				}
				return true, nil
			})
		}
		testenv.WaitFor(t, 60*time.Second, "every row published", func() (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == len(all), err
		})
	})
	js := connect(t, env.NATS.URL())
	checkFormat(t, pool, streamMessages(t, js, stream), all, payloadType, mode, source, "run")

	// The stream loses everything; republish, in the same format, puts it
	// back as it was.
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Purge(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // past the duplicate window
	if code, out, errOut := run(t, append([]string{"republish", "--since", "1h"}, common...)...); code != 0 ||
		!strings.Contains(out, fmt.Sprintf("republished %d", len(all))) {
		t.Fatalf("republish exited %d\n%s\n%s", code, out, errOut)
	}
	checkFormat(t, pool, streamMessages(t, js, stream), all, payloadType, mode, source, "republish")
}

// checkFormat reads each message as its consumer would and compares it
// with its row.
func checkFormat(t *testing.T, pool *pgxpool.Pool, msgs []jetstream.Msg, rows []formatRow, payloadType, mode, source, by string) {
	t.Helper()
	ctx := context.Background()
	byID := map[string][]jetstream.Msg{}
	for _, m := range msgs {
		id := m.Headers().Get(wire.HeaderMsgID)
		byID[id] = append(byID[id], m)
	}
	if len(byID) != len(rows) {
		t.Errorf("%s: the stream holds %d work IDs, want %d", by, len(byID), len(rows))
	}
	for _, r := range rows {
		ms := byID[r.id]
		if len(ms) != 1 {
			t.Errorf("%s: %s is in the stream %d times, want once", by, r.id, len(ms))
			continue
		}
		m := ms[0]
		// What the row holds: jsonb's text is PostgreSQL's; json's and
		// bytea's are the producer's bytes.
		want := r.payload
		var created time.Time
		var stored []byte
		col := `convert_to(payload::text, 'UTF8')`
		if payloadType == "bytea" {
			col = `payload`
		}
		if err := pool.QueryRow(ctx, `SELECT created_at, `+col+` FROM outbox WHERE work_id = $1`, r.id).Scan(&created, &stored); err != nil {
			t.Fatal(err)
		}
		if payloadType == "jsonb" {
			want = stored
		} else if !bytes.Equal(stored, r.payload) {
			t.Fatalf("the %s column holds %x for %s, inserted %x", payloadType, stored, r.id, r.payload)
		}
		wantCT := r.contentType
		if wantCT == "" {
			wantCT = wire.MediaJSON
			if payloadType == "bytea" {
				wantCT = wire.MediaOctetStream
			}
		}
		if mode == "outbox" {
			if !bytes.Equal(m.Data(), want) {
				t.Errorf("%s: %s: data %q, want the payload %q byte for byte", by, r.id, m.Data(), want)
			}
			if got := m.Headers().Get(wire.HeaderContentType); got != r.contentType {
				t.Errorf("%s: %s: Content-Type %q, want the row's %q", by, r.id, got, r.contentType)
			}
			continue
		}
		ev, err := cloudEvent(m)
		if err != nil {
			t.Errorf("%s: %s: not a CloudEvent: %v\nheaders %v\ndata %q", by, r.id, err, m.Headers(), m.Data())
			continue
		}
		if err := ev.Validate(); err != nil {
			t.Errorf("%s: %s: the SDK refuses the event: %v", by, r.id, err)
		}
		if ev.ID() != r.id || ev.Type() != r.kind || ev.Source() != source || ev.SpecVersion() != "1.0" {
			t.Errorf("%s: %s: id %q type %q source %q specversion %q; want %q %q %q 1.0", by, r.id, ev.ID(), ev.Type(), ev.Source(), ev.SpecVersion(), r.id, r.kind, source)
		}
		if !ev.Time().Equal(created) {
			t.Errorf("%s: %s: time %s, want created_at %s", by, r.id, ev.Time(), created)
		}
		if ev.DataContentType() != wantCT {
			t.Errorf("%s: %s: datacontenttype %q, want %q", by, r.id, ev.DataContentType(), wantCT)
		}
		if !bytes.Equal(ev.Data(), want) {
			t.Errorf("%s: %s: the event's data %q, want the payload %q byte for byte", by, r.id, ev.Data(), want)
		}
		ext := ev.Extensions()
		if r.aggregate {
			var seq int64
			if err := pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox WHERE work_id = $1`, r.id).Scan(&seq); err != nil {
				t.Fatal(err)
			}
			if ext["partitionkey"] != "order/"+r.id || ext["sequence"] != fmt.Sprintf("%019d", seq) {
				t.Errorf("%s: %s: partitionkey %v sequence %v, want order/%s and %019d", by, r.id, ext["partitionkey"], ext["sequence"], r.id, seq)
			}
		} else if ext["partitionkey"] != nil || ext["sequence"] != nil {
			t.Errorf("%s: %s: partitionkey %v sequence %v on a row without an aggregate", by, r.id, ext["partitionkey"], ext["sequence"])
		}
		if r.extension != "" && ext["tenant"] != r.extension {
			t.Errorf("%s: %s: extension tenant %v, want the row's ce-tenant %q", by, r.id, ext["tenant"], r.extension)
		}
		// Nats-Msg-Id and the relay's headers stay in every format.
		if m.Headers().Get(wire.HeaderKind) != r.kind {
			t.Errorf("%s: %s: %s %q, want %q", by, r.id, wire.HeaderKind, m.Headers().Get(wire.HeaderKind), r.kind)
		}
	}
}

// cloudEvent reads m as the CloudEvents NATS binding says: binary mode when
// it has a ce-specversion header (each ce-* header an attribute or an
// extension, the data the payload), structured otherwise (the data a JSON
// event). The binding's own module is not served here; this is its
// reading, through the SDK's binding and format packages.
func cloudEvent(m jetstream.Msg) (*event.Event, error) {
	if m.Headers().Get("ce-specversion") == "" {
		if ct := m.Headers().Get(wire.HeaderContentType); ct != wire.MediaCloudEventsJSON {
			return nil, fmt.Errorf("structured mode: Content-Type %q, want %s", ct, wire.MediaCloudEventsJSON)
		}
		ev := event.New()
		if err := format.JSON.Unmarshal(m.Data(), &ev); err != nil {
			return nil, err
		}
		return &ev, nil
	}
	return binding.ToEvent(context.Background(), natsBinaryMessage{m})
}

// natsBinaryMessage is a binary-mode NATS message as a binding.Message.
type natsBinaryMessage struct{ m jetstream.Msg }

var ceSpecs = spec.WithPrefix(wire.CEHeaderPrefix)

func (n natsBinaryMessage) ReadEncoding() binding.Encoding { return binding.EncodingBinary }

func (n natsBinaryMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (n natsBinaryMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	version := ceSpecs.Version(n.m.Headers().Get("ce-specversion"))
	if version == nil {
		return errors.New("unknown ce-specversion")
	}
	for k, vs := range n.m.Headers() {
		if !strings.HasPrefix(k, wire.CEHeaderPrefix) {
			continue
		}
		var err error
		if attr := version.Attribute(k); attr != nil {
			err = w.SetAttribute(attr, vs[0])
		} else {
			err = w.SetExtension(strings.TrimPrefix(k, wire.CEHeaderPrefix), vs[0])
		}
		if err != nil {
			return fmt.Errorf("header %s: %w", k, err)
		}
	}
	return w.SetData(bytes.NewReader(n.m.Data()))
}

func (n natsBinaryMessage) Finish(error) error { return nil }

func (n natsBinaryMessage) GetAttribute(k spec.Kind) (spec.Attribute, any) {
	version := ceSpecs.Version(n.m.Headers().Get("ce-specversion"))
	if version == nil {
		return nil, nil
	}
	attr := version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if v := n.m.Headers().Get(attr.PrefixedName()); v != "" {
		return attr, v
	}
	return attr, nil
}

func (n natsBinaryMessage) GetExtension(name string) any {
	if v := n.m.Headers().Get(wire.CEHeaderPrefix + name); v != "" {
		return v
	}
	return nil
}

// streamMessages reads every message of stream.
func streamMessages(t *testing.T, js jetstream.JetStream, stream string) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	if info.State.Msgs == 0 {
		return out
	}
	cons, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for uint64(len(out)) < info.State.Msgs {
		batch, err := cons.Fetch(500, jetstream.FetchMaxWait(2*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range batch.Messages() {
			out = append(out, m)
			n++
		}
		if batch.Error() != nil && !errors.Is(batch.Error(), nats.ErrTimeout) {
			t.Fatal(batch.Error())
		}
		if n == 0 {
			t.Fatalf("read %d of the stream's %d messages, then nothing", len(out), info.State.Msgs)
		}
	}
	return out
}

// The documented conversion of an existing jsonb table (docs/upgrading.md,
// "Changing the payload type"): migrate refuses to convert it, the ALTER
// runs while the relay streams, and rows from before and after it are all
// published once, the later ones byte for byte.
func TestPayloadTypeConversion(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	ctx := context.Background()
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	common := []string{"--database-url", dbURL, "--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix, "--slot", "conversion"}
	if code, _, errOut := run(t, "migrate", "--database-url", dbURL); code != 0 {
		t.Fatalf("migrate: %d %s", code, errOut)
	}
	for _, c := range []struct{ typ, want string }{
		{"bytea", `the table's payload column is jsonb already; migrate does not convert an existing table (docs/upgrading.md`},
		{"xml", `--payload-type "xml": want jsonb`},
	} {
		if code, _, errOut := run(t, "migrate", "--database-url", dbURL, "--payload-type", c.typ); code != 1 || !strings.Contains(errOut, c.want) {
			t.Errorf("migrate --payload-type %s on a jsonb table: exit %d, stderr %q; want 1 and %q", c.typ, code, errOut, c.want)
		}
	}
	if code, _, errOut := run(t, "migrate", "--database-url", dbURL, "--payload-type", "jsonb"); code != 0 {
		t.Errorf("migrate --payload-type jsonb on a jsonb table: exit %d, %s; want 0", code, errOut)
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'before-' || i, 'k', '{"n": 1}' FROM generate_series(1, 50) i`)
	proto := []byte{0x08, 0x96, 0x01, 0x00, 0xff}
	runOne(t, append([]string{"run"}, common...), func() {
		testenv.WaitFor(t, 30*time.Second, "the jsonb rows published", func() (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == 50, err
		})
		exec(`INSERT INTO outbox (work_id, kind, payload) SELECT 'ready-' || i, 'k', '{"n": 2}' FROM generate_series(1, 50) i`)
		exec(`ALTER TABLE outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8')`)
		for i := range 50 {
			exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'k', $2)`, fmt.Sprintf("after-%d", i), proto)
		}
		testenv.WaitFor(t, 30*time.Second, "every row published", func() (bool, error) {
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
			return n == 150, err
		})
	})
	msgs := streamMessages(t, connect(t, env.NATS.URL()), stream)
	seen := map[string]int{}
	for _, m := range msgs {
		id := m.Headers().Get(wire.HeaderMsgID)
		seen[id]++
		want := []byte(`{"n": 1}`)
		switch {
		case strings.HasPrefix(id, "ready-"):
			want = []byte(`{"n": 2}`)
		case strings.HasPrefix(id, "after-"):
			want = proto
		}
		if !bytes.Equal(m.Data(), want) {
			t.Errorf("%s: data %q, want %q", id, m.Data(), want)
		}
	}
	if len(seen) != 150 || len(msgs) != 150 {
		t.Errorf("the stream holds %d messages of %d work IDs, want 150 once each", len(msgs), len(seen))
	}
}
