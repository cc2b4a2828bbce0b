package e2e

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// relayBinary builds cmd/outbox-relay once per test binary, with -race when
// the tests run with it.
func relayBinary() (string, error) { return testenv.RelayBinary(raceEnabled) }

func mustRelayBinary(t testing.TB) string {
	t.Helper()
	bin, err := relayBinary()
	if err != nil {
		t.Fatalf("build outbox-relay: %v", err)
	}
	return bin
}

// relayEnv is the test process's environment without OUTBOX_RELAY_* variables,
// so a developer's settings cannot leak into the relay under test, plus extra.
func relayEnv(extra ...string) []string { return testenv.RelayEnv(extra...) }

var nameSeq atomic.Int64

// uniqueName returns a replication slot name no other test of this binary
// uses: slots are cluster-wide, and the tests share one PostgreSQL.
func uniqueName(prefix string) string {
	return fmt.Sprintf("%s_%d_%d", prefix, os.Getpid(), nameSeq.Add(1))
}

// relayProc is one started `outbox-relay run` process.
type relayProc struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // valid once done is closed
}

func (p *relayProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// relay starts, kills and restarts `outbox-relay run` with fixed arguments,
// every start appending to one log file. When the test ends it kills a
// process still running, prints the log's tail if the test failed, and fails
// the test if the log shows a data race or a panic. OUTBOX_RELAY_E2E_LOG=1
// prints the whole log of every test.
type relay struct {
	t       *testing.T
	bin     string
	args    []string
	cmdEnv  []string // added to the environment of each start
	logPath string
	starts  int
	cur     *relayProc
}

func newRelay(t *testing.T, args ...string) *relay {
	t.Helper()
	r := &relay{t: t, bin: mustRelayBinary(t), args: args, logPath: filepath.Join(t.TempDir(), "relay.log")}
	t.Cleanup(func() {
		if r.cur != nil && !r.cur.exited() {
			_ = r.cur.cmd.Process.Kill()
			<-r.cur.done
		}
		r.checkLog()
		switch {
		case os.Getenv("OUTBOX_RELAY_E2E_LOG") != "":
			b, _ := os.ReadFile(r.logPath)
			t.Logf("relay log %s:\n%s", r.logPath, b)
		case t.Failed():
			t.Logf("relay log %s, last lines:\n%s", r.logPath, tailLines(r.logPath, 60))
		}
	})
	return r
}

func (r *relay) start() {
	r.t.Helper()
	if r.cur != nil && !r.cur.exited() {
		r.t.Fatalf("relay start #%d: the previous process is still running", r.starts+1)
	}
	r.starts++
	f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		r.t.Fatalf("open relay log: %v", err)
	}
	defer f.Close()
	fmt.Fprintf(f, "=== e2e: start #%d at %s ===\n", r.starts, time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(r.bin, append([]string{"run"}, r.args...)...)
	cmd.Env = relayEnv(r.cmdEnv...)
	cmd.Stdout, cmd.Stderr = f, f
	// Do not let a crashed test binary leave a relay streaming the slot.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		r.t.Fatalf("start relay: %v", err)
	}
	p := &relayProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	r.cur = p
}

// kill is kill -9: the relay gets no chance to drain, settle or confirm.
func (r *relay) kill() {
	r.t.Helper()
	if r.cur == nil || r.cur.exited() {
		r.t.Fatalf("relay kill: not running (exited: %v)", r.exitErr())
	}
	if err := r.cur.cmd.Process.Kill(); err != nil {
		r.t.Fatalf("relay kill: %v", err)
	}
	<-r.cur.done
	r.note("killed with SIGKILL")
}

// terminate sends SIGTERM and waits up to timeout for the exit.
func (r *relay) terminate(timeout time.Duration) (*os.ProcessState, error) {
	r.t.Helper()
	if r.cur == nil || r.cur.exited() {
		r.t.Fatalf("relay terminate: not running (exited: %v)", r.exitErr())
	}
	if err := r.cur.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		r.t.Fatalf("relay SIGTERM: %v", err)
	}
	select {
	case <-r.cur.done:
		return r.cur.cmd.ProcessState, nil
	case <-time.After(timeout):
		return nil, fmt.Errorf("relay did not exit within %v after SIGTERM", timeout)
	}
}

func (r *relay) exitErr() error {
	if r.cur == nil {
		return errors.New("never started")
	}
	if !r.cur.exited() {
		return nil
	}
	return r.cur.err
}

// requireRunning fails the test when the relay exited on its own.
func (r *relay) requireRunning() {
	r.t.Helper()
	if r.cur != nil && r.cur.exited() {
		r.t.Fatalf("relay exited on its own: %v", r.cur.err)
	}
}

func (r *relay) note(msg string) {
	if f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_APPEND, 0o644); err == nil {
		fmt.Fprintf(f, "=== e2e: %s at %s ===\n", msg, time.Now().Format(time.RFC3339Nano))
		f.Close()
	}
}

