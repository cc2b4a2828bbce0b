package jetstream_test

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func TestSubjectMatches(t *testing.T) {
	for _, c := range []struct {
		filter, subject string
		want            bool
	}{
		{"a.b", "a.b", true}, {"a.b", "a.c", false}, {"a.b", "a.b.c", false}, {"a.b.c", "a.b", false},
		{"a.*", "a.b", true}, {"a.*", "a.b.c", false}, {"a.*.c", "a.b.c", true}, {"*", "a", true}, {"*", "a.b", false},
		{"a.>", "a.b", true}, {"a.>", "a.b.c", true}, {"a.>", "a", false}, {">", "a", true}, {">", "a.b", true},
		{"outbox.>", "outbox.x", true}, {"outbox.>", "outboxx.y", false}, {"a*", "ab", false}, {"a*", "a*", true},
	} {
		if got := natssink.SubjectMatches(c.filter, c.subject); got != c.want {
			t.Errorf("SubjectMatches(%q, %q) = %v, want %v", c.filter, c.subject, got, c.want)
		}
	}
}

// A row's subject reaches only streams the relay may publish to. Issue 16's
// reproductions: '$JS.API.STREAM.PURGE.VICTIM' purged a stream and
// '$JS.API.STREAM.DELETE.OUTBOX' deleted the relay's own; a subject a
// service answers on made the relay send it a request; a subject of another
// application's stream let a producer write there.
func TestSinkPublishesOnlyIntoAllowedStreams(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	victim := f.stream + "_VICTIM"
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: victim, Subjects: []string{victim + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), victim) })
	for i := range 5 {
		if _, err := f.js.Publish(ctx, victim+".x", []byte{byte('0' + i)}); err != nil {
			t.Fatal(err)
		}
	}
	var served atomic.Int32
	service := f.stream + "_svc.do"
	sub, err := f.nc.Subscribe(service, func(m *nats.Msg) { served.Add(1); _ = m.Respond([]byte(`{"stream":"x","seq":1}`)) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })

	publish := func(s *natssink.Sink, id, subject string) (sinks.Ack, error) {
		fut, err := s.Publish(ctx, &wire.Message{ID: id, Subject: subject, Data: []byte(`{}`)})
		if err != nil {
			return sinks.Ack{}, err
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		return fut.Wait(wctx)
	}
	own := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	for _, c := range []struct{ subject, reason string }{
		{"$JS.API.STREAM.PURGE." + victim, "reserved_subject"},
		{"$JS.API.STREAM.DELETE." + f.stream, "reserved_subject"},
		{"_INBOX.abc", "reserved_subject"},
		{service, natssink.ReasonNoStream},
		{"nobody.binds.this", natssink.ReasonNoStream},
		{victim + ".y", natssink.ReasonStreamNotAllowed},
	} {
		_, err := publish(own, "row-"+c.subject, c.subject)
		re, ok := wire.IsRejected(err)
		if !ok || re.Reason != c.reason {
			t.Errorf("subject %q: %v, want a rejection with reason %s", c.subject, err, c.reason)
			continue
		}
		if c.reason == natssink.ReasonStreamNotAllowed && !strings.Contains(err.Error(), "--allow-stream "+victim) {
			t.Errorf("subject %q: %v, want the fix --allow-stream %s", c.subject, err, victim)
		}
	}
	if n := served.Load(); n != 0 {
		t.Errorf("the service received %d requests from the sink", n)
	}
	for _, name := range []string{victim, f.stream} {
		st, err := f.js.Stream(ctx, name)
		if err != nil {
			t.Fatalf("stream %s after the hostile subjects: %v", name, err)
		}
		if name == victim && st.CachedInfo().State.Msgs != 5 {
			t.Errorf("stream %s holds %d messages, want its 5", name, st.CachedInfo().State.Msgs)
		}
	}

	// Allowed: the same subject goes through, into that stream.
	// (Refresh: a refused subject is refused again without a lookup for
	// this long.)
	allowing := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix, AllowStreams: []string{victim}, Refresh: time.Second})
	ack, err := publish(allowing, "row-allowed", victim+".y")
	if err != nil || ack.Stream != victim {
		t.Fatalf("allowed stream: ack %+v, %v; want stored in %s", ack, err, victim)
	}
	if ack, err := publish(own, "row-own", f.prefix+"x"); err != nil || ack.Stream != f.stream {
		t.Fatalf("own prefix: ack %+v, %v", ack, err)
	}
	// A subject added to an allowed stream later is taken once the
	// sink reads the streams again (at most Refresh after a refusal).
	extra := f.stream + "_extra.z"
	if _, err := publish(allowing, "row-extra-1", extra); err == nil {
		t.Fatal("a subject no stream binds was published")
	}
	st, _ := f.js.Stream(ctx, victim)
	cfg := st.CachedInfo().Config
	cfg.Subjects = append(cfg.Subjects, extra)
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond)
	if ack, err := publish(allowing, "row-extra-2", extra); err != nil || ack.Stream != victim {
		t.Fatalf("subject added to an allowed stream: ack %+v, %v", ack, err)
	}
}

