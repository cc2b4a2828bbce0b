package relay_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

type rowEvidence struct {
	state, lastError, streamName string
	streamSeq                    int64
	found                        bool
}

func (h *harness) row(workID string) rowEvidence {
	h.t.Helper()
	var r rowEvidence
	var seq *int64
	var lastErr, stream *string
	err := h.pool.QueryRow(context.Background(), `SELECT state, last_error, stream_name, stream_seq FROM outbox WHERE work_id = $1`, workID).
		Scan(&r.state, &lastErr, &stream, &seq)
	if err == pgx.ErrNoRows {
		return r
	}
	if err != nil {
		h.t.Fatalf("read row %s: %v", workID, err)
	}
	r.found = true
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

func (h *harness) msgsIn(stream string) uint64 {
	h.t.Helper()
	st, err := h.js.Stream(context.Background(), stream)
	if err != nil {
		h.t.Fatalf("stream %s: %v", stream, err)
	}
	return st.CachedInfo().State.Msgs
}

func (h *harness) createStream(name string, subjects ...string) {
	h.t.Helper()
	if _, err := h.js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: subjects}); err != nil {
		h.t.Fatalf("create stream %s on %v: %v", name, subjects, err)
	}
	h.t.Cleanup(func() { _ = h.js.DeleteStream(context.Background(), name) })
}

func (h *harness) setSubjects(name string, subjects ...string) {
	h.t.Helper()
	st, err := h.js.Stream(context.Background(), name)
	if err != nil {
		h.t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.Subjects = subjects
	if _, err := h.js.UpdateStream(context.Background(), cfg); err != nil {
		h.t.Fatalf("set the subjects of %s to %v: %v", name, subjects, err)
	}
}

// Issue 20, item 9 on the CDC path: the streams' subjects change inside
// the sink's 30 s view of them. An allowed stream's subjects move to a
// stream the relay may not write to, and the relay's own stream is narrowed
// while another stream takes part of its prefix. Before, the rows landed in
// those streams and were marked published with their sequences. Now the
// broker refuses them (Nats-Expected-Stream), nothing is stored there, and
// the rows go to the poller rejected as wrong_stream; a subject the own
// stream still binds is published into it.
func TestCDCNeverPublishesIntoAStreamThatTookTheSubjects(t *testing.T) {
	s := sharedSetup(t)
	h := newHarness(t, s)
	allowed, taker, prefixTaker := s.stream+"_ALLOWED", s.stream+"_TAKER", s.stream+"_PREFIX_TAKER"
	h.createStream(allowed, allowed+".>")
	h.opts.AllowStreams = []string{allowed}
	h.start()

	insert := func(id, kind, subject string) {
		t.Helper()
		var subj any
		if subject != "" {
			subj = subject
		}
		h.exec(`INSERT INTO outbox (work_id, kind, subject, payload) VALUES ($1, $2, $3, '{}')`, id, kind, subj)
	}
	// The view of the streams is read: both subjects are bound.
	insert("warm-allowed", "k", allowed+".a")
	insert("warm-own", "k", "")
	h.waitPublished(2, 30*time.Second)
	for id, stream := range map[string]string{"warm-allowed": allowed, "warm-own": s.stream} {
		if r := h.row(id); r.streamName != stream || r.streamSeq != 1 {
			t.Fatalf("%s: %+v, want published into %s at sequence 1", id, r, stream)
		}
	}

	h.setSubjects(allowed, allowed+"_moved.>")
	h.createStream(taker, allowed+".>")
	h.setSubjects(s.stream, s.subjectPrefix+"keep.>")
	h.createStream(prefixTaker, s.subjectPrefix+"lost.>")

	insert("moved", "k", allowed+".b")
	insert("narrowed", "lost.x", "")
	for _, c := range []struct{ id, by string }{{"moved", taker}, {"narrowed", prefixTaker}} {
		// The poller retries the row 5 s after the rejection (and the
		// binding refuses it then): its first outcome is the CDC path's.
		testenv.WaitFor(t, 30*time.Second, c.id+" handed to the poller", func() (bool, error) {
			r := h.row(c.id)
			return r.state != "ready", fmt.Errorf("%+v", r)
		})
		r := h.row(c.id)
		t.Logf("%s: %+v", c.id, r)
		if r.state != "scheduled" || r.streamSeq != 0 || r.streamName != "" ||
			!strings.HasPrefix(r.lastError, "rejected: "+natssink.ReasonWrongStream+": ") || !strings.Contains(r.lastError, c.by) {
			t.Errorf("%s: %+v, want scheduled, rejected as %s naming %s", c.id, r, natssink.ReasonWrongStream, c.by)
		}
	}
	insert("kept", "keep.z", "")
	testenv.WaitFor(t, 30*time.Second, "kept published", func() (bool, error) {
		r := h.row("kept")
		return r.state == "published", fmt.Errorf("%+v", r)
	})
	if r := h.row("kept"); r.streamName != s.stream || r.streamSeq != 2 {
		t.Errorf("kept: %+v, want published into %s at sequence 2", r, s.stream)
	}
	for _, name := range []string{taker, prefixTaker} {
		if n := h.msgsIn(name); n != 0 {
			t.Errorf("stream %s, which the relay may not write to, holds %d messages", name, n)
		}
	}
}

// Issue 20, item 10 on the CDC path, the way the attack did it: a work ID
// reused for other content inside the duplicate window, after its row was
// deleted (by prune or by --on-publish delete). The broker keeps the first
// message and acks the second as a duplicate. Before, only a counter
// recorded it; now the work ID is logged, and with --on-publish mark the
// row says which message it points at.
func TestCDCRecordsADuplicateAck(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	for _, policy := range []store.Policy{store.PolicyMark, store.PolicyDelete} {
		t.Run(string(policy), func(t *testing.T) {
			s := sharedSetup(t)
			h := newHarness(t, s)
			h.opts.Policy = policy
			logs := &testenv.LogBuffer{}
			h.logs = logs
			h.start()
			for i, payload := range []string{`{"v": 1}`, `{"v": 2}`} {
				if i > 0 && policy == store.PolicyMark {
					h.exec(`DELETE FROM outbox WHERE work_id = 'reused'`)
				}
				h.exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('reused', 'k', $1)`, payload)
				testenv.WaitFor(t, 30*time.Second, "the row settled", func() (bool, error) {
					r := h.row("reused")
					return r.found == (policy == store.PolicyMark) && r.state != "ready", fmt.Errorf("%+v", r)
				})
			}
			if policy == store.PolicyMark {
				r := h.row("reused")
				want := fmt.Sprintf("duplicate: duplicate of stream sequence 1 in stream %s", s.stream)
				if r.state != "published" || r.streamSeq != 1 || r.streamName != s.stream || !strings.HasPrefix(r.lastError, want) {
					t.Errorf("row %+v, want published at sequence 1 with last_error %q...", r, want)
				}
			}
			msgs, counts := h.streamMsgs()
			if m := msgs["reused"]; len(counts) != 1 || counts["reused"] != 1 || string(m.Data) != `{"v": 1}` {
				t.Errorf("stream holds %v, want the first content once", counts)
			}
			if l := logs.String(); !strings.Contains(l, `"work_id":"reused"`) || !strings.Contains(l, "duplicate ack") || !strings.Contains(l, `"stream_seq":1`) {
				t.Errorf("no warning naming the work ID and the kept message in the log")
			}
		})
	}
}
