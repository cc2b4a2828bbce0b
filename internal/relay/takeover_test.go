package relay_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// takeoverBound is how long the docs promise a waiting instance takes to
// stream the slot after the active instance's connection ends
// (deploy.md: "a standby takes over within a second or two";
// guarantees-chaos.md, Takeover times: the walsender exits when its socket
// closes and the waiting instance takes
// the slot at its next START_REPLICATION retry, which comes every
// relay.Config.WaitingRetry, 1 s by default). One retry interval plus a
// second for the new session's start-up checks.
const takeoverBound = 2 * time.Second

// TestWaitingInstanceTakesOverFromCrashedRelay: two relays on one slot while a
// producer commits rows all along. A streams; B waits (role standby) and publishes
// nothing; A dies without a clean stop (every connection it had closed at
// once and none allowed again: what its host's kernel does when the
// process is gone); B streams within the documented bound, and every
// committed row ends published and stored exactly once.
func TestWaitingInstanceTakesOverFromCrashedRelay(t *testing.T) {
	s := sharedSetup(t)
	a := newHarness(t, s)
	pgProxy := newCrashProxy(t, hostPort(t, s.dbURL))
	natsProxy := newCrashProxy(t, hostPort(t, s.natsURL))
	a.opts.DatabaseURL = withHost(t, s.dbURL, pgProxy.addr())
	a.opts.NATSURL = "nats://" + natsProxy.addr()
	a.opts.AppName, a.opts.WorkerID = "takeover-a", "takeover-a"
	runTakeover(t, s, takeoverActive{
		app:   "takeover-a",
		start: a.start,
		crash: func() {
			pgProxy.crash()
			natsProxy.crash()
		},
	})
}

// TestWaitingInstanceTakesOverFromKilledRelay is the same with A a relay process
// killed with SIGKILL.
func TestWaitingInstanceTakesOverFromKilledRelay(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	bin, err := testenv.RelayBinary(false)
	if err != nil {
		t.Fatalf("build outbox-relay: %v", err)
	}
	s := sharedSetup(t)
	var cmd *exec.Cmd
	logPath := filepath.Join(t.TempDir(), "relay-a.log")
	exited := make(chan struct{})
	t.Cleanup(func() {
		if cmd != nil {
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("relay A log:\n%s", b)
		}
	})
	runTakeover(t, s, takeoverActive{
		app: "takeover-proc-a",
		start: func() {
			f, err := os.Create(logPath)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			cmd = exec.Command(bin, "run", "--database-url", s.dbURL, "--nats-url", s.natsURL,
				"--stream", s.stream, "--subject-prefix", s.subjectPrefix, "--slot", slotFor(t),
				"--application-name", "takeover-proc-a", "--worker-id", "takeover-proc-a",
				"--status-interval", "200ms", "--ack-timeout", "2s")
			cmd.Env = testenv.RelayEnv()
			cmd.Stdout, cmd.Stderr = f, f
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			go func() { _ = cmd.Wait(); close(exited) }()
		},
		crash: func() {
			if err := cmd.Process.Kill(); err != nil {
				t.Fatalf("kill -9 relay A: %v", err)
			}
		},
	})
	<-exited
	if st := cmd.ProcessState; st == nil || st.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("relay A ended with %v, want death by SIGKILL", cmd.ProcessState)
	}
	cmd = nil
}

// takeoverActive is the instance that streams first: how to start it, the
// application_name its walsender shows, and how to make it die.
type takeoverActive struct {
	app   string
	start func()
	crash func()
}

