package jetstream_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

func waitFor(t testing.TB, fut sinks.Future) (sinks.Ack, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ack, err := fut.Wait(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		t.Fatal("the future did not resolve in 30s")
	}
	return ack, err
}

// Every ack carries the broker's own stream, sequence and duplicate flag:
// 1,000 publishes into two streams, a quarter of them repeats of earlier
// work IDs (stored once, acked as duplicates with the first one's
// sequence), checked against what the streams hold.
func TestAcksAreTheBrokers(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	other := f.stream + "_B"
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: other, Subjects: []string{other + ".>"}, Duplicates: time.Minute}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), other) })
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix, AllowStreams: []string{other}})

	type sent struct {
		msg    *wire.Message
		fut    sinks.Future
		stream string
		repeat int // index of the first publish of this ID, or -1
	}
	r := rand.New(rand.NewPCG(1, 2))
	var all []sent
	for i := range 1000 {
		s := sent{repeat: -1}
		if i > 10 && r.IntN(4) == 0 {
			s.repeat = r.IntN(i)
			for all[s.repeat].repeat >= 0 {
				s.repeat = all[s.repeat].repeat
			}
			first := all[s.repeat]
			// A new message object, as a republish after a restart has.
			s.msg = &wire.Message{ID: first.msg.ID, Subject: first.msg.Subject, Data: first.msg.Data,
				Header: map[string][]string{"Outbox-Kind": {"k"}}}
			s.stream = first.stream
		} else {
			s.msg = &wire.Message{ID: fmt.Sprintf("w-%d", i), Data: fmt.Appendf(nil, `{"i":%d}`, i),
				Header: map[string][]string{"Outbox-Kind": {"k"}}}
			if r.IntN(3) == 0 {
				s.msg.Subject, s.stream = other+".x", other
			} else {
				s.msg.Subject, s.stream = f.prefix+"x", f.stream
			}
			if r.IntN(5) == 0 {
				s.msg.Header = nil
			}
		}
		fut, err := sink.Publish(ctx, s.msg)
		if err != nil {
			t.Fatal(err)
		}
		s.fut = fut
		all = append(all, s)
	}
	acks := make([]sinks.Ack, len(all))
	stored := map[string]int{}
	for i, s := range all {
		ack, err := waitFor(t, s.fut)
		if err != nil {
			t.Fatalf("publish %d (%s): %v", i, s.msg.ID, err)
		}
		acks[i] = ack
		if ack.Stream != s.stream {
			t.Errorf("publish %d: acked by stream %q, want %q", i, ack.Stream, s.stream)
		}
		if s.repeat >= 0 {
			if !ack.Duplicate || ack.Sequence != acks[s.repeat].Sequence {
				t.Errorf("repeat %d of %s: ack %+v, want a duplicate of sequence %d", i, s.msg.ID, ack, acks[s.repeat].Sequence)
			}
			continue
		}
		if ack.Duplicate {
			t.Errorf("publish %d: first of %s acked as a duplicate", i, s.msg.ID)
		}
		stored[s.stream]++
		st, err := f.js.Stream(ctx, s.stream)
		if err != nil {
			t.Fatal(err)
		}
		got, err := st.GetMsg(ctx, ack.Sequence)
		if err != nil {
			t.Fatalf("publish %d: sequence %d of %s: %v", i, ack.Sequence, s.stream, err)
		}
		if id := got.Header.Get(jetstream.MsgIDHeader); id != s.msg.ID || string(got.Data) != string(s.msg.Data) {
			t.Errorf("publish %d: sequence %d holds %s %s, want %s %s", i, ack.Sequence, id, got.Data, s.msg.ID, s.msg.Data)
		}
	}
	for name, n := range stored {
		st, err := f.js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		if held := st.CachedInfo().State.Msgs; held != uint64(n) {
			t.Errorf("stream %s holds %d messages, want %d", name, held, n)
		}
	}
	t.Logf("stored %v", stored)
}

