package chaos

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Mode is what a Proxy does to the traffic between the relay and a server.
type Mode int

const (
	// Pass forwards bytes as they come.
	Pass Mode = iota
	// Cut closes every connection and refuses new ones (accepted, then
	// closed at once), as a peer that went away or a firewall sending RST.
	Cut
	// Latency delays every chunk by the proxy's delay, in order, in both
	// directions.
	Latency
	// Blackhole keeps connections open but drops every byte, as a network
	// partition does: neither side learns of it until a timeout fires. On
	// heal the connections that saw the partition are closed, because a
	// TCP stream that lost bytes cannot be resumed.
	Blackhole
	// SlowReplies delays only what the server sends (its answers, acks,
	// pushed data); what the client sends arrives at once. A broker that
	// stores a publish promptly and answers it late is a different fault
	// from a slow network: the client's timeouts run, the server's do not.
	SlowReplies
	// SlowRequests delays only what the client sends: the server acts on
	// a request the delay after the client made it, and answers at once.
	SlowRequests
	// Hold keeps every byte in both directions, and the end of a
	// connection, until the proxy leaves Hold, then delivers them in order:
	// a network that loses nothing and delivers late, or a peer whose
	// kernel is frozen with it (a suspended VM), so that what a server
	// sent before it gave up on the client reaches the client only after
	// the client runs again.
	Hold
	// HoldRequests delivers what Hold kept from the server, and goes on
	// keeping what the client sends, and every connection's end: the
	// client reads what reached it late before anything it writes can
	// fail on a server that is gone.
	HoldRequests
	// Armed passes everything until the client sends bytes containing the
	// proxy's trigger (Arm), and turns into SlowReplies from that chunk on:
	// a fault that must slow down one exchange (a read of the stream)
	// without slowing everything before it (a start-up of many round
	// trips), where watching the client's log from outside would always
	// be too late.
	Armed
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Cut:
		return "cut"
	case Latency:
		return "latency"
	case Blackhole:
		return "blackhole"
	case SlowReplies:
		return "slow-replies"
	case SlowRequests:
		return "slow-requests"
	case Armed:
		return "armed"
	case Hold:
		return "hold"
	case HoldRequests:
		return "hold-requests"
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// Proxy is a TCP proxy on 127.0.0.1 between the relay and one server, so
// that a chaos run can cut, partition or slow down that one path while the
// checker's own connections go straight to the server.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex
	mode    Mode
	delay   time.Duration
	trigger []byte     // Armed: what the client sends that turns on SlowReplies
	fired   time.Time  // when it did
	release *sync.Cond // broadcast when the mode leaves Hold
	conns   map[*proxyConn]struct{}
	closed  bool
	wg      sync.WaitGroup

	// delayed counts the chunks held back by Latency, SlowReplies and
	// SlowRequests: a latency fault that delayed none did not touch the
	// relay's traffic.
	delayed atomic.Uint64
}

type proxyConn struct {
	client, server net.Conn // server is nil for a connection accepted during a blackhole
	once           sync.Once
	broken         bool // saw a blackhole; guarded by Proxy.mu
}

func (c *proxyConn) close() {
	c.once.Do(func() {
		c.client.Close()
		if c.server != nil {
			c.server.Close()
		}
	})
}

// NewProxy listens on a free 127.0.0.1 port and forwards to target.
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("proxy to %s: listen: %w", target, err)
	}
	p := &Proxy{ln: ln, target: target, conns: map[*proxyConn]struct{}{}}
	p.release = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Port is the port clients connect to instead of the server's.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Set switches the mode; delay matters only for Latency, SlowReplies and
// SlowRequests. Chunks already queued keep the due time they were given:
// a heal does not overtake what was delayed before it.
func (p *Proxy) Set(mode Mode, delay time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	prev := p.mode
	p.mode, p.delay = mode, delay
	if prev == Hold || prev == HoldRequests {
		p.release.Broadcast()
	}
	switch {
	case mode == Cut:
		for c := range p.conns {
			c.close()
		}
	case mode == Blackhole:
		for c := range p.conns {
			c.broken = true
		}
	case prev == Blackhole:
		for c := range p.conns {
			if c.broken {
				c.close()
			}
		}
	}
}

// Arm sets mode Armed: from the first chunk the client sends that holds
// trigger on, the proxy is in SlowReplies with delay.
func (p *Proxy) Arm(trigger string, delay time.Duration) {
	p.mu.Lock()
	p.trigger, p.fired = []byte(trigger), time.Time{}
	p.mu.Unlock()
	p.Set(Armed, delay)
}

// Fired is when an armed proxy saw its trigger (zero: not since Arm).
func (p *Proxy) Fired() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fired
}

// Mode returns the current mode.
func (p *Proxy) Mode() Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode
}

// Conns is the number of open connections through the proxy.
func (p *Proxy) Conns() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns)
}

// Delayed is the number of chunks that Latency has held back so far.
func (p *Proxy) Delayed() uint64 { return p.delayed.Load() }

// Close stops listening and closes every connection.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.release.Broadcast()
	for c := range p.conns {
		c.close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		mode, closed := p.mode, p.closed
		p.mu.Unlock()
		if closed || mode == Cut {
			client.Close()
			continue
		}
		p.wg.Add(1)
		go p.serve(client, mode == Blackhole)
	}
}

