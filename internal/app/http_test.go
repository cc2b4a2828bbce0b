package app_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// serverConns counts the descriptors this process holds for connections
// accepted on port: sockets with that local port that have a file (a
// connection still waiting in the kernel's accept queue has none) and are
// not the listener.
func serverConns(port int) (int, error) {
	inodes := map[string]bool{}
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			if os.IsNotExist(err) {
				continue
			}
			return 0, err
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fs := strings.Fields(line)
			if len(fs) < 10 || fs[3] == "0A" || fs[9] == "0" {
				continue
			}
			_, hexPort, ok := strings.Cut(fs[1], ":")
			if p, err := strconv.ParseUint(hexPort, 16, 16); ok && err == nil && int(p) == port {
				inodes["socket:["+fs[9]+"]"] = true
			}
		}
	}
	fds, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, fd := range fds {
		if target, err := os.Readlink(filepath.Join("/proc/self/fd", fd.Name())); err == nil && inodes[target] {
			n++
		}
	}
	return n, nil
}

// A flood of connections far beyond the cap (keep-alives left idle after
// one request, connections that never send anything, and slowloris ones
// that trickle a header byte by byte) never makes the server hold more than
// the cap; every one of them is closed by the server after the idle or
// read-header timeout and the keep-alive ones all got their answer, /readyz
// answers during and after the flood, and the CDC path keeps publishing.
func TestHTTPConnectionFlood(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("counts the server's sockets through /proc")
	}
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	ctx := context.Background()
	tbl := testenv.OutboxTable
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	const (
		maxConns = 8
		timeout  = 700 * time.Millisecond
		perKind  = 2 * maxConns // of each of the three kinds: 6x the cap
	)
	addr := make(chan string, 1)
	o := app.Options{
		DatabaseURL: dbURL, NATSURL: env.NATS.URL(), Table: tbl, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: store.PolicyMark, DuplicateWindow: 2 * time.Minute,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20,
		HTTPAddr: "127.0.0.1:0",
		HTTP:     app.HTTPLimits{MaxConns: maxConns, IdleTimeout: timeout, ReadHeaderTimeout: timeout},
		Lease:    5 * time.Second, PollInterval: 50 * time.Millisecond,
		Listening: func(a string) { addr <- a },
	}
	logs := &testenv.LogBuffer{}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx, o, zerolog.New(logs)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
	}()
	var hostPort string
	select {
	case hostPort = <-addr:
	case err := <-done:
		done <- err
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	_, portStr, _ := net.SplitHostPort(hostPort)
	port, _ := strconv.Atoi(portStr)
	// Probes without keep-alive, so they hold no connection of their own.
	probe := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	readyz := func() (int, string, error) {
		resp, err := probe.Get("http://" + hostPort + "/readyz")
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, strings.TrimSpace(string(b)), err
	}
	testenv.WaitFor(t, 30*time.Second, "/readyz 200 active", func() (bool, error) {
		code, body, err := readyz()
		return code == 200 && body == "active", fmt.Errorf("%d %q %v", code, body, err)
	})

	// Sample the connections the server holds for as long as the flood
	// lasts.
	if _, err := serverConns(port); err != nil {
		t.Fatalf("count the server's connections: %v", err)
	}
	var maxHeld atomic.Int64
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		for {
			if n, err := serverConns(port); err == nil && int64(n) > maxHeld.Load() {
				maxHeld.Store(int64(n))
			}
			select {
			case <-stopSampling:
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
	}()

	type outcome struct {
		kind     string
		answered bool // a keep-alive connection got its 200
		closed   bool // the server closed it (EOF or reset), within the wait
		err      error
	}
	var wg sync.WaitGroup
	results := make(chan outcome, 3*perKind)
	for i := range 3 * perKind {
		kind := [...]string{"keep-alive", "silent", "slowloris"}[i%3]
		c, err := net.Dial("tcp", hostPort)
		if err != nil {
			t.Fatalf("dial %d: %v", i, err)
		}
		defer c.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			out := outcome{kind: kind}
			// Long enough for every connection to wait its turn under the
			// cap and then its timeout, on a loaded machine; a server
			// without timeouts never closes them.
			_ = c.SetDeadline(time.Now().Add(60 * time.Second))
			switch kind {
			case "keep-alive":
				if _, out.err = io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n"); out.err != nil {
					break
				}
				br := bufio.NewReader(c)
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					out.err = fmt.Errorf("read response: %w", err)
					break
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				out.answered = resp.StatusCode == 200 && !resp.Close
				_, err = br.ReadByte()
				out.closed, out.err = isClosed(err)
			case "silent":
				_, err := c.Read(make([]byte, 1))
				out.closed, out.err = isClosed(err)
			case "slowloris":
				// Never finishes the headers, but keeps sending: only
				// a deadline on the whole header ends it.
				header := "GET /healthz HTTP/1.1\r\nHost: relay\r\nX-Slow: " + strings.Repeat("a", 1000)
				giveUp := time.Now().Add(60 * time.Second)
				for j := 0; ; j++ {
					if _, err := io.WriteString(c, header[j%len(header):j%len(header)+1]); err != nil {
						out.closed = true
						break
					}
					_ = c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
					_, err := c.Read(make([]byte, 1))
					if ne, ok := err.(net.Error); ok && ne.Timeout() {
						if time.Now().After(giveUp) {
							out.err = err
							break
						}
						continue
					}
					// The server answers 408 or just closes: either way,
					// it let go.
					out.closed = true
					break
				}
			}
			results <- out
		}()
	}

	// /readyz gets through while the flood is on.
	code, body, err := readyz()
	if code != 200 || body != "active" {
		t.Errorf("/readyz during the flood: %d %q %v", code, body, err)
	}
	wg.Wait()
	close(stopSampling)
	<-sampled
	close(results)
	counts := map[string]int{}
	for r := range results {
		if r.err != nil || !r.closed || (r.kind == "keep-alive" && !r.answered) {
			t.Errorf("%s connection: closed by the server %v, answered %v, err %v", r.kind, r.closed, r.answered, r.err)
			continue
		}
		counts[r.kind]++
	}
	t.Logf("closed by the server: %v; most connections held at once: %d (cap %d)", counts, maxHeld.Load(), maxConns)
	if got := maxHeld.Load(); got > maxConns {
		t.Errorf("the server held %d connections at once, over the cap of %d", got, maxConns)
	} else if got < maxConns/2 {
		// The count cannot see the flood: the check above would prove
		// nothing.
		t.Errorf("the server held at most %d connections during a flood of %d: the count is broken", got, 3*perKind)
	}
	testenv.WaitFor(t, 10*time.Second, "no connection held after the flood", func() (bool, error) {
		n, err := serverConns(port)
		return err == nil && n == 0, fmt.Errorf("%d held (%v)", n, err)
	})
	if code, body, err := readyz(); code != 200 || body != "active" {
		t.Errorf("/readyz after the flood: %d %q %v", code, body, err)
	}

	// The CDC path was never in the way of any of this.
	for i := range 20 {
		if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'load', '{}')`, fmt.Sprintf("f-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 30*time.Second, "20 rows published", func() (bool, error) {
		var n int
		err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published'`).Scan(&n)
		return err == nil && n == 20, fmt.Errorf("%d published, %v", n, err)
	})
}

// isClosed tells an error from reading a connection the server closed
// (EOF, reset) from a timeout on our side.
func isClosed(err error) (bool, error) {
	if err == nil {
		return false, fmt.Errorf("the server sent more than expected")
	}
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		return false, err
	}
	return true, nil
}