func (r *relay) checkLog() {
	b, err := os.ReadFile(r.logPath)
	if err != nil {
		return
	}
	for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
		if i := bytes.Index(b, []byte(bad)); i >= 0 {
			end := min(len(b), i+4000)
			r.t.Errorf("relay log %s shows %q:\n%s", r.logPath, bad, b[i:end])
		}
	}
}

func tailLines(path string, n int) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read %s: %v)", path, err)
	}
	defer f.Close()
	var lines []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if len(lines) > 2*n {
			lines = append(lines[:0], lines[len(lines)-n:]...)
		}
	}
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// runCmd runs the relay binary to completion and returns its exit code and
// output; a run that takes longer than a minute fails the test.
func runCmd(t *testing.T, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, mustRelayBinary(t), args...)
	cmd.Env = relayEnv(env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("outbox-relay %s did not finish within a minute\nstdout:\n%s\nstderr:\n%s", strings.Join(args, " "), out.String(), errb.String())
	}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("run outbox-relay %s: %v", strings.Join(args, " "), err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errb.String()
}

func migrate(t *testing.T, dbURL, publication string) {
	t.Helper()
	code, out, errOut := runCmd(t, nil, "migrate", "--database-url", dbURL, "--publication", publication)
	if code != 0 {
		t.Fatalf("outbox-relay migrate: exit %d\nstdout:\n%s\nstderr:\n%s", code, out, errOut)
	}
}

func connectPG(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("connect to PostgreSQL: %v", err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func connectNATS(t *testing.T, url string) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("connect to NATS: %v", err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream: %v", err)
	}
	return js
}

type slotState struct {
	exists    bool
	active    bool
	streaming bool // its walsender runs START_REPLICATION (catchup or streaming), not only creating it
	confirmed pglogrepl.LSN
}

func readSlot(ctx context.Context, conn *pgx.Conn, slot string) (slotState, error) {
	var s slotState
	var confirmed *string
	// streaming: START_REPLICATION has run. While CREATE_REPLICATION_SLOT
	// runs the slot is already active, but ephemeral: a relay stopped then
	// leaves no slot (seen: rows inserted meanwhile went to the poller).
	err := conn.QueryRow(ctx, `SELECT s.active, s.confirmed_flush_lsn::text, coalesce(r.state IN ('catchup', 'streaming'), false)
		FROM pg_replication_slots s LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = $1`, slot).
		Scan(&s.active, &confirmed, &s.streaming)
	if errors.Is(err, pgx.ErrNoRows) {
		return s, nil
	}
	if err != nil {
		return s, err
	}
	s.exists = true
	if confirmed != nil {
		if s.confirmed, err = pglogrepl.ParseLSN(*confirmed); err != nil {
			return s, err
		}
	}
	return s, nil
}

func waitSlot(t *testing.T, conn *pgx.Conn, slot string, active bool, timeout time.Duration) slotState {
	t.Helper()
	var s slotState
	what := fmt.Sprintf("slot %s to be released (active = false)", slot)
	if active {
		what = fmt.Sprintf("slot %s to exist and be streamed (active = true)", slot)
	}
	testenv.WaitFor(t, timeout, what, func() (bool, error) {
		var err error
		s, err = readSlot(context.Background(), conn, slot)
		if err != nil {
			return false, err
		}
		if active {
			return s.exists && s.active && s.streaming, nil
		}
		return s.exists && !s.active, nil
	})
	return s
}

func currentWAL(t *testing.T, conn *pgx.Conn) pglogrepl.LSN {
	t.Helper()
	var s string
	if err := conn.QueryRow(context.Background(), `SELECT pg_current_wal_lsn()::text`).Scan(&s); err != nil {
		t.Fatalf("pg_current_wal_lsn: %v", err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		t.Fatalf("parse %q: %v", s, err)
	}
	return lsn
}

func streamInfo(t *testing.T, js jetstream.JetStream, name string) (*jetstream.StreamInfo, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, name)
	if err != nil {
		return nil, err
	}
	return s.Info(ctx)
}

// storedMsg is one message as the stream holds it.
type storedMsg struct {
	seq     uint64
	subject string
	data    []byte
	header  nats.Header
}

// readStream reads every message of the stream, first to last, with an
// ordered consumer.
func readStream(t *testing.T, js jetstream.JetStream, name string) []storedMsg {
	t.Helper()
	info, err := streamInfo(t, js, name)
	if err != nil {
		t.Fatalf("stream %s info: %v", name, err)
	}
	want := int(info.State.Msgs)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, name, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		t.Fatalf("ordered consumer on %s: %v", name, err)
	}
	msgs := make([]storedMsg, 0, want)
	for len(msgs) < want {
		if ctx.Err() != nil {
			t.Fatalf("read stream %s: got %d of %d messages before the deadline", name, len(msgs), want)
		}
		batch, err := cons.Fetch(min(1000, want-len(msgs)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatalf("fetch from %s: %v", name, err)
		}
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				t.Fatalf("message metadata: %v", err)
			}
			msgs = append(msgs, storedMsg{seq: md.Sequence.Stream, subject: m.Subject(), data: m.Data(), header: m.Headers()})
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) {
			t.Fatalf("fetch from %s: %v", name, err)
		}
	}
	return msgs
}
