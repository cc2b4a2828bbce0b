package replication

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"time"
)

// tcpPair is a loopback TCP connection: the peer's end, and the other
// end as the replication connection wraps it; both closed at the test's
// end.
func tcpPair(t *testing.T) (net.Conn, *drainConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	peer := <-accepted
	t.Cleanup(func() { peer.Close() })
	wrapped, err := wrapDrainable(context.Background(), nil, raw)
	if err != nil {
		t.Fatal(err)
	}
	c, ok := wrapped.(*drainConn)
	if !ok {
		t.Fatalf("a TCP socket became %T, want a drainConn", wrapped)
	}
	t.Cleanup(func() { c.Close() })
	return peer, c
}

// A draining read takes what the socket holds and, on an empty socket,
// fails at once with the timeout a read deadline gives (which pgconn
// survives); a read that is not draining waits as before.
func TestDrainConnReadsWithoutWaiting(t *testing.T) {
	peer, c := tcpPair(t)
	buf := make([]byte, 64)

	c.draining.Store(true)
	// A deadline well ahead: a draining read must not wait for it.
	if err := c.SetReadDeadline(time.Now().Add(2 * time.Second)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	n, err := c.Read(buf)
	var ne net.Error
	if n != 0 || !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("empty socket: %d, %v; want 0 and a timeout", n, err)
	}
	if d := time.Since(start); d > 100*time.Millisecond {
		t.Fatalf("the empty socket's read took %v, want at once", d)
	}
	if _, err := peer.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		n, err = c.Read(buf)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond) // the bytes are on their way through loopback
	}
	if err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("draining read: %q, %v; want hello", buf[:n], err)
	}
	// A deadline that passed fails the draining read as it fails any.
	if err := c.SetReadDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, err := peer.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if _, err := c.Read(buf); !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("past the deadline: %v, want a timeout", err)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}

	// Not draining: the read waits for the bytes.
	c.draining.Store(false)
	go func() {
		time.Sleep(100 * time.Millisecond)
		_, _ = peer.Write([]byte("later"))
	}()
	got := ""
	for len(got) < len("xlater") {
		n, err := c.Read(buf)
		if err != nil {
			t.Fatalf("blocking read: %v", err)
		}
		got += string(buf[:n])
	}
	if got != "xlater" {
		t.Fatalf("blocking read: %q, want xlater", got)
	}

	// The peer gone: a draining read says so.
	peer.Close()
	c.draining.Store(true)
	deadline = time.Now().Add(5 * time.Second)
	for {
		_, err = c.Read(buf)
		if !errors.As(err, &ne) || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if !errors.Is(err, io.EOF) {
		t.Fatalf("after the peer closed: %v, want EOF", err)
	}
}

// Hushed, bytes arriving on a TCP socket are not signalled: a read already
// waiting when they come runs into its deadline (what would otherwise wake
// the process, and why the stream unhushes before it reads); a read
// started later takes them, and unhushed, arrivals wake the reader again.
func TestDrainConnHushKeepsArrivalsQuiet(t *testing.T) {
	peer, c := tcpPair(t)
	buf := make([]byte, 64)
	// readWhileArriving starts a read, lets the peer write while it
	// waits, and returns what the read got.
	readWhileArriving := func(data string, wait time.Duration) (string, error) {
		t.Helper()
		if err := c.SetReadDeadline(time.Now().Add(wait)); err != nil {
			t.Fatal(err)
		}
		go func() {
			time.Sleep(100 * time.Millisecond) // the read is waiting by then
			_, _ = peer.Write([]byte(data))
		}()
		n, err := c.Read(buf)
		return string(buf[:n]), err
	}

	c.hush()
	if !c.hushed {
		t.Fatal("a TCP socket could not be hushed")
	}
	got, err := readWhileArriving("quiet", 600*time.Millisecond)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("hushed: the waiting read got %q, %v; want a timeout, the arrival unsignalled", got, err)
	}
	if err := c.SetReadDeadline(time.Now().Add(5 * time.Second)); err != nil {
		t.Fatal(err)
	}
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "quiet" {
		t.Fatalf("hushed, a new read: %q, %v; want the bytes that came", buf[:n], err)
	}
	c.unhush()
	start := time.Now()
	if got, err := readWhileArriving("loud", 5*time.Second); err != nil || got != "loud" {
		t.Fatalf("unhushed: %q, %v; want loud", got, err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("unhushed, the waiting read woke after %v", d)
	}
}