func runTakeover(t *testing.T, s setup, act takeoverActive) {
	b := newHarness(t, s)
	b.opts.AppName, b.opts.WorkerID = "takeover-b", "takeover-b"
	b.opts.HTTPAddr = "127.0.0.1:0"
	metricsAddr := make(chan string, 1)
	b.opts.Listening = func(addr string) { metricsAddr <- addr }

	act.start()
	testenv.WaitFor(t, 60*time.Second, "relay A streaming the slot", func() (bool, error) {
		app, err := b.slotHolder()
		return app == act.app, err
	})
	p := startProducer(t, s.dbURL, "to", 1<<30)
	defer func() {
		select {
		case <-p.stop:
		default:
			p.finish()
		}
	}()
	testenv.WaitFor(t, 30*time.Second, "relay A publishing the load", func() (bool, error) {
		return b.countState("published") > 100, nil
	})

	done := b.launch()
	testenv.WaitFor(t, 30*time.Second, "relay B waiting (role standby)", func() (bool, error) {
		select {
		case err := <-done:
			done <- err
			return false, fmt.Errorf("relay B exited: %v", err)
		default:
		}
		b.mu.Lock()
		defer b.mu.Unlock()
		return b.relay != nil && b.relay.Role() == relay.RoleWaiting, nil
	})
	addr := <-metricsAddr
	// B waits while A goes on publishing: several of B's retries pass
	// and A settles hundreds more rows.
	published := b.countState("published")
	testenv.WaitFor(t, 30*time.Second, "relay A publishing while B waits", func() (bool, error) {
		return b.countState("published") > published+300, nil
	})
	if app, err := b.slotHolder(); err != nil || app != act.app {
		t.Fatalf("the slot is held by %q (%v) while B waits, want %q", app, err, act.app)
	}
	if r := b.role(); r != relay.RoleWaiting {
		t.Fatalf("relay B is %v while A streams, want standby (waiting)", r)
	}
	m := scrapeMetrics(t, addr)
	// From the slot, that is: its poller runs while it waits, and takes
	// its share of the rows handed over (those committed while A's slot
	// was being created, which its backfill hands to the poller, come
	// under load).
	if n := m.sumWith("outbox_relay_messages_published_total", `path="cdc"`); n != 0 {
		t.Fatalf("relay B published %v messages from the slot while waiting, want 0", n)
	}
	if n := m.get(`outbox_relay_replication_sessions_total{result="started"}`); n != 0 {
		t.Fatalf("relay B started %v replication sessions while waiting, want 0", n)
	}
	if n := m.get(`outbox_relay_role{role="standby"}`); n != 1 {
		t.Fatalf("relay B's outbox_relay_role{role=\"standby\"} is %v, want 1", n)
	}

	before := b.countState("published")
	t0 := time.Now()
	act.crash()
	var took time.Duration
	for {
		if b.role() == relay.RoleActive {
			took = time.Since(t0)
			break
		}
		if time.Since(t0) > 60*time.Second {
			t.Fatalf("relay B did not take over within 60s of relay A's death (role %v)", b.role())
		}
		time.Sleep(5 * time.Millisecond)
	}
	if app, err := b.slotHolder(); err != nil || app != "takeover-b" {
		t.Fatalf("relay B reports active, the slot is held by %q (%v)", app, err)
	}
	t.Logf("relay B took over %v after relay A died (bound %v)", took.Round(time.Millisecond), takeoverBound)
	if took > takeoverBound {
		t.Errorf("takeover took %v, more than the documented %v", took, takeoverBound)
	}

	// B goes on with the load, then the producer stops and B drains.
	testenv.WaitFor(t, 30*time.Second, "relay B publishing the load", func() (bool, error) {
		return b.countState("published") > before+300, nil
	})
	acked := p.finish()
	ids := b.committedIDs()
	inTable := make(map[string]bool, len(ids))
	for _, id := range ids {
		inTable[id] = true
	}
	for _, id := range acked {
		if !inTable[id] {
			t.Fatalf("row %s was committed and is not in the table", id)
		}
	}
	b.waitPublished(len(ids), 60*time.Second)
	b.assertExactlyOnce(ids)
	m = scrapeMetrics(t, addr)
	t.Logf("%d rows committed (%d not yet published when A died); relay B stored %v new messages, and %v repeats of A's unconfirmed tail were dropped by Nats-Msg-Id",
		len(ids), len(ids)-before, m.get(`outbox_relay_messages_published_total{path="cdc",result="ok"}`), m.get("outbox_relay_duplicate_acks_total"))
}

func (h *harness) role() relay.Role {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.relay == nil {
		return relay.RoleStarting
	}
	return h.relay.Role()
}

// slotHolder is the application_name of the walsender streaming the slot,
// "" when none does.
func (h *harness) slotHolder() (string, error) {
	var app *string
	err := h.pool.QueryRow(context.Background(), `SELECT a.application_name
		FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid
		WHERE s.slot_name = $1`, h.opts.Slot).Scan(&app)
	if err != nil || app == nil {
		return "", err
	}
	return *app, nil
}

type promText map[string]float64

func (m promText) get(name string) float64 { return m[name] }

// sum adds every series of a metric.
func (m promText) sum(name string) float64 {
	var v float64
	for k, x := range m {
		if k == name || strings.HasPrefix(k, name+"{") {
			v += x
		}
	}
	return v
}

// sumWith adds the series of name whose labels include label.
func (m promText) sumWith(name, label string) float64 {
	var v float64
	for k, x := range m {
		if strings.HasPrefix(k, name+"{") && strings.Contains(k, label) {
			v += x
		}
	}
	return v
}

func scrapeMetrics(t *testing.T, addr string) promText {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape relay B's metrics: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape relay B's metrics: %s", resp.Status)
	}
	m := promText{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("metrics line %q: %v", line, err)
		}
		m[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return m
}

func hostPort(t *testing.T, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	return u.Host
}

func withHost(t *testing.T, rawURL, host string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = host
	return u.String()
}

// crashProxy forwards TCP to one server until crash, which closes every
// connection at once and refuses new ones: to both servers the relay
// behind it is gone as a killed process is, while the test keeps its own
// direct connections.
type crashProxy struct {
	ln     net.Listener
	target string
	wg     sync.WaitGroup

	mu      sync.Mutex
	conns   map[net.Conn]struct{}
	crashed bool
}

func newCrashProxy(t *testing.T, target string) *crashProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &crashProxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() { p.crash(); p.wg.Wait() })
	return p
}

func (p *crashProxy) addr() string { return p.ln.Addr().String() }

func (p *crashProxy) accept() {
	defer p.wg.Done()
	acceptPairs(p.ln, p.target, func(c, s net.Conn) bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.crashed {
			return false
		}
		p.conns[c], p.conns[s] = struct{}{}, struct{}{}
		p.wg.Add(2)
		pipe := func(dst, src net.Conn) {
			defer p.wg.Done()
			_, _ = io.Copy(dst, src)
			dst.Close()
			src.Close()
		}
		go pipe(s, c)
		go pipe(c, s)
		return true
	})
}

// acceptPairs accepts connections on ln until it is closed, dials target
// for each, and hands the pair to serve; a pair serve refuses is closed.
func acceptPairs(ln net.Listener, target string, serve func(client, server net.Conn) bool) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", target)
		if err != nil {
			c.Close()
			continue
		}
		if !serve(c, s) {
			c.Close()
			s.Close()
		}
	}
}

func (p *crashProxy) crash() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.crashed {
		return
	}
	p.crashed = true
	p.ln.Close()
	for c := range p.conns {
		// RST, not FIN: nothing in flight is delivered after the crash.
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0)
		}
		c.Close()
	}
}
