package testenv

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// DelayProxy is a TCP proxy on 127.0.0.1 in front of one server that can
// hold back what the server sends, as a slow network path does: a client's
// requests reach the server at once and the answers arrive late, so a test
// can drive the client's timeouts against a real server without stopping it.
// Bytes are never reordered or lost, only delayed.
type DelayProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	delay   atomic.Int64  // a time.Duration
	delayed atomic.Uint64 // chunks read while delay > 0

	mu     sync.Mutex
	conns  map[*delayConn]struct{}
	cuts   uint64 // CutAll calls, so that a connection dialled across one is cut too
	closed bool
}

type delayConn struct {
	client, server net.Conn
	done           chan struct{} // closed by close: a cut drops what is still queued
	once           sync.Once
}

func (c *delayConn) close() {
	c.once.Do(func() {
		close(c.done)
		c.client.Close()
		c.server.Close()
	})
}

type delayChunk struct {
	b   []byte
	due time.Time
}

// delayQueue bounds what a connection holds back: a full queue stops the
// proxy reading from the server, which TCP passes on as backpressure.
const delayQueue = 1024

// NewDelayProxy listens on a free 127.0.0.1 port and forwards every
// connection to target (host:port), without delay until SetDelay. It is
// closed, with every connection through it, when t ends.
func NewDelayProxy(t testing.TB, target string) *DelayProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: delay proxy to %s: listen: %v", target, err)
	}
	p := &DelayProxy{ln: ln, target: target, conns: map[*delayConn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

// Addr is the host:port clients dial instead of the target's.
func (p *DelayProxy) Addr() string { return p.ln.Addr().String() }

// SetDelay makes every chunk read from the server from now on reach the
// client d after it was read. Chunks queue behind each other, each on its
// own due time, so d is added latency, not a cap on throughput. Zero
// returns to pass-through; chunks already queued keep their due time,
// and what follows them waits for them.
func (p *DelayProxy) SetDelay(d time.Duration) { p.delay.Store(int64(d)) }

// Delayed is the number of chunks read while a delay was set: a fault that
// delayed none did not touch the traffic under test.
func (p *DelayProxy) Delayed() uint64 { return p.delayed.Load() }

// CutAll closes every current connection, both sides, dropping what is
// still queued, as a peer that went away does. New connections are
// accepted as before.
func (p *DelayProxy) CutAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cuts++
	for c := range p.conns {
		c.close()
	}
}

// Close stops listening, closes every connection and waits for the
// proxy's goroutines. It is safe to call more than once.
func (p *DelayProxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	for c := range p.conns {
		c.close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}

func (p *DelayProxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors and the like: the client retries.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			client.Close()
			continue
		}
		cuts := p.cuts
		p.wg.Add(1)
		p.mu.Unlock()
		go p.serve(client, cuts)
	}
}

func (p *DelayProxy) serve(client net.Conn, cuts uint64) {
	defer p.wg.Done()
	// Dialled outside the lock: a slow target must not stall CutAll or Close.
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		client.Close()
		return
	}
	c := &delayConn{client: client, server: server, done: make(chan struct{})}
	p.mu.Lock()
	if p.closed || p.cuts != cuts {
		p.mu.Unlock()
		c.close()
		return
	}
	p.conns[c] = struct{}{}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		delete(p.conns, c)
		p.mu.Unlock()
		c.close()
	}()
	up := make(chan struct{})
	go func() {
		defer close(up)
		if _, err := io.Copy(server, client); err != nil {
			c.close()
			return
		}
		// The client's end of stream, passed on as a half-close: the
		// server may still answer what came before it.
		closeWrite(c, server)
	}()
	p.down(c)
	<-up
}

// down copies server to client through a queue of timestamped chunks, so
// that the writer sleeps until each chunk's due time rather than for the
// delay after each chunk.
func (p *DelayProxy) down(c *delayConn) {
	q := make(chan delayChunk, delayQueue)
	var eof bool // written before close(q), read after it
	written := make(chan struct{})
	go func() {
		defer close(written)
		timer := time.NewTimer(time.Hour)
		defer timer.Stop()
		for ch := range q {
			if wait := time.Until(ch.due); wait > 0 {
				timer.Reset(wait)
				select {
				case <-timer.C:
				case <-c.done:
					return
				}
			}
			if _, err := c.client.Write(ch.b); err != nil {
				c.close()
				return
			}
		}
		// The server's end reaches the client after the bytes before it.
		if eof {
			closeWrite(c, c.client)
		} else {
			c.close()
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := c.server.Read(buf)
		if n > 0 {
			ch := delayChunk{b: bytes.Clone(buf[:n]), due: time.Now()}
			if d := time.Duration(p.delay.Load()); d > 0 {
				ch.due = ch.due.Add(d)
				p.delayed.Add(1)
			}
			select {
			case q <- ch:
			case <-c.done:
			}
		}
		if err != nil {
			eof = errors.Is(err, io.EOF)
			break
		}
	}
	close(q)
	<-written
}

// closeWrite half-closes conn, or closes the whole connection when conn
// cannot be half-closed.
func closeWrite(c *delayConn, conn net.Conn) {
	hc, ok := conn.(interface{ CloseWrite() error })
	if !ok || hc.CloseWrite() != nil {
		c.close()
	}
}
