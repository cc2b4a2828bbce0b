package jetstream_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/internal/wire/wiretest"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func TestMain(m *testing.M) { testenv.Main(m) }

type fixture struct {
	nc             *nats.Conn
	js             jetstream.JetStream
	stream, prefix string
}

func newFixture(t testing.TB) *fixture {
	t.Helper()
	env := testenv.Shared(t)
	f := &fixture{}
	f.stream, f.prefix = env.StreamName(t)
	var err error
	f.nc, err = nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.nc.Close)
	f.js, err = jetstream.New(f.nc, jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, _, err := natssink.EnsureStream(ctx, f.js, natssink.StreamConfig{Name: f.stream, SubjectPrefix: f.prefix, DuplicateWindow: time.Minute}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), f.stream) })
	return f
}

// Property: random hostile rows through the row -> message path and a real
// broker. Every row is either refused with a reason before anything is sent,
// or stored as exactly itself: its own message (never a duplicate of another
// row's), whose Nats-Msg-Id, Outbox-Kind, headers, subject and data read
// back byte for byte.
func TestRowsRoundTripThroughTheBroker(t *testing.T) {
	f := newFixture(t)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	seed := rand.Uint64()
	t.Logf("seed %d", seed)
	r := rand.New(rand.NewPCG(seed, 2))
	ctx := context.Background()
	type sent struct {
		msg *wire.Message
		fut sinks.Future
	}
	var pending []sent
	refused := map[string]int{}
	ids := map[string]bool{}
	for i := range 3000 {
		row := wire.Row{WorkID: wiretest.String(r, 1100), Kind: "thing.happened", Payload: []byte(fmt.Sprintf(`{"i":%d}`, i))}
		if r.IntN(4) == 0 {
			row.WorkID = wiretest.Near(r, wire.MaxWorkIDBytes)
		}
		if r.IntN(2) == 0 {
			row.Kind = wiretest.String(r, 300)
		}
		if r.IntN(4) == 0 {
			row.Subject = wiretest.String(r, 300)
		} else if r.IntN(3) == 0 {
			row.Subject = f.prefix + "explicit"
		}
		if r.IntN(3) == 0 {
			h := map[string]string{}
			for range 1 + r.IntN(4) {
				name := wiretest.String(r, 40)
				if r.IntN(4) == 0 {
					name = wiretest.Near(r, 256)
				}
				h[name] = wiretest.String(r, 200)
			}
			row.Headers, _ = json.Marshal(h)
		}
		if ids[row.WorkID] {
			continue // the table's primary key: one row per work ID
		}
		ids[row.WorkID] = true
		m, err := wire.BuildMessage(row, f.prefix, nil)
		if err == nil {
			var fut sinks.Future
			fut, err = sink.Publish(ctx, m)
			if err == nil {
				pending = append(pending, sent{m, fut})
				continue
			}
		}
		re, ok := wire.IsRejected(err)
		if !ok || re.Reason == "" {
			t.Fatalf("row %q: %v, want a rejection with a reason", row.WorkID, err)
		}
		refused[re.Reason]++
	}
	t.Logf("published %d, refused %v", len(pending), refused)
	if len(pending) < 200 || len(refused) < 4 {
		t.Fatalf("the generator gave %d publishable rows and refusals %v: too little of one side", len(pending), refused)
	}
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	seqs := map[uint64]string{}
	for _, p := range pending {
		ack, err := p.fut.Wait(ctx)
		if err != nil {
			t.Fatalf("%q: %v", p.msg.ID, err)
		}
		if ack.Duplicate {
			t.Errorf("%q was stored as a duplicate of another row's message", p.msg.ID)
		}
		if other, seen := seqs[ack.Sequence]; seen {
			t.Errorf("%q and %q were acked with one sequence %d", p.msg.ID, other, ack.Sequence)
		}
		seqs[ack.Sequence] = p.msg.ID
		got, err := st.GetMsg(ctx, ack.Sequence)
		if err != nil {
			t.Fatal(err)
		}
		if id := got.Header.Get(jetstream.MsgIDHeader); id != p.msg.ID {
			t.Errorf("stored Nats-Msg-Id %q, want %q", id, p.msg.ID)
		}
		if got.Subject != p.msg.Subject || string(got.Data) != string(p.msg.Data) {
			t.Errorf("%q: stored %s %s, want %s %s", p.msg.ID, got.Subject, got.Data, p.msg.Subject, p.msg.Data)
		}
		for k, vs := range p.msg.Header {
			if g := got.Header.Values(k); len(g) != 1 || g[0] != vs[0] {
				t.Errorf("%q: stored header %q = %q, want %q", p.msg.ID, k, g, vs[0])
			}
		}
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != uint64(len(pending)) {
		t.Errorf("stream holds %d messages for %d published rows", info.State.Msgs, len(pending))
	}
}

// Every bounded field of a row, exactly at its limit (limit-1, limit and
// limit+1 bytes, with multi-byte characters ending at and straddling it,
// and empty), through the row -> message path and a real broker: the relay
// takes a value exactly when it is 1 to limit bytes, and what it takes is
// stored byte for byte. A limit that drifted from what the broker carries,
// or a rule that counts characters, fails here.
func TestRowsAtTheLimitsRoundTrip(t *testing.T) {
	f := newFixture(t)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	ctx := context.Background()
	n := 0
	base := func() wire.Row {
		n++
		return wire.Row{WorkID: fmt.Sprintf("lim-%d", n), Kind: "k", Subject: f.prefix + "explicit", Payload: []byte(fmt.Sprintf(`{"i":%d}`, n))}
	}
	type limitCase struct {
		field, value string
		limit        int
		want         bool
		row          wire.Row
	}
	var cases []limitCase
	add := func(field string, limit int, value string, row wire.Row) {
		cases = append(cases, limitCase{field, value, limit, value != "" && len(value) <= limit, row})
	}
	for _, v := range wiretest.AtLimit(wire.MaxWorkIDBytes) {
		row := base()
		row.WorkID = v
		add("work_id", wire.MaxWorkIDBytes, v, row)
	}
	for _, v := range wiretest.AtLimit(wire.MaxKindBytes) {
		row := base()
		row.Kind = v
		add("kind", wire.MaxKindBytes, v, row)
	}
	for _, v := range wiretest.AtLimit(wire.MaxKindBytes) {
		row := base()
		row.AggregateType, row.AggregateID, row.AggregateSeq = v, "a", 1
		add("aggregate_type", wire.MaxKindBytes, v, row)
	}
	for _, v := range wiretest.AtLimit(wire.MaxWorkIDBytes) {
		row := base()
		row.AggregateType, row.AggregateID, row.AggregateSeq = "t", v, 1
		add("aggregate_id", wire.MaxWorkIDBytes, v, row)
	}
	// A subject must stay in the stream: the prefix, then the filler.
	for _, v := range wiretest.AtLimit(wire.MaxSubjectBytes - len(f.prefix)) {
		if v == "" {
			continue // an empty subject column means prefix+kind
		}
		row := base()
		row.Subject = f.prefix + v
		add("subject", wire.MaxSubjectBytes, row.Subject, row)
	}
	for _, v := range wiretest.AtLimit(256) {
		row := base()
		row.Headers, _ = json.Marshal(map[string]string{v: "x"})
		c := limitCase{"header name", v, 256, v != "" && len(v) <= 256, row}
		for _, b := range []byte(v) {
			if b >= 0x80 {
				c.want = false // header names are ASCII, whatever their length
			}
		}
		cases = append(cases, c)
	}
	// The header block: one padding header sized so that the block is
	// exactly MaxHeaderBytes-1, MaxHeaderBytes and MaxHeaderBytes+1 bytes.
	{
		row := base()
		row.Headers = []byte(`{"X-Pad":""}`)
		m, err := wire.BuildMessage(row, f.prefix, nil)
		if err != nil {
			t.Fatal(err)
		}
		for size := wire.MaxHeaderBytes - 1; size <= wire.MaxHeaderBytes+1; size++ {
			row := base()
			pad := strings.Repeat("p", size-m.HeaderBytes-(len(row.WorkID)-len(m.ID)))
			row.Headers, _ = json.Marshal(map[string]string{"X-Pad": pad})
			c := limitCase{fmt.Sprintf("header block of %d bytes: its padding value", size), pad, wire.MaxHeaderBytes, size <= wire.MaxHeaderBytes, row}
			if mm, err := wire.BuildMessage(row, f.prefix, nil); err == nil && mm.HeaderBytes != size {
				t.Fatalf("padding built a header block of %d bytes, want %d", mm.HeaderBytes, size)
			}
			cases = append(cases, c)
		}
	}
	accepted := 0
	for _, c := range cases {
		m, err := wire.BuildMessage(c.row, f.prefix, nil)
		if (err == nil) != c.want {
			t.Errorf("%s of %d bytes (%d characters, limit %d): BuildMessage says %v, want accepted=%v",
				c.field, len(c.value), utf8.RuneCountInString(c.value), c.limit, err, c.want)
			continue
		}
		if err != nil {
			if _, ok := wire.IsRejected(err); !ok {
				t.Errorf("%s of %d bytes: %v, want a rejection with a reason", c.field, len(c.value), err)
			}
			continue
		}
		fut, err := sink.Publish(ctx, m)
		if err != nil {
			t.Fatalf("%s of %d bytes: publish: %v", c.field, len(c.value), err)
		}
		ack, err := fut.Wait(ctx)
		if err != nil {
			t.Errorf("%s of %d bytes (limit %d): the relay took it, the broker refused it: %v", c.field, len(c.value), c.limit, err)
			continue
		}
		accepted++
		got, err := f.js.Stream(ctx, f.stream)
		if err != nil {
			t.Fatal(err)
		}
		stored, err := got.GetMsg(ctx, ack.Sequence)
		if err != nil {
			t.Fatal(err)
		}
		if id := stored.Header.Get(jetstream.MsgIDHeader); id != m.ID || ack.Duplicate {
			t.Errorf("%s of %d bytes: stored Nats-Msg-Id %.40q (duplicate %v), want %.40q", c.field, len(c.value), id, ack.Duplicate, m.ID)
		}
		if stored.Subject != m.Subject || string(stored.Data) != string(m.Data) {
			t.Errorf("%s of %d bytes: stored %.40q %s, want %.40q %s", c.field, len(c.value), stored.Subject, stored.Data, m.Subject, m.Data)
		}
		for k, vs := range m.Header {
			if g := stored.Header.Values(k); len(g) != 1 || g[0] != vs[0] {
				t.Errorf("%s of %d bytes: stored header %.40q = %.40q, want %.40q", c.field, len(c.value), k, g, vs[0])
			}
		}
	}
	t.Logf("%d values at the limits, %d stored", len(cases), accepted)
	if accepted == 0 || accepted == len(cases) {
		t.Errorf("%d of %d values stored: the cases do not straddle the limits", accepted, len(cases))
	}
}

// A 4xx answer the sink has no name for is that message's refusal, never
// an outage (issue 42, item 1: a refusal taken for an outage replayed the
// stream without end): here the stream's "wrong last sequence" (10071) to a
// message that expects a last sequence the stream is not at. A refusal of
// the stream or account as a whole (10002, 10109, 10120) stays an outage.
func TestUnknownRefusalIsTheMessagesRejection(t *testing.T) {
	f := newFixture(t)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	m := &wire.Message{ID: "w1", Subject: f.prefix + "k", Data: []byte(`{}`), Header: map[string][]string{"Nats-Expected-Last-Sequence": {"42"}}}
	fut, err := sink.Publish(context.Background(), m)
	if err == nil {
		_, err = fut.Wait(context.Background())
	}
	re, ok := wire.IsRejected(err)
	if !ok || re.Reason != wire.ReasonRefused || !strings.Contains(err.Error(), "10071") {
		t.Fatalf("publish with a wrong expected last sequence: %v, want a rejection %q naming error 10071", err, wire.ReasonRefused)
	}
}
