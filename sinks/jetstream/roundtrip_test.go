package jetstream_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

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
		msg *sinks.Message
		fut sinks.Future
	}
	var pending []sent
	refused := map[string]int{}
	ids := map[string]bool{}
	for i := range 3000 {
		row := wire.Row{WorkID: wiretest.String(r, 1100), Kind: "thing.happened", Payload: []byte(fmt.Sprintf(`{"i":%d}`, i))}
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
				h[wiretest.String(r, 40)] = wiretest.String(r, 200)
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
		re, ok := sinks.IsRejected(err)
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
