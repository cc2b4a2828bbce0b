package jetstream

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// pubAckCorpus: what nats-server writes (server/stream.go's template and
// its duplicate, counter and batch suffixes, and its JSON errors), and
// inputs that probe the edges of the hand-written path.
var pubAckCorpus = []string{
	`{"stream":"OUTBOX","seq":1}`,
	`{"stream":"OUTBOX","seq":18446744073709551615}`,
	`{"stream":"OUTBOX","seq":18446744073709551616}`,
	`{"stream":"OUTBOX","seq":0}`,
	`{"stream":"OUTBOX","seq":00}`,
	`{"stream":"OUTBOX","seq":01}`,
	`{"stream":"OUTBOX","seq":-1}`,
	`{"stream":"OUTBOX","seq":1.0}`,
	`{"stream":"OUTBOX","seq":1e3}`,
	`{"stream":"OUTBOX","seq":"1"}`,
	`{"stream":"OUTBOX","seq":null}`,
	`{"stream":"OUTBOX","seq":42,"duplicate": true}`,
	`{"stream":"OUTBOX","seq":42,"duplicate":false}`,
	`{"stream":"OUTBOX","seq":42,"duplicate":truex}`,
	`{"stream":"OUTBOX","seq":42,"duplicate":null}`,
	`{"stream":"OUTBOX","domain":"hub","seq":7}`,
	`{"stream":"OUTBOX","domain":"hub","seq":7,"duplicate": true}`,
	`{"stream":"OUTBOX","seq":7,"val":"12"}`,
	`{"stream":"OUTBOX","seq":7,"batch":"b1","count":3}`,
	`{"stream":"OUTBOX","seq":7,"duplicate": true,"batch":"b1","count":3}`,
	` { "seq" : 9 , "stream" : "S-1_x" } `,
	"{\n\t\"stream\":\"S\",\r\n\"seq\":3}\n",
	`{"stream":"S","seq":3}x`,
	`{"stream":"S","seq":3}}`,
	`{"stream":"S","seq":3,}`,
	`{"stream":"S",,"seq":3}`,
	`{"stream":"S" "seq":3}`,
	`{"stream":"S","seq":3`,
	`{"stream":"S","seq":`,
	`{"stream":"S","seq"`,
	`{"stream":"S`,
	`{"stream":"S","stream":"T","seq":3}`,
	`{"stream":"S","seq":3,"seq":4}`,
	`{"Stream":"S","seq":3}`,
	`{"stream":"S","SEQ":3}`,
	`{"stream":"","seq":3}`,
	`{"seq":3}`,
	`{"stream":"S"}`,
	`{"stream":null,"seq":3}`,
	`{"stream":"S\u0041","seq":3}`,
	`{"stream":"S\"","seq":3}`,
	`{"stream":"Ström","seq":3}`,
	"{\"stream\":\"S\xff\",\"seq\":3}",
	"{\"stream\":\"S\x01\",\"seq\":3}",
	`{"stream":"S","seq":3,"type":"io.nats.jetstream.api.v1.pub_ack_response"}`,
	`{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"},"stream":"OUTBOX","seq":0}`,
	`{"error":{"code":400,"err_code":10097,"description":"header size exceeds maximum allowed of 64k"}}`,
	`{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}`,
	`{"error":null,"stream":"S","seq":1}`,
	`{}`,
	`[]`,
	`null`,
	`""`,
	``,
	` `,
	`{`,
	`}`,
	`+OK`,
}

// The hand-written path decides exactly what nats.go's encoding/json
// decoding decides, for every input of the corpus.
func TestPubAckParsingMatchesEncodingJSON(t *testing.T) {
	var p ackParser
	for _, in := range pubAckCorpus {
		checkPubAck(t, &p, []byte(in))
	}
	// The common answers take the fast path.
	for _, in := range []string{
		`{"stream":"OUTBOX","seq":1}`,
		`{"stream":"OUTBOX","domain":"hub","seq":7}`,
		`{"stream":"OUTBOX","seq":42,"duplicate": true}`,
	} {
		if _, _, _, ok := scanPubAck([]byte(in)); !ok {
			t.Errorf("%s: not recognised by the fast path", in)
		}
	}
	// The API errors arrive as *jetstream.APIError, for classify.
	_, err := p.parse([]byte(`{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}}`))
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamMessageExceedsMaximum || apiErr.Code != 400 {
		t.Errorf("API error decoded as %#v", err)
	}
	// One stream name string serves consecutive acks of that stream.
	a1, _ := p.parse([]byte(`{"stream":"ONE","seq":1}`))
	a2, _ := p.parse([]byte(`{"stream":"ONE","seq":2}`))
	if a1.Stream != "ONE" || a2.Stream != "ONE" || a2.Sequence != 2 || strings.Clone(a1.Stream) != a2.Stream {
		t.Errorf("acks %+v %+v", a1, a2)
	}
	ack := []byte(`{"stream":"ONE","seq":123456,"duplicate": true}`)
	if n := testing.AllocsPerRun(100, func() { _, _ = p.parse(ack) }); n != 0 {
		t.Errorf("parsing an ack of the same stream allocates %v times", n)
	}
}

