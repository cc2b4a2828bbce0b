package replication

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync/atomic"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
)

// drainConn is the replication connection's socket (TCP or Unix, without
// TLS) with one more way to read: while draining, a read takes what the
// socket holds and, when it holds nothing, fails at once as a timeout
// instead of parking the stream until a read deadline. At a trickle the
// stream reads a lingering batch's rest that way, and the read that would
// wait ends the batch: one wake-up and one timer fewer per batch than a
// short deadline gives.
//
// On TCP it can also be hushed while the stream lingers: the socket's
// receive low-water mark goes up, so the walsender's messages arriving
// meanwhile (a transaction is three or four of them, each sent at once)
// do not make the kernel signal the socket readable, which would wake the
// process's network poller once per message although nobody reads.
// Unhushed, before the next read, the mark is one byte again.
type drainConn struct {
	net.Conn
	raw      syscall.RawConn
	draining atomic.Bool
	tcp      bool
	hushed   bool // the stream's goroutine only
}

// hushLowat is the low-water mark while hushed; Linux caps it at half the
// socket's largest receive buffer. A lingering batch never holds this much:
// past it the socket signals as usual.
const hushLowat = 1 << 20

func (c *drainConn) hush() {
	if c == nil || !c.tcp || c.hushed {
		return
	}
	c.hushed = c.setLowat(hushLowat) == nil
}

func (c *drainConn) unhush() {
	if c == nil || !c.hushed {
		return
	}
	if err := c.setLowat(1); err != nil {
		// A mark left high would keep a waiting read from waking: give
		// the connection up instead (the stream then fails and restarts).
		_ = c.Conn.Close()
	}
	c.hushed = false
}

func (c *drainConn) setLowat(n int) error {
	var serr error
	if err := c.raw.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVLOWAT, n)
	}); err != nil {
		return err
	}
	return serr
}

// wrapDrainable is the replication connection's AfterNetConnect: a socket
// that can be read without waiting becomes a drainConn; any other (TLS)
// stays as it is, and the stream drains it with a short deadline.
func wrapDrainable(_ context.Context, _ *pgconn.Config, conn net.Conn) (net.Conn, error) {
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return conn, nil
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		return conn, nil
	}
	_, tcp := conn.(*net.TCPConn)
	return &drainConn{Conn: conn, raw: raw, tcp: tcp}, nil
}

// errWouldWait is what a draining read returns when the socket is empty:
// the timeout a read deadline gives, so pgconn keeps the connection and
// the stream ends the batch as it does at a deadline.
var errWouldWait = os.ErrDeadlineExceeded

func (c *drainConn) Read(p []byte) (int, error) {
	if !c.draining.Load() {
		return c.Conn.Read(p)
	}
	var n int
	var rerr error
	// The deadline still applies (RawConn.Read checks it first): a read
	// started before draining began keeps its own.
	err := c.raw.Read(func(fd uintptr) bool {
		for {
			n, rerr = syscall.Read(int(fd), p)
			if !errors.Is(rerr, syscall.EINTR) {
				return true
			}
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errors.Is(rerr, syscall.EAGAIN):
		return 0, errWouldWait
	case rerr != nil:
		return 0, &net.OpError{Op: "read", Net: c.LocalAddr().Network(), Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: os.NewSyscallError("read", rerr)}
	case n == 0 && len(p) > 0:
		return 0, io.EOF
	}
	return n, nil
}
