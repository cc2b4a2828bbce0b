package chaos

import (
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
	// Latency delays every chunk by the proxy's delay, in order.
	Latency
	// Blackhole keeps connections open but drops every byte, as a network
	// partition does: neither side learns of it until a timeout fires. On
	// heal the connections that saw the partition are closed, because a
	// TCP stream that lost bytes cannot be resumed.
	Blackhole
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
	}
	return fmt.Sprintf("mode(%d)", int(m))
}

// Proxy is a TCP proxy on 127.0.0.1 between the relay and one server, so
// that a chaos run can cut, partition or slow down that one path while the
// checker's own connections go straight to the server.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	mode   Mode
	delay  time.Duration
	conns  map[*proxyConn]struct{}
	closed bool
	wg     sync.WaitGroup

	// delayed counts the chunks held back by Latency: a latency fault
	// that delayed none did not touch the relay's traffic.
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
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Port is the port clients connect to instead of the server's.
func (p *Proxy) Port() int { return p.ln.Addr().(*net.TCPAddr).Port }

// Set switches the mode; delay matters only for Latency.
func (p *Proxy) Set(mode Mode, delay time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	prev := p.mode
	p.mode, p.delay = mode, delay
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
		p.pipe(c, client, nil)
		return
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); p.pipe(c, c.server, client) }()
	p.pipe(c, client, c.server)
	wg.Wait()
}

type chunk struct {
	b   []byte
	due time.Time
}

// pipe copies src to dst through a queue of timestamped chunks, so that
// latency delays each chunk without limiting throughput to one chunk per
// delay. A nil dst (a connection accepted during a blackhole) discards.
func (p *Proxy) pipe(c *proxyConn, src, dst net.Conn) {
	q := make(chan chunk, 256)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ch := range q {
			if d := time.Until(ch.due); d > 0 {
				time.Sleep(d)
			}
			p.mu.Lock()
			broken := c.broken
			p.mu.Unlock()
			if broken || dst == nil {
				continue
			}
			if _, err := dst.Write(ch.b); err != nil {
				c.close()
			}
		}
		// The source ended: pass the end on to the other side, after what
		// was queued before it.
		c.close()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			p.mu.Lock()
			broken, mode, delay := c.broken, p.mode, p.delay
			p.mu.Unlock()
			if !broken {
				due := time.Now()
				if mode == Latency {
					due = due.Add(delay)
					p.delayed.Add(1)
				}
				q <- chunk{b: append([]byte(nil), buf[:n]...), due: due}
			}
		}
		if err != nil {
			break
		}
	}
	close(q)
	<-done
}
