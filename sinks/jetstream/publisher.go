package jetstream

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// publisher is JetStream's asynchronous publish done on the core
// connection, at a fraction of nats.go's cost per message (its
// PublishMsgAsync takes a timer, a map entry, a reply string and channels
// per message, and decodes every ack with encoding/json), with the same
// outcomes:
//
//   - a publish goes out with a reply subject under one wildcard
//     subscription of the publisher's own (<inbox>.<token>, the token a
//     counter), and the answer on it resolves the publish: a PubAck, an API
//     error, or ErrInvalidJSAck;
//   - no responders (JetStream has no stream for the subject, or is
//     restarting) is retried twice, 250ms apart, then fails with
//     jetstream.ErrNoStreamResponse;
//   - no answer within the ack timeout of the publish (the last attempt)
//     fails it with jetstream.ErrAsyncPublishTimeout;
//   - a lost connection (RECONNECTING) fails every pending publish with
//     nats.ErrDisconnected: the message may or may not have been stored.
//
// Pending publishes sit in a ring indexed by token, in publish order, so
// their deadlines only grow along it: one timer, set for the oldest, serves
// them all.
type publisher struct {
	nc      *nats.Conn
	timeout time.Duration
	epoch   time.Time // deadlines are nanoseconds on the monotonic clock since epoch

	mu          sync.Mutex
	started     bool
	prefix      string    // "<inbox>.": a reply subject is prefix + token
	next        uint64    // token of the next publish
	head        uint64    // tokens below head are resolved
	ring        []*future // pending publishes: ring[t&(len-1)] for t in [head, next); nil once resolved
	timer       *time.Timer
	armed       bool   // timer is set, or its function is about to run
	disconnects uint64 // RECONNECTING events seen

	// replies is the reply subscription's channel. nats.go's read loop
	// puts each answer there, and whoever waits for a future takes them
	// (pump): one goroutine hand-off per answer instead of two (a callback
	// subscription runs on a goroutine of its own, which then wakes the
	// waiter).
	replies chan *nats.Msg
	buffer  int       // replies' capacity
	acks    ackParser // under pumpMu
	pumpMu  sync.Mutex

	// Atomic batches' IDs: batchPrefix (random, set once) and a counter.
	batchOnce   sync.Once
	batchPrefix string
	batches     atomic.Uint64
}

// nats.go's retry of a publish that found no responders (a stream leader
// moving, JetStream starting): jetstream.DefaultPubRetryAttempts retries,
// jetstream.DefaultPubRetryWait apart.
const (
	noRespondersRetries = jetstream.DefaultPubRetryAttempts
	noRespondersWait    = jetstream.DefaultPubRetryWait
)

func newPublisher(nc *nats.Conn, timeout time.Duration, buffer int) *publisher {
	return &publisher{nc: nc, timeout: timeout, epoch: time.Now(), ring: make([]*future, 64), buffer: buffer}
}

func (p *publisher) now() int64 { return int64(time.Since(p.epoch)) }

// start subscribes to the replies and watches the connection, once, on the
// first publish (as nats.go does). p.mu is held.
func (p *publisher) start() error {
	if p.started {
		return nil
	}
	if p.nc == nil {
		return nats.ErrInvalidConnection
	}
	prefix := p.nc.NewInbox() + "."
	replies := make(chan *nats.Msg, p.buffer)
	if _, err := p.nc.ChanSubscribe(prefix+"*", replies); err != nil {
		return err
	}
	p.replies = replies
	p.prefix, p.started = prefix, true
	p.timer = time.AfterFunc(time.Hour, p.sweep)
	p.timer.Stop()
	ch := p.nc.StatusChanged(nats.RECONNECTING, nats.CLOSED)
	if p.nc.IsClosed() {
		// Closed before the listener was in place: no CLOSED will come.
		p.nc.RemoveStatusListener(ch)
		return nil
	}
	go p.watch(ch)
	return nil
}

