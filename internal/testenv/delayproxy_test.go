package testenv

import (
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
)

// TestDelayProxy puts the proxy between a NATS client and the shared
// server, with the responder on a direct connection, so only the answers
// the proxied client reads are late.
func TestDelayProxy(t *testing.T) {
	env := Shared(t)
	p := NewDelayProxy(t, fmt.Sprintf("127.0.0.1:%d", env.NATS.Port()))

	direct, err := nats.Connect(env.NATS.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(direct.Close)
	subj, fanout := nats.NewInbox(), nats.NewInbox()
	if _, err := direct.Subscribe(subj, func(m *nats.Msg) { _ = m.Respond(m.Data) }); err != nil {
		t.Fatal(err)
	}
	if err := direct.Flush(); err != nil {
		t.Fatal(err)
	}
	reconnected := make(chan struct{}, 1)
	nc, err := nats.Connect("nats://"+p.Addr(), nats.MaxReconnects(-1),
		nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0),
		nats.ReconnectHandler(func(*nats.Conn) {
			select {
			case reconnected <- struct{}{}:
			default:
			}
		}))
	if err != nil {
		t.Fatalf("connect through the proxy: %v", err)
	}
	t.Cleanup(nc.Close)
	msgs := make(chan *nats.Msg, 1000)
	if _, err := nc.ChanSubscribe(fanout, msgs); err != nil {
		t.Fatal(err)
	}
	// Before any delay, so the server has the subscription without a
	// delayed PONG to wait for.
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	request := func(what string) time.Duration {
		t.Helper()
		start := time.Now()
		m, err := nc.Request(subj, []byte(what), 5*time.Second)
		if err != nil {
			t.Fatalf("request %q through the proxy: %v", what, err)
		}
		if string(m.Data) != what {
			t.Fatalf("request %q: reply %q", what, m.Data)
		}
		return time.Since(start)
	}

	const delay = 1300 * time.Millisecond
	if took := request("before"); took >= delay/2 {
		t.Errorf("request without delay took %v", took)
	}
	if n := p.Delayed(); n != 0 {
		t.Errorf("Delayed() = %d before SetDelay", n)
	}

	p.SetDelay(delay)
	took := request("delayed")
	if took < delay {
		t.Errorf("request with a %v delay took %v", delay, took)
	}
	if p.Delayed() == 0 {
		t.Error("Delayed() = 0 after a delayed request")
	}
	t.Logf("request with a %v delay took %v; %d chunks delayed", delay, took.Round(time.Millisecond), p.Delayed())

	// Batches flushed one by one reach the client as separate chunks: in
	// order, and all about one delay after they were sent, not one delay
	// per chunk.
	const batches, perBatch = 10, 50
	chunksBefore := p.Delayed()
	start := time.Now()
	for b := range batches {
		for i := range perBatch {
			if err := direct.Publish(fanout, []byte(strconv.Itoa(b*perBatch+i))); err != nil {
				t.Fatal(err)
			}
		}
		if err := direct.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	var first, last time.Time
	for i := range batches * perBatch {
		select {
		case m := <-msgs:
			if string(m.Data) != strconv.Itoa(i) {
				t.Fatalf("message %d through the proxy is %q", i, m.Data)
			}
			if i == 0 {
				first = time.Now()
			}
			last = time.Now()
		case <-time.After(5 * time.Second):
			t.Fatalf("message %d did not arrive through the proxy", i)
		}
	}
	chunks := p.Delayed() - chunksBefore
	t.Logf("%d messages in %d delayed chunks: first after %v, last after %v", batches*perBatch, chunks,
		first.Sub(start).Round(time.Millisecond), last.Sub(start).Round(time.Millisecond))
	if first.Sub(start) < delay {
		t.Errorf("first message arrived %v after it was sent, under the %v delay", first.Sub(start), delay)
	}
	if chunks < 2 {
		t.Errorf("the batches came in %d chunks; the test needs several to tell latency from a per-chunk sleep", chunks)
	}
	if last.Sub(start) >= 2*delay {
		t.Errorf("last message arrived %v after the first was sent: the delay is applied per chunk, not as latency", last.Sub(start))
	}

	p.SetDelay(0)
	// What the server sent meanwhile (its first PING to a client comes two
	// seconds after the connect) keeps its due time and holds back what
	// follows; a flush's PONG comes after all of it.
	if err := nc.FlushTimeout(5 * time.Second); err != nil {
		t.Fatal(err)
	}
	after := request("after")
	if after >= delay/2 {
		t.Errorf("request after SetDelay(0) took %v", after)
	}

	delayedBefore := p.Delayed()
	p.CutAll()
	select {
	case <-reconnected:
	case <-time.After(5 * time.Second):
		t.Fatal("client did not reconnect through the proxy after CutAll")
	}
	again := request("reconnected")
	if again >= delay/2 {
		t.Errorf("request after the reconnect took %v", again)
	}
	t.Logf("requests without delay took %v, and %v after CutAll and a reconnect", after.Round(time.Microsecond), again.Round(time.Microsecond))
	if n := p.Delayed(); n != delayedBefore {
		t.Errorf("Delayed() went from %d to %d without a delay set", delayedBefore, n)
	}
}