// countingAPI counts the JetStream API requests the sink's binding makes.
type countingAPI struct {
	natssink.API
	lookups, reads atomic.Int64
}

func (c *countingAPI) StreamNameBySubject(ctx context.Context, subject string) (string, error) {
	c.lookups.Add(1)
	return c.API.StreamNameBySubject(ctx, subject)
}

func (c *countingAPI) Stream(ctx context.Context, name string) (jetstream.Stream, error) {
	c.reads.Add(1)
	return c.API.Stream(ctx, name)
}

// Issue 20, small ones: a refused subject cost a broker round trip per row,
// under the binding's lock, on the CDC loop's goroutine, so a burst of rows
// with one bad subject serialised the stream. The refusal is remembered for
// the refresh interval: 500 rows of two refused subjects cost one lookup
// each, and the first read of the allowed streams.
func TestSinkRemembersRefusedSubjects(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	other := f.stream + "_OTHER"
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: other, Subjects: []string{other + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), other) })
	api := &countingAPI{API: f.js}
	sink := natssink.New(api, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix, AllowStreams: []string{f.stream + "_ALLOWED"}})
	const n = 500
	subjects := map[string]string{"nobody.binds.this": natssink.ReasonNoStream, other + ".x": natssink.ReasonStreamNotAllowed}
	start := time.Now()
	for i := range n {
		for subject, reason := range subjects {
			_, err := sink.Publish(ctx, &wire.Message{ID: fmt.Sprintf("bad-%d", i), Subject: subject, Data: []byte(`{}`)})
			if re, ok := wire.IsRejected(err); !ok || re.Reason != reason {
				t.Fatalf("row %d on %s: %v, want a rejection with reason %s", i, subject, err, reason)
			}
		}
	}
	lookups, reads := api.lookups.Load(), api.reads.Load()
	t.Logf("%d rows of %d refused subjects in %v: %d subject lookups, %d stream reads", n*len(subjects), len(subjects), time.Since(start), lookups, reads)
	// One read of the two allowed streams, another for the second subject
	// if a second had passed (a loaded machine), and one lookup per subject.
	if lookups != int64(len(subjects)) || reads > 4 {
		t.Errorf("%d subject lookups and %d stream reads for %d rows, want %d lookups and at most 4 reads", lookups, reads, n*len(subjects), len(subjects))
	}
	// Rows under the prefix still take no request at all.
	before := api.lookups.Load() + api.reads.Load()
	for i := range 100 {
		fut, err := sink.Publish(ctx, &wire.Message{ID: fmt.Sprintf("good-%d", i), Subject: f.prefix + "x", Data: []byte(`{}`)})
		if err != nil {
			t.Fatal(err)
		}
		if ack, err := waitFor(t, fut); err != nil || ack.Stream != f.stream {
			t.Fatalf("good-%d: %+v, %v", i, ack, err)
		}
	}
	if after := api.lookups.Load() + api.reads.Load(); after != before {
		t.Errorf("100 rows under the prefix made %d stream requests", after-before)
	}
}

// Issue 20, item 9: an acknowledgement counts only from the stream the
// sink published to. Here a responder that is no stream answers on the
// relay's own prefix with a PubAck naming another stream (a broker that
// ignored Nats-Expected-Stream would look the same): a rejection carrying
// that stream and sequence as evidence, never an ack.
func TestSinkRefusesAnAckFromAnotherStream(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	stream, prefix := f.stream+"_NOT_CREATED", f.stream+"_fake."
	var expected atomic.Value
	sub, err := f.nc.Subscribe(prefix+">", func(m *nats.Msg) {
		expected.Store(m.Header.Get("Nats-Expected-Stream"))
		_ = m.Respond([]byte(`{"stream":"ELSEWHERE","seq":7}`))
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := f.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	sink := natssink.New(f.js, natssink.Options{Stream: stream, SubjectPrefix: prefix})
	fut, err := sink.Publish(ctx, &wire.Message{ID: "forged", Subject: prefix + "x", Data: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	ack, err := waitFor(t, fut)
	re, ok := wire.IsRejected(err)
	if !ok || re.Reason != natssink.ReasonWrongStream || !strings.Contains(err.Error(), "stream ELSEWHERE at sequence 7") {
		t.Fatalf("ack %+v, %v; want a %s rejection naming ELSEWHERE and sequence 7", ack, err, natssink.ReasonWrongStream)
	}
	if got, _ := expected.Load().(string); got != stream {
		t.Errorf("the message carried Nats-Expected-Stream %q, want %q", got, stream)
	}
}
