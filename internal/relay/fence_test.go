package relay_test

import (
	"context"
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// G18 across instances: the session the server dropped must not publish
// the WAL it reads afterwards. Relay B streams through a proxy that stops
// forwarding (a partition that loses nothing: TCP delivers what was sent
// once it heals, as it does after a partition shorter than its retries, or
// a process paused and resumed). B's walsender sends a transaction into
// the partition and times out (wal_sender_timeout 2 s on B's connection);
// relay A takes the slot over and publishes the transaction; once the
// duplicate window (1 s) has passed the partition heals and B reads the
// WAL that was waiting for it. B must end its session instead of
// publishing that WAL: stored once. Without the fence B publishes it and
// the stream holds it twice.
func TestSessionDroppedByTheServerDoesNotPublishWhatItReadsLate(t *testing.T) {
	s := sharedSetup(t)
	b := newHarness(t, s)
	a := newHarness(t, s)
	for _, h := range []*harness{a, b} {
		h.opts.DuplicateWindow = time.Second
		h.opts.StatusInterval = 200 * time.Millisecond
	}
	proxy := newPauseProxy(t, hostPort(t, s.dbURL))
	u, err := url.Parse(withHost(t, s.dbURL, proxy.addr()))
	if err != nil {
		t.Fatal(err)
	}
	u.RawQuery += "&options=-c%20wal_sender_timeout%3D2s"
	b.opts.DatabaseURL = u.String()
	b.opts.AppName, b.opts.WorkerID = "fence-b", "fence-b"
	a.opts.AppName, a.opts.WorkerID = "fence-a", "fence-a"

	b.start()
	warm := b.insertRows("warm", 3, 1)
	b.waitPublished(3, 30*time.Second)

	proxy.pause()
	late := b.insertRows("late", 5, 5)
	ctx := context.Background()
	testenv.WaitFor(t, 30*time.Second, "B's walsender to time out", func() (bool, error) {
		var active bool
		err := b.pool.QueryRow(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, b.opts.Slot).Scan(&active)
		return !active, err
	})
	a.start()
	testenv.WaitFor(t, 30*time.Second, "A to publish the late transaction", func() (bool, error) {
		byID, _ := a.streamMsgs()
		return byID["late-4"] != nil, nil
	})
	time.Sleep(3 * a.opts.DuplicateWindow)
	proxy.resume()
	// B reads the late WAL, and its connection closes only later.
	time.Sleep(proxyCloseDelay + time.Second)
	a.assertExactlyOnce(append(warm, late...))
	a.stop()
	b.stop()
}

// proxyCloseDelay is how long a pauseProxy holds a close from one side
// back after it resumed: the other side reads what was sent before the
// close well before it learns of it.
const proxyCloseDelay = 3 * time.Second

// pauseProxy forwards TCP to one server; while paused it forwards nothing
// and loses nothing.
type pauseProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu     sync.Mutex
	cond   *sync.Cond
	paused bool
	held   bool // paused at least once: a close is held back
	closed bool
	conns  map[net.Conn]struct{}
}

func newPauseProxy(t *testing.T, target string) *pauseProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pauseProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(p.close)
	return p
}

func (p *pauseProxy) addr() string { return p.ln.Addr().String() }

func (p *pauseProxy) pause() { p.mu.Lock(); p.paused, p.held = true, true; p.mu.Unlock() }

func (p *pauseProxy) resume() { p.mu.Lock(); p.paused = false; p.cond.Broadcast(); p.mu.Unlock() }

// wait blocks while paused; false once the proxy is closed.
func (p *pauseProxy) wait() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for p.paused && !p.closed {
		p.cond.Wait()
	}
	return !p.closed
}

func (p *pauseProxy) accept() {
	defer p.wg.Done()
	acceptPairs(p.ln, p.target, func(c, s net.Conn) bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.closed {
			return false
		}
		p.conns[c], p.conns[s] = struct{}{}, struct{}{}
		p.wg.Add(2)
		go p.pipe(c, s)
		go p.pipe(s, c)
		return true
	})
}

func (p *pauseProxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.wait() {
				return
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			if err != io.EOF {
				dst.Close()
				return
			}
			// Once paused, a close reaches the other side only a while
			// after the bytes before it.
			if !p.wait() {
				return
			}
			if func() bool { p.mu.Lock(); defer p.mu.Unlock(); return p.held }() {
				time.Sleep(proxyCloseDelay)
			}
			dst.Close()
			return
		}
	}
}

func (p *pauseProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.cond.Broadcast()
	p.ln.Close()
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.wg.Wait()
}