func checkPubAck(t *testing.T, p *ackParser, in []byte) {
	t.Helper()
	got, gotErr := p.parse(in)
	want, wantErr := decodePubAck(in)
	if got != want || !reflect.DeepEqual(gotErr, wantErr) {
		t.Errorf("%q: parsed %+v, %v; encoding/json gives %+v, %v", in, got, gotErr, want, wantErr)
	}
}

// Property: whatever the fast path accepts, encoding/json decodes to the
// same ack.
func FuzzPubAck(f *testing.F) {
	for _, in := range pubAckCorpus {
		f.Add([]byte(in))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var p ackParser
		checkPubAck(t, &p, in)
	})
}

func TestParseToken(t *testing.T) {
	const prefix = "_INBOX.abc."
	for _, c := range []struct {
		subject string
		want    uint64
		ok      bool
	}{
		{prefix + "0", 0, true}, {prefix + "42", 42, true}, {prefix + "18446744073709551615", 1<<64 - 1, true},
		{prefix + "18446744073709551616", 0, false}, {prefix + "184467440737095516150", 0, false},
		{prefix, 0, false}, {prefix + "4x", 0, false}, {prefix + "-1", 0, false}, {"_INBOX.ab", 0, false},
	} {
		got, ok := parseToken(c.subject, len(prefix))
		if got != c.want || ok != c.ok {
			t.Errorf("parseToken(%q) = %d, %v; want %d, %v", c.subject, got, ok, c.want, c.ok)
		}
	}
}

// The ring keeps pending publishes by token through growth and out-of-order
// answers, and the sweep fails exactly the overdue ones, oldest first.
func TestPendingRing(t *testing.T) {
	p := newPublisher(nil, 1<<40, minReplyBuffer)
	p.timer = timerForTest(t)
	var fs []*future
	for range 1000 {
		f := &future{msg: &wire.Message{}}
		p.register(f)
		fs = append(fs, f)
	}
	if len(p.ring) != 1024 {
		t.Fatalf("ring of %d for 1000 pending", len(p.ring))
	}
	for i, f := range fs {
		if p.lookup(uint64(i)) != f {
			t.Fatalf("token %d: lookup gives another publish", i)
		}
	}
	// Answer every other one, newest first: head stays on the oldest.
	for i := len(fs) - 1; i >= 0; i -= 2 {
		p.remove(fs[i], uint64(i))
		fs[i].resolve(sinks.Ack{Sequence: uint64(i)}, nil)
	}
	if p.head != 0 || p.lookup(999) != nil || p.lookup(998) != fs[998] {
		t.Fatalf("head %d after answers out of order", p.head)
	}
	p.remove(fs[0], 0)
	if p.head != 2 {
		t.Fatalf("head %d, want 2", p.head)
	}
	if p.lookup(1000) != nil || p.lookup(1) != nil {
		t.Fatal("lookup found a resolved or unknown token")
	}
	// The first ten pending ones are overdue.
	for i := 2; i < 22; i += 2 {
		fs[i].deadline = p.now() - 1
	}
	p.armed = true
	p.sweep()
	if p.head != 22 || !p.armed {
		t.Fatalf("after the sweep: head %d, armed %v", p.head, p.armed)
	}
	for i := 2; i < 22; i += 2 {
		if fs[i].state.Load() != stateDone || !errors.Is(fs[i].err, jetstream.ErrAsyncPublishTimeout) {
			t.Fatalf("publish %d: state %d, err %v", i, fs[i].state.Load(), fs[i].err)
		}
	}
	if fs[22].state.Load() != statePending {
		t.Fatal("a publish before its deadline was failed")
	}
	// Wrapped around: more publishes reuse the freed slots.
	for range 40 {
		p.register(&future{msg: &wire.Message{}})
	}
	if p.lookup(22) != fs[22] || p.lookup(1039) == nil || p.lookup(1040) != nil || len(p.ring) != 1024 {
		t.Fatalf("after wrapping: ring of %d", len(p.ring))
	}
}

func TestAckTimeoutComesFromOptions(t *testing.T) {
	js, err := jetstream.New(&nats.Conn{}, jetstream.WithPublishAsyncTimeout(secondsForTest(3)))
	if err != nil {
		t.Fatal(err)
	}
	if got := New(js, Options{}).pub.timeout; got != DefaultAckTimeout {
		t.Errorf("no Options.AckTimeout: %v, want the default %v", got, DefaultAckTimeout)
	}
	if got := New(js, Options{AckTimeout: secondsForTest(7)}).pub.timeout; got != secondsForTest(7) {
		t.Errorf("Options.AckTimeout 7s: %v", got)
	}
}

func secondsForTest(n int) time.Duration { return time.Duration(n) * time.Second }

// timerForTest stands in for the publisher's timer: nothing runs when it
// fires.
func timerForTest(t *testing.T) *time.Timer {
	tm := time.AfterFunc(time.Hour, func() {})
	t.Cleanup(func() { tm.Stop() })
	return tm
}