// A message over the stream's max_msg_size is refused by JetStream with an
// API error: rejected for good, with the broker's error kept.
func TestMessageOverMaxMsgSizeIsRejected(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.MaxMsgSize = 1024
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	big, err := sink.Publish(ctx, &wire.Message{ID: "big", Subject: f.prefix + "x", Data: make([]byte, 4096)})
	if err != nil {
		t.Fatal(err)
	}
	small, err := sink.Publish(ctx, &wire.Message{ID: "small", Subject: f.prefix + "x", Data: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = waitFor(t, big)
	re, ok := wire.IsRejected(err)
	var apiErr *jetstream.APIError
	if !ok || re.Reason != "max_msg_size" || !errors.As(err, &apiErr) || apiErr.ErrorCode != jetstream.JSErrCodeStreamMessageExceedsMaximum {
		t.Errorf("over max_msg_size: %v, want rejected max_msg_size with the API error", err)
	}
	if !strings.Contains(fmt.Sprint(err), "ack for big on "+f.prefix+"x") {
		t.Errorf("error %q does not name the message", err)
	}
	if ack, err := waitFor(t, small); err != nil || ack.Sequence != 1 {
		t.Errorf("the next message: %+v, %v", ack, err)
	}
}

// A subject no stream binds (here the relay's own stream is gone) gets no
// responders; after nats.go's two retries it is a rejection, no_stream.
func TestNoStreamIsRejected(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	missing := f.stream + "_MISSING"
	prefix := missing + "."
	sink := natssink.New(f.js, natssink.Options{Stream: missing, SubjectPrefix: prefix})
	start := time.Now()
	fut, err := sink.Publish(ctx, &wire.Message{ID: "lost", Subject: prefix + "x", Data: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = waitFor(t, fut)
	if re, ok := wire.IsRejected(err); !ok || re.Reason != natssink.ReasonNoStream {
		t.Fatalf("no stream: %v, want rejected %s", err, natssink.ReasonNoStream)
	}
	if !errors.Is(err, jetstream.ErrNoStreamResponse) {
		t.Errorf("no stream: %v, want it to wrap %v", err, jetstream.ErrNoStreamResponse)
	}
	if d := time.Since(start); d < 2*jetstream.DefaultPubRetryWait {
		t.Errorf("rejected after %v: the no-responders retries were skipped", d)
	}
}

// No responders is retried as nats.go does: a stream that appears
// meanwhile (a leader elected, JetStream started) takes the message.
func TestNoRespondersIsRetried(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	late := f.stream + "_LATE"
	sink := natssink.New(f.js, natssink.Options{Stream: late, SubjectPrefix: late + "."})
	fut, err := sink.Publish(ctx, &wire.Message{ID: "early", Subject: late + ".x", Data: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.js.CreateStream(ctx, jetstream.StreamConfig{Name: late, Subjects: []string{late + ".>"}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.js.DeleteStream(context.Background(), late) })
	ack, err := waitFor(t, fut)
	if err != nil || ack.Stream != late || ack.Sequence != 1 {
		t.Fatalf("ack %+v, %v; want stored in %s", ack, err, late)
	}
}

// ownNATS is a server of the test's own, to stop and kill.
func ownNATS(t *testing.T) (*testenv.NATS, *nats.Conn, jetstream.JetStream, string) {
	t.Helper()
	n, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Close)
	nc, err := nats.Connect(n.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := natssink.EnsureStream(context.Background(), js, natssink.StreamConfig{Name: "S", SubjectPrefix: "s.", DuplicateWindow: time.Minute}); err != nil {
		t.Fatal(err)
	}
	return n, nc, js, "s.x"
}

// freeze stops the server process and waits until every one of its
// threads is stopped (SIGSTOP takes effect asynchronously); the returned
// function lets it run again.
func freeze(t *testing.T, n *testenv.NATS) (thaw func()) {
	t.Helper()
	pid := n.PID()
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	thawed := false
	thaw = func() {
		if !thawed {
			thawed = true
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}
	t.Cleanup(thaw)
	testenv.WaitFor(t, 10*time.Second, "nats-server stopped", func() (bool, error) {
		tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/stat", pid))
		if err != nil || len(tasks) == 0 {
			return false, err
		}
		for _, task := range tasks {
			stat, err := os.ReadFile(task)
			if err != nil {
				return false, nil
			}
			// pid (comm) state ...: comm may hold spaces, the state follows the last ')'.
			i := bytes.LastIndexByte(stat, ')')
			if i < 0 || i+2 >= len(stat) || (stat[i+2] != 'T' && stat[i+2] != 't') {
				return false, nil
			}
		}
		return true, nil
	})
	return thaw
}

// checkOutage: err is an outage (retry later), not a rejection.
func checkOutage(t *testing.T, what string, err error, want error) {
	t.Helper()
	if _, rejected := wire.IsRejected(err); err == nil || rejected || !errors.Is(err, want) {
		t.Errorf("%s: %v, want an outage wrapping %v", what, err, want)
	}
}

// Publishes the broker never answers fail after the ack timeout, measured
// from each one's publish: with the server frozen (the connection stays
// up), and with the server gone (the publish waits in the client's
// reconnect buffer). A publish in flight when the connection breaks fails
// at once, as with nats.go. After the server is back the sink publishes
// again on the same connection.
func TestAckTimeout(t *testing.T) {
	n, nc, js, subject := ownNATS(t)
	ctx := context.Background()
	const timeout = 700 * time.Millisecond
	sink := natssink.New(js, natssink.Options{Stream: "S", SubjectPrefix: "s.", AckTimeout: timeout})
	publish := func(id string) sinks.Future {
		t.Helper()
		fut, err := sink.Publish(ctx, &wire.Message{ID: id, Subject: subject, Data: []byte(id)})
		if err != nil {
			t.Fatal(err)
		}
		return fut
	}
	if _, err := waitFor(t, publish("before")); err != nil {
		t.Fatal(err)
	}

	// Frozen: no answer on a live connection.
	freeze(t, n)
	start := time.Now()
	first := publish("frozen-1")
	time.Sleep(timeout / 2)
	second := publish("frozen-2")
	_, err := waitFor(t, first)
	d1 := time.Since(start)
	checkOutage(t, "frozen server", err, sinks.ErrAckTimeout)
	if !errors.Is(err, jetstream.ErrAsyncPublishTimeout) {
		t.Errorf("frozen server: %v, want it to wrap %v", err, jetstream.ErrAsyncPublishTimeout)
	}
	_, err = waitFor(t, second)
	d2 := time.Since(start)
	checkOutage(t, "frozen server, second publish", err, sinks.ErrAckTimeout)
	if d1 < timeout || d1 > timeout+time.Second || d2 < timeout+timeout/2 || d2 > timeout/2+timeout+time.Second {
		t.Errorf("timed out after %v and %v, want %v and %v after each publish", d1, d2, timeout, timeout)
	}

	// In flight when the connection breaks: failed at once, before the ack
	// timeout. (That they failed also shows the sink saw the disconnect.)
	var inflight []sinks.Future
	for i := range 10 {
		inflight = append(inflight, publish(fmt.Sprintf("inflight-%d", i)))
	}
	if err := n.Kill(); err != nil { // SIGKILL ends a stopped process too
		t.Fatal(err)
	}
	for i, fut := range inflight {
		_, err := waitFor(t, fut)
		checkOutage(t, fmt.Sprintf("in flight at the disconnect (%d)", i), err, nats.ErrDisconnected)
	}
	if s := nc.Status(); s != nats.RECONNECTING {
		t.Fatalf("connection %v, want reconnecting", s)
	}

	// Gone: the publish sits in the reconnect buffer, unanswered.
	start = time.Now()
	_, err = waitFor(t, publish("while-down"))
	checkOutage(t, "server down", err, sinks.ErrAckTimeout)
	if d := time.Since(start); d < timeout || d > timeout+time.Second {
		t.Errorf("server down: timed out after %v, want %v", d, timeout)
	}

	// Back: the same sink works on the reconnected connection.
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "client reconnected", func() (bool, error) { return nc.IsConnected(), nil })
	testenv.WaitFor(t, 20*time.Second, "publish after the restart", func() (bool, error) {
		fut := publish(fmt.Sprintf("after-%d", time.Now().UnixNano()))
		_, err := waitFor(t, fut)
		return err == nil, nil
	})
	if _, err := waitFor(t, publish("after")); err != nil {
		t.Errorf("after the restart: %v", err)
	}
}

// A closed connection: publishing fails at once (an outage), and a publish
// pending when it closed still ends with the ack timeout rather than
// hanging.
func TestClosedConnection(t *testing.T) {
	n, nc, js, subject := ownNATS(t)
	ctx := context.Background()
	const timeout = 500 * time.Millisecond
	sink := natssink.New(js, natssink.Options{Stream: "S", SubjectPrefix: "s.", AckTimeout: timeout})
	freeze(t, n)
	fut, err := sink.Publish(ctx, &wire.Message{ID: "pending", Subject: subject, Data: []byte("x")})
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	_, err = waitFor(t, fut)
	checkOutage(t, "pending at close", err, sinks.ErrAckTimeout)
	_, err = sink.Publish(ctx, &wire.Message{ID: "after", Subject: subject, Data: []byte("x")})
	checkOutage(t, "publish on a closed connection", err, nats.ErrConnectionClosed)
}

// Many goroutines publish and wait at once, some waits giving up and being
// repeated: every future resolves to its own ack (run with -race).
func TestConcurrentPublishers(t *testing.T) {
	f := newFixture(t)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	var mu sync.Mutex
	seqs := map[uint64]string{}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			ctx := context.Background()
			var futs []sinks.Future
			var ids []string
			for i := range 300 {
				id := fmt.Sprintf("g%d-%d", g, i)
				fut, err := sink.Publish(ctx, &wire.Message{ID: id, Subject: f.prefix + "c", Data: []byte(id)})
				if err != nil {
					t.Error(err)
					return
				}
				if i%7 == 0 {
					// A wait that gives up at once, then a real one.
					cctx, cancel := context.WithCancel(ctx)
					cancel()
					if _, err := fut.Wait(cctx); err != nil && !errors.Is(err, context.Canceled) {
						t.Errorf("%s: %v", id, err)
					}
				}
				futs, ids = append(futs, fut), append(ids, id)
			}
			for i, fut := range futs {
				ack, err := waitFor(t, fut)
				if err != nil || ack.Duplicate || ack.Stream != f.stream {
					t.Errorf("%s: %+v, %v", ids[i], ack, err)
					continue
				}
				mu.Lock()
				if other, ok := seqs[ack.Sequence]; ok {
					t.Errorf("%s and %s acked with sequence %d", ids[i], other, ack.Sequence)
				}
				seqs[ack.Sequence] = ids[i]
				mu.Unlock()
				// Waiting again gives the same answer.
				if again, err := fut.Wait(ctx); err != nil || again != ack {
					t.Errorf("%s: second wait %+v, %v; first %+v", ids[i], again, err, ack)
				}
			}
		})
	}
	wg.Wait()
	st, err := f.js.Stream(context.Background(), f.stream)
	if err != nil {
		t.Fatal(err)
	}
	for seq, id := range seqs {
		if seq%97 != 0 {
			continue
		}
		got, err := st.GetMsg(context.Background(), seq)
		if err != nil || got.Header.Get(jetstream.MsgIDHeader) != id {
			t.Errorf("sequence %d: %v, want %s", seq, err, id)
		}
	}
}

// Issue 30: a broker outage used to be logged as nats.go's "outbound buffer
// limit exceeded" (the relay buffers nothing while disconnected, so every
// publish fails so at once), which says neither what is happening nor what
// to do. The error now says the broker is unreachable, that nothing is lost
// and what to check; it is still an outage, not a rejection, and wraps the
// client's error. Once the server is back, publishing works again.
func TestBrokerOutageSaysWhatIsHappening(t *testing.T) {
	n, _, _, subject := ownNATS(t)
	nc, err := nats.Connect(n.URL(), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.ReconnectBufSize(-1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sink := natssink.New(js, natssink.Options{Stream: "S", SubjectPrefix: "s."})
	if _, err := waitFor(t, mustPublish(t, sink, "before", subject)); err != nil {
		t.Fatal(err)
	}
	if err := n.Stop(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 10*time.Second, "the client reconnecting", func() (bool, error) {
		return nc.Status() == nats.RECONNECTING, fmt.Errorf("status %s", nc.Status())
	})
	_, err = sink.Publish(ctx, &wire.Message{ID: "during", Subject: subject, Data: []byte("x")})
	checkOutage(t, "publish while the broker is down", err, nats.ErrReconnectBufExceeded)
	for _, want := range []string{"broker is unreachable", "nothing was sent", "--nats-url"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("outage error %v does not say %q", err, want)
		}
	}
	if err := n.Start(); err != nil {
		t.Fatal(err)
	}
	testenv.WaitFor(t, 20*time.Second, "publishing again after the broker is back", func() (bool, error) {
		fut, err := sink.Publish(ctx, &wire.Message{ID: "after", Subject: subject, Data: []byte("x")})
		if err != nil {
			return false, err
		}
		_, err = waitFor(t, fut)
		return err == nil, err
	})
}

func mustPublish(t *testing.T, s *natssink.Sink, id, subject string) sinks.Future {
	t.Helper()
	fut, err := s.Publish(context.Background(), &wire.Message{ID: id, Subject: subject, Data: []byte(id)})
	if err != nil {
		t.Fatal(err)
	}
	return fut
}

// The answers wait in a channel until someone waits for a future: a caller
// busy for longer than the ack timeout (a statement, a slow mark) still
// gets the broker's acks, not timeouts for messages that were stored.
func TestAnswersNobodyWaitedForAreNotTimeouts(t *testing.T) {
	f := newFixture(t)
	ctx := context.Background()
	const timeout = 300 * time.Millisecond
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix, AckTimeout: timeout, Pending: 50})
	var futs []sinks.Future
	for i := range 50 {
		id := fmt.Sprintf("busy-%d", i)
		fut, err := sink.Publish(ctx, &wire.Message{ID: id, Subject: f.prefix + "busy", Data: []byte(id)})
		if err != nil {
			t.Fatal(err)
		}
		futs = append(futs, fut)
	}
	time.Sleep(3 * timeout) // nobody waits: the sweep runs meanwhile
	seen := map[uint64]bool{}
	for i, fut := range futs {
		ack, err := waitFor(t, fut)
		if err != nil {
			t.Fatalf("publish %d: %v, want its ack", i, err)
		}
		if ack.Duplicate || seen[ack.Sequence] {
			t.Fatalf("publish %d: %+v", i, ack)
		}
		seen[ack.Sequence] = true
	}
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 50 {
		t.Fatalf("stream holds %d messages, want 50", info.State.Msgs)
	}
}