// publish registers f for its answer and sends its message. When sending
// fails, f is not pending any more, and taken reports whether publish took
// it out (else a disconnect failed it meanwhile).
func (p *publisher) publish(f *future) (taken bool, err error) {
	p.mu.Lock()
	if err := p.start(); err != nil {
		p.mu.Unlock()
		return true, err
	}
	token := p.register(f)
	p.mu.Unlock()

	var buf [96]byte
	reply := string(strconv.AppendUint(append(buf[:0], p.prefix...), token, 10))
	err = p.nc.PublishMsg(&nats.Msg{Subject: f.msg.Subject, Reply: reply, Data: f.msg.Data, Header: f.hdr})
	if err != nil {
		p.mu.Lock()
		taken = p.remove(f, token)
		p.mu.Unlock()
	}
	return taken, err
}

// register gives f the next token and its deadline. p.mu is held.
func (p *publisher) register(f *future) uint64 {
	if p.next-p.head == uint64(len(p.ring)) {
		p.grow()
	}
	token := p.next
	p.next++
	p.ring[token&uint64(len(p.ring)-1)] = f
	f.token = token
	f.deadline = p.now() + int64(p.timeout)
	if !p.armed {
		// Nothing else is pending (see sweep): f is the oldest.
		p.armed = true
		p.timer.Reset(p.timeout)
	}
	return token
}

func (p *publisher) grow() {
	ring := make([]*future, 2*len(p.ring))
	for t := p.head; t != p.next; t++ {
		ring[t&uint64(len(ring)-1)] = p.ring[t&uint64(len(p.ring)-1)]
	}
	p.ring = ring
}

// lookup returns the pending publish of token, or nil. p.mu is held.
func (p *publisher) lookup(token uint64) *future {
	if token < p.head || token >= p.next {
		return nil
	}
	f := p.ring[token&uint64(len(p.ring)-1)]
	if f == nil || f.token != token {
		return nil
	}
	return f
}

// remove takes f, pending under token, out of the ring, and reports
// whether it was still there. p.mu is held.
func (p *publisher) remove(f *future, token uint64) bool {
	if p.lookup(token) != f {
		return false
	}
	mask := uint64(len(p.ring) - 1)
	p.ring[token&mask] = nil
	for p.head != p.next && p.ring[p.head&mask] == nil {
		p.head++
	}
	return true
}

// replyBuffer is how many answers the reply channel holds for a caller
// that keeps pending publishes at most: past it nats.go drops an answer (a
// slow consumer; its publish then times out, an uncertain outcome, never a
// loss). A caller waits whenever its publishes are pending, and the sweep
// and the disconnect watch take what is there before failing any, so the
// channel holds at most the answers that came while the waiter was busy.
func replyBuffer(pending int) int {
	return max(minReplyBuffer, 2*pending)
}

// minReplyBuffer: 128 KB of pointers.
const minReplyBuffer = 1 << 14

// take handles every answer already in, without waiting.
func (p *publisher) take() {
	if p.replies == nil {
		return
	}
	for {
		select {
		case m := <-p.replies:
			p.handle(m)
		default:
			return
		}
	}
}

// handle resolves the publish the reply subject names.
func (p *publisher) handle(m *nats.Msg) {
	token, ok := parseToken(m.Subject, len(p.prefix))
	if !ok {
		return
	}
	p.mu.Lock()
	f := p.lookup(token)
	if f == nil {
		// Timed out, failed by a disconnect, or not ours.
		p.mu.Unlock()
		return
	}
	p.remove(f, token)
	if f.batch != nil {
		p.mu.Unlock()
		p.resolveBatch(f, m)
		return
	}
	if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
		// No responders, as nats.go detects it.
		if f.retries < noRespondersRetries {
			f.retries++
			gen := p.disconnects
			p.mu.Unlock()
			time.AfterFunc(noRespondersWait, func() { p.retry(f, gen) })
			return
		}
		p.mu.Unlock()
		f.resolve(sinks.Ack{}, jetstream.ErrNoStreamResponse)
		return
	}
	p.mu.Unlock()
	p.pumpMu.Lock()
	ack, err := p.acks.parse(m.Data)
	p.pumpMu.Unlock()
	f.resolve(ack, err)
}

// retry publishes f again after no responders, unless the connection was
// lost meanwhile (nats.go fails it then, as it fails every pending publish).
func (p *publisher) retry(f *future, gen uint64) {
	p.mu.Lock()
	if p.disconnects != gen {
		p.mu.Unlock()
		f.resolve(sinks.Ack{}, nats.ErrDisconnected)
		return
	}
	p.mu.Unlock()
	if taken, err := p.publish(f); err != nil && taken {
		f.resolve(sinks.Ack{}, err)
	}
}