func (p *Proxy) serve(client net.Conn, blackholed bool) {
	defer p.wg.Done()
	c := &proxyConn{client: client, broken: blackholed}
	if !blackholed {
		// Dial outside the lock: a slow server must not stall mode changes.
		server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			client.Close()
			return
		}
		c.server = server
	}
	p.mu.Lock()
	if p.closed || p.mode == Cut {
		p.mu.Unlock()
		c.close()
		return
	}
	// A blackhole that started while dialling applies to this one too.
	c.broken = c.broken || p.mode == Blackhole
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.close()
	}()
	if c.server == nil {
		p.pipe(c, client, nil, false)
		return
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); p.pipe(c, c.server, client, true) }()
	p.pipe(c, client, c.server, false)
	wg.Wait()
}

type chunk struct {
	b    []byte
	due  time.Time
	held bool // read during Hold: delivered once the proxy leaves it
}

// holds says whether mode keeps the bytes going to the client (toClient)
// or to the server.
func (m Mode) holds(toClient bool) bool {
	return m == Hold || m == HoldRequests && !toClient
}

// waitRelease waits until the proxy no longer keeps the bytes going to
// the client (toClient) or to the server; with both, until it keeps
// neither.
func (p *Proxy) waitRelease(toClient, both bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for !p.closed && (p.mode.holds(toClient) || both && p.mode.holds(!toClient)) {
		p.release.Wait()
	}
}

// delays says whether mode holds back a chunk going to the client
// (toClient) or to the server.
func (m Mode) delays(toClient bool) bool {
	switch m {
	case Latency:
		return true
	case SlowReplies:
		return toClient
	case SlowRequests:
		return !toClient
	}
	return false
}

// chunkQueue is a FIFO of timestamped chunks without a bound: the reader
// never waits for the writer, so a delay is a latency (each chunk leaves
// at its due time) and never a cap on throughput (a bounded queue full of
// chunks waiting out a 1.3 s delay would stall the reader: one queue's
// worth per delay).
type chunkQueue struct {
	mu     sync.Mutex
	cond   *sync.Cond
	q      []chunk
	closed bool
}

func newChunkQueue() *chunkQueue {
	q := &chunkQueue{}
	q.cond = sync.NewCond(&q.mu)
	return q
}

func (q *chunkQueue) push(c chunk) {
	q.mu.Lock()
	q.q = append(q.q, c)
	q.mu.Unlock()
	q.cond.Signal()
}

func (q *chunkQueue) close() {
	q.mu.Lock()
	q.closed = true
	q.mu.Unlock()
	q.cond.Signal()
}

// pop waits for the next chunk; false once the queue is closed and empty.
func (q *chunkQueue) pop() (chunk, bool) {
	q.mu.Lock()
	defer q.mu.Unlock()
	for len(q.q) == 0 && !q.closed {
		q.cond.Wait()
	}
	if len(q.q) == 0 {
		return chunk{}, false
	}
	c := q.q[0]
	q.q[0] = chunk{}
	q.q = q.q[1:]
	return c, true
}

// pipe copies src to dst through a queue of timestamped chunks, so that
// latency delays each chunk without limiting throughput to one chunk per
// delay, and in order. A nil dst (a connection accepted during a
// blackhole) discards. toClient says which way the bytes go.
func (p *Proxy) pipe(c *proxyConn, src, dst net.Conn, toClient bool) {
	q := newChunkQueue()
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			ch, ok := q.pop()
			if !ok {
				break
			}
			if ch.held {
				p.waitRelease(toClient, false)
			}
			if d := time.Until(ch.due); d > 0 {
				time.Sleep(d)
			}
			p.mu.Lock()
			broken := c.broken
			p.mu.Unlock()
			if broken || dst == nil || len(ch.b) == 0 {
				continue
			}
			if _, err := dst.Write(ch.b); err != nil {
				c.close()
			}
		}
		// The source ended: pass the end on to the other side, after what
		// was queued before it, and after every byte kept in the other
		// direction too.
		p.waitRelease(toClient, true)
		c.close()
	}()
	buf := make([]byte, 32<<10)
	// The end of the previous chunk, so that a trigger split between two
	// reads is still seen.
	var tail []byte
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			if p.mode == Armed && !toClient && len(p.trigger) > 0 {
				seen := append(tail, buf[:n]...)
				if bytes.Contains(seen, p.trigger) {
					p.mode, p.fired = SlowReplies, time.Now()
				}
				tail = append(tail[:0], seen[max(0, len(seen)-len(p.trigger)+1):]...)
			}
			broken, mode, delay := c.broken, p.mode, p.delay
			p.mu.Unlock()
			if !broken {
				due := time.Now()
				if mode.delays(toClient) {
					due = due.Add(delay)
					p.delayed.Add(1)
				}
				q.push(chunk{b: append([]byte(nil), buf[:n]...), due: due, held: mode.holds(toClient)})
			}
		}
		if err != nil {
			break
		}
	}
	// The end, too, waits for the release: a close passed on at once would
	// overtake the bytes held before it.
	if p.Mode().holds(toClient) {
		q.push(chunk{held: true})
	}
	q.close()
	<-done
}
