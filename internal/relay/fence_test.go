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
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
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
	t.Parallel() // a database, stream and slot of its own
	a, b, proxy := fencePair(t)

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

// fencePair is relay A and relay B on one table and slot with a 1 s
// duplicate window, B's database connections through a pause proxy with
// wal_sender_timeout 2 s on them: a pause times B's walsender out.
func fencePair(t *testing.T) (a, b *harness, proxy *pauseProxy) {
	t.Helper()
	s := sharedSetup(t)
	b = newHarness(t, s)
	a = newHarness(t, s)
	for _, h := range []*harness{a, b} {
		h.opts.DuplicateWindow = time.Second
		h.opts.StatusInterval = 200 * time.Millisecond
	}
	proxy = newPauseProxy(t, hostPort(t, s.dbURL))
	u, err := url.Parse(withHost(t, s.dbURL, proxy.addr()))
	if err != nil {
		t.Fatal(err)
	}
	u.RawQuery += "&options=-c%20wal_sender_timeout%3D2s"
	b.opts.DatabaseURL = u.String()
	b.opts.AppName, b.opts.WorkerID = "fence-b", "fence-b"
	a.opts.AppName, a.opts.WorkerID = "fence-a", "fence-a"
	return a, b, proxy
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

// gatedAcks is the relay's sink with every ack held until open is closed,
// as a paused process holds them.
type gatedAcks struct {
	*natssink.Sink
	open chan struct{}
}

func (s *gatedAcks) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	f, err := s.Sink.Publish(ctx, m)
	if err != nil {
		return nil, err
	}
	return gatedFuture{f, s.open}, nil
}

type gatedFuture struct {
	sinks.Future
	open chan struct{}
}

func (f gatedFuture) Wait(ctx context.Context) (sinks.Ack, error) {
	select {
	case <-f.open:
	case <-ctx.Done():
		return sinks.Ack{}, ctx.Err()
	}
	return f.Future.Wait(ctx)
}

// The fence at publish (issue 42, item 3). A relay paused (SIGSTOP, a
// frozen VM) past wal_sender_timeout while another took over published the
// rows it had already taken into its loop after it resumed, before the
// fence at the next handover stopped it: 32 rows stored twice. Here B's
// in-flight window is full of acks it cannot hear (held, as in a pause), a
// transaction waits behind them in its loop, and its database connection
// stalls until its walsender times out; A takes the slot over and publishes
// everything. Past the duplicate window B hears its acks and has room: it
// must end its session instead of publishing what it held.
func TestPausedSessionDoesNotPublishWhatItHeld(t *testing.T) {
	a, b, proxy := fencePair(t)
	parallel(t, a, b)
	b.opts.MaxInFlight = 4
	b.opts.AckTimeout = time.Minute
	b.opts.Lease = 2 * time.Minute
	open := make(chan struct{})
	b.opts.CDCSink = func(sk *natssink.Sink) sinks.Sink { return &gatedAcks{Sink: sk, open: open} }

	b.start()
	inflight := b.insertRows("inflight", 4, 4)
	held := b.insertRows("held", 20, 20)
	testenv.WaitFor(t, 30*time.Second, "B's in-flight window stored", func() (bool, error) {
		return b.streamCount() == 4, nil
	})
	proxy.pause()
	ctx := context.Background()
	testenv.WaitFor(t, 30*time.Second, "B's walsender to time out", func() (bool, error) {
		var active bool
		err := a.pool.QueryRow(ctx, `SELECT active FROM pg_replication_slots WHERE slot_name = $1`, b.opts.Slot).Scan(&active)
		return !active, err
	})
	a.start()
	testenv.WaitFor(t, 30*time.Second, "A to publish the held transaction", func() (bool, error) {
		byID, _ := a.streamMsgs()
		return byID["held-19"] != nil, nil
	})
	time.Sleep(3 * a.opts.DuplicateWindow)
	proxy.resume()
	close(open) // B hears its acks: room for what it held
	time.Sleep(proxyCloseDelay + 2*time.Second)
	a.assertExactlyOnce(append(inflight, held...))
	a.stop()
	b.stop()
}
