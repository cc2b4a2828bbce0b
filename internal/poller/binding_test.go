package poller_test

import (
	"context"
	"fmt"
	"io"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// pollerWith builds a worker whose sink publishes under o (the fixture's
// stream and prefix filled in) and whose log also goes to logs.
func (f *fixture) pollerWith(id string, o natssink.Options, cfg poller.Config, logs io.Writer) *poller.Poller {
	f.t.Helper()
	pool, err := pgxpool.New(context.Background(), f.dbURL)
	if err != nil {
		f.t.Fatal(err)
	}
	f.t.Cleanup(pool.Close)
	js, err := jetstream.New(f.nc)
	if err != nil {
		f.t.Fatal(err)
	}
	o.Stream, o.SubjectPrefix = f.stream, f.prefix
	cfg.WorkerID, cfg.SubjectPrefix, cfg.Connected = id, f.prefix, f.nc.IsConnected
	cfg = cfg.WithDefaults()
	w := io.Writer(zerolog.NewTestWriter(f.t))
	if logs != nil {
		w = io.MultiWriter(w, logs)
	}
	log := zerolog.New(w).Level(zerolog.WarnLevel)
	return poller.New(cfg, store.New(pool, table, store.PolicyMark), natssink.New(js, o), log, metrics.New())
}

type rowState struct {
	state, lastError, streamName string
	streamSeq                    int64
}

func (f *fixture) row(workID string) rowState {
	f.t.Helper()
	var r rowState
	var seq *int64
	var lastErr, stream *string
	if err := f.pool.QueryRow(context.Background(), `SELECT state, last_error, stream_name, stream_seq FROM outbox WHERE work_id = $1`, workID).
		Scan(&r.state, &lastErr, &stream, &seq); err != nil {
		f.t.Fatalf("read row %s: %v", workID, err)
	}
	if lastErr != nil {
		r.lastError = *lastErr
	}
	if stream != nil {
		r.streamName = *stream
	}
	if seq != nil {
		r.streamSeq = *seq
	}
	return r
}

// pollOnce claims and publishes every due row once.
func pollOnce(t *testing.T, p *poller.Poller) {
	t.Helper()
	if _, err := p.Poll(context.Background()); err != nil {
		t.Fatalf("poll: %v", err)
	}
}

func streamMsgs(t *testing.T, js jetstream.JetStream, name string) uint64 {
	t.Helper()
	st, err := js.Stream(context.Background(), name)
	if err != nil {
		t.Fatalf("stream %s: %v", name, err)
	}
	return st.CachedInfo().State.Msgs
}

func createStream(t *testing.T, js jetstream.JetStream, name string, subjects ...string) {
	t.Helper()
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: subjects}); err != nil {
		t.Fatalf("create stream %s on %v: %v", name, subjects, err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
}

func setSubjects(t *testing.T, js jetstream.JetStream, name string, subjects ...string) {
	t.Helper()
	st, err := js.Stream(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Subjects = subjects
	if _, err := js.UpdateStream(context.Background(), cfg); err != nil {
		t.Fatalf("set the subjects of %s to %v: %v", name, subjects, err)
	}
}

// Issue 20, item 9 on the poller's path: a stream's subjects change inside
// the sink's 30 s view of them. An allowed stream's subjects move to a
// stream the relay may not write to, and the relay's own stream is narrowed
// while another stream takes part of its prefix. Nothing may be stored in
// those streams, and no row may be marked published with their sequences:
// the rows fail (max attempts 1) with the reason.
func TestPollerNeverPublishesIntoAStreamThatTookTheSubjects(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	allowed, taker, prefixTaker := f.stream+"_ALLOWED", f.stream+"_TAKER", f.stream+"_PREFIX_TAKER"
	createStream(t, f.js, allowed, allowed+".>")
	p := f.pollerWith("w", natssink.Options{AllowStreams: []string{allowed}}, poller.Config{MaxAttempts: 1}, nil)

	insert := func(id, kind, subject string) {
		t.Helper()
		var subj any
		if subject != "" {
			subj = subject
		}
		if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload, state) VALUES ($1, $2, $3, '{}', 'scheduled')`, id, kind, subj); err != nil {
			t.Fatal(err)
		}
	}
	// The view of the streams is read: both subjects are bound.
	insert("warm-allowed", "k", allowed+".a")
	insert("warm-own", "k", "")
	pollOnce(t, p)
	for id, stream := range map[string]string{"warm-allowed": allowed, "warm-own": f.stream} {
		if r := f.row(id); r.state != "published" || r.streamName != stream {
			t.Fatalf("%s: %+v, want published into %s", id, r, stream)
		}
	}

	// The allowed stream's subjects move to a stream the relay may not
	// write to; the own stream keeps only <prefix>keep.> and another stream
	// takes <prefix>lost.>.
	setSubjects(t, f.js, allowed, allowed+"_moved.>")
	createStream(t, f.js, taker, allowed+".>")
	setSubjects(t, f.js, f.stream, f.prefix+"keep.>")
	createStream(t, f.js, prefixTaker, f.prefix+"lost.>")

	insert("moved", "k", allowed+".b")
	insert("narrowed", "lost.x", "")
	pollOnce(t, p)
	for _, c := range []struct{ id, stream, by string }{{"moved", allowed, taker}, {"narrowed", f.stream, prefixTaker}} {
		r := f.row(c.id)
		t.Logf("%s: %+v", c.id, r)
		if r.state != "failed" || r.streamSeq != 0 || !strings.HasPrefix(r.lastError, "rejected: "+natssink.ReasonWrongStream+": ") ||
			!strings.Contains(r.lastError, c.by) || !strings.Contains(r.lastError, "stored nothing") {
			t.Errorf("%s: %+v, want failed, rejected as %s naming %s", c.id, r, natssink.ReasonWrongStream, c.by)
		}
	}
	for _, name := range []string{taker, prefixTaker} {
		if n := streamMsgs(t, f.js, name); n != 0 {
			t.Errorf("stream %s, which the relay may not write to, holds %d messages", name, n)
		}
	}

	// The next attempts see the streams as they are now: refused by the
	// binding, and a subject the own stream still binds is published.
	insert("moved-2", "k", allowed+".c")
	insert("narrowed-2", "lost.y", "")
	insert("kept", "keep.z", "")
	pollOnce(t, p)
	for id, reason := range map[string]string{"moved-2": natssink.ReasonStreamNotAllowed, "narrowed-2": natssink.ReasonStreamNotAllowed} {
		if r := f.row(id); r.state != "failed" || !strings.HasPrefix(r.lastError, "rejected: "+reason+": ") {
			t.Errorf("%s: %+v, want failed with %s", id, r, reason)
		}
	}
	if r := f.row("kept"); r.state != "published" || r.streamName != f.stream || r.streamSeq != 2 {
		t.Errorf("kept: %+v, want published into %s at sequence 2", r, f.stream)
	}
	for _, name := range []string{taker, prefixTaker} {
		if n := streamMsgs(t, f.js, name); n != 0 {
			t.Errorf("stream %s, which the relay may not write to, holds %d messages", name, n)
		}
	}
}

// Issue 20, item 10 on the poller's path: a work ID reused, after its row
// was deleted (prune, --on-publish delete), for other content inside the
// duplicate window. The broker keeps the first message; the row is
// published (the broker does hold a message under its ID) with the
// evidence of which one, and the work ID is logged.
func TestPollerRecordsADuplicateAck(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	logs := &testenv.LogBuffer{}
	p := f.pollerWith("w", natssink.Options{}, poller.Config{}, logs)
	for i, payload := range []string{`{"v": 1}`, `{"v": 2}`} {
		if i > 0 {
			if _, err := f.pool.Exec(ctx, `DELETE FROM outbox WHERE work_id = 'reused'`); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('reused', 'k', $1, 'scheduled')`, payload); err != nil {
			t.Fatal(err)
		}
		pollOnce(t, p)
	}
	r := f.row("reused")
	want := fmt.Sprintf("duplicate: duplicate of stream sequence 1 in stream %s", f.stream)
	if r.state != "published" || r.streamSeq != 1 || r.streamName != f.stream || !strings.HasPrefix(r.lastError, want) {
		t.Errorf("row %+v, want published at sequence 1 with last_error %q...", r, want)
	}
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	if msg, err := st.GetMsg(ctx, 1); err != nil || string(msg.Data) != `{"v": 1}` || st.CachedInfo().State.Msgs != 1 {
		t.Errorf("stream holds %d messages, sequence 1 %v %v; want only the first content", st.CachedInfo().State.Msgs, msg, err)
	}
	if l := logs.String(); !strings.Contains(l, `"work_id":"reused"`) || !strings.Contains(l, "duplicate ack") || !strings.Contains(l, `"stream_seq":1`) {
		t.Errorf("no warning naming the work ID and the kept message in the log:\n%s", l)
	}
}

// Issue 20, small ones: a row published after a rejection or a hold keeps
// no last_error from before. Both rows are as the relay leaves them
// (rescheduled with the reason; held behind an earlier row).
func TestPublishClearsAnEarlierError(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	if _, err := f.pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error) VALUES
		('was-rejected', 'k', '{}', 'scheduled', 1, 'rejected: no_stream: no JetStream stream binds subject "x"'),
		('was-held', 'k', '{}', 'scheduled', 0, 'held: waiting for w-1 (an earlier row of aggregate a/1)')`); err != nil {
		t.Fatal(err)
	}
	pollOnce(t, f.pollerWith("w", natssink.Options{}, poller.Config{}, nil))
	for _, id := range []string{"was-rejected", "was-held"} {
		if r := f.row(id); r.state != "published" || r.lastError != "" || r.streamName != f.stream {
			t.Errorf("%s: %+v, want published into %s with no last_error", id, r, f.stream)
		}
	}
}