// sweep is the timer's function: it fails the publishes whose ack timeout
// passed and sets the timer for the oldest one left.
func (p *publisher) sweep() {
	p.take() // an answer waiting in the channel is not a timeout
	p.mu.Lock()
	defer p.mu.Unlock()
	now := p.now()
	mask := uint64(len(p.ring) - 1)
	for ; p.head != p.next; p.head++ {
		f := p.ring[p.head&mask]
		if f == nil {
			continue
		}
		if f.deadline > now {
			p.timer.Reset(time.Duration(f.deadline - now))
			return
		}
		p.ring[p.head&mask] = nil
		f.resolve(sinks.Ack{}, jetstream.ErrAsyncPublishTimeout)
	}
	p.armed = false
}

// watch fails every pending publish when the connection is lost, as
// nats.go's jetstream does, until the connection is closed (pending
// publishes then run into their ack timeout).
func (p *publisher) watch(ch chan nats.Status) {
	defer p.nc.RemoveStatusListener(ch)
	for st := range ch {
		if st == nats.CLOSED {
			return
		}
		p.take() // answers read before the connection went
		p.mu.Lock()
		p.disconnects++
		mask := uint64(len(p.ring) - 1)
		for ; p.head != p.next; p.head++ {
			if f := p.ring[p.head&mask]; f != nil {
				p.ring[p.head&mask] = nil
				f.resolve(sinks.Ack{}, nats.ErrDisconnected)
			}
		}
		p.mu.Unlock()
	}
}

// parseToken reads the decimal token after the prefix of a reply subject.
func parseToken(subject string, prefixLen int) (uint64, bool) {
	if len(subject) <= prefixLen || len(subject)-prefixLen > 20 {
		return 0, false
	}
	var n uint64
	for i := prefixLen; i < len(subject); i++ {
		c := subject[i]
		if c < '0' || c > '9' {
			return 0, false
		}
		d := uint64(c - '0')
		if n > (1<<64-1-d)/10 {
			return 0, false
		}
		n = n*10 + d
	}
	return n, true
}

// States of a future.
const (
	statePending uint32 = iota // no answer yet, nobody waits on ch
	stateWaiting               // no answer yet, ch is made and waited on
	stateDone                  // ack and err are final
)

var _ sinks.Future = (*future)(nil)

// future is one publish: its registration in the publisher and the
// sinks.Future the caller waits on.
type future struct {
	sink *Sink
	msg  *wire.Message
	hdr  nats.Header
	id   [1]string // the Nats-Msg-Id header's value slice, when the sink had to set it
	// stream is the allowed stream the binding resolved for the subject:
	// the message's Nats-Expected-Stream, and the only stream whose ack
	// counts.
	stream string

	// Owned by the publisher (under its mu) until resolved.
	token    uint64
	deadline int64
	retries  int

	// batch, on the last message of an atomic batch (the one that commits
	// it and is answered), is every message of the batch, in order; its
	// answer resolves them all. batchID is the batch's Nats-Batch-Id.
	batch   []*future
	batchID string
	index   int // the message's place in PublishBatch's arguments

	state atomic.Uint32
	ch    chan struct{} // closed on resolve once a Wait blocked
	ack   sinks.Ack
	err   error
}

// resolve records the outcome and wakes a waiter. The publisher calls it
// exactly once per future: only for the one it took out of its ring. On
// the commit of a batch it records the outcome for every message of the
// batch.
func (f *future) resolve(ack sinks.Ack, err error) {
	for _, g := range f.batch {
		if g != f {
			g.settle(ack, err)
		}
	}
	f.settle(ack, err)
}

// settle records the outcome of f alone.
func (f *future) settle(ack sinks.Ack, err error) {
	f.ack, f.err = ack, err
	if f.state.Swap(stateDone) == stateWaiting {
		close(f.ch)
	}
}

// done returns a channel to wait on, or nil once the outcome is in.
func (f *future) done() <-chan struct{} {
	switch f.state.Load() {
	case stateDone:
		return nil
	case stateWaiting:
		return f.ch
	}
	f.ch = make(chan struct{})
	if f.state.CompareAndSwap(statePending, stateWaiting) {
		return f.ch
	}
	return nil // resolved meanwhile
}
