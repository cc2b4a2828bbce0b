package chaos

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// relayInst is one relay instance: its own proxies to PostgreSQL and NATS
// (so one instance can be cut off while the other is not), its own
// application_name (so its backends can be found) and one log file for all
// its starts. A supervisor restarts it when it exits on its own while it is
// meant to run, as systemd or Kubernetes would.
type relayInst struct {
	name    string
	appName string
	pgProxy proxyGroup // one per PostgreSQL server
	nsProxy proxyGroup // one per NATS node
	bin     string
	args    []string
	logPath string
	env     []string

	mu      sync.Mutex
	want    bool
	cmd     *exec.Cmd
	done    chan struct{}
	starts  int
	exits   int // exits it was not asked for
	paused  bool
	onEvent func(string)
}

func (r *relayInst) note(f *os.File, msg string) {
	fmt.Fprintf(f, "=== chaos: %s %s at %s ===\n", r.name, msg, time.Now().Format(time.RFC3339Nano))
}

func (r *relayInst) appendNote(msg string) {
	if f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644); err == nil {
		r.note(f, msg)
		f.Close()
	}
}

// start starts the process if it is not running and marks it wanted.
func (r *relayInst) start() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.want = true
	return r.startLocked()
}

func (r *relayInst) startLocked() error {
	if r.cmd != nil && !isDone(r.done) {
		return nil
	}
	f, err := os.OpenFile(r.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("relay %s: open log: %w", r.name, err)
	}
	defer f.Close()
	r.starts++
	r.note(f, fmt.Sprintf("start #%d", r.starts))
	cmd := exec.Command(r.bin, append([]string{"run"}, r.args...)...)
	cmd.Env = r.env
	cmd.Stdout, cmd.Stderr = f, f
	// A chaos run that dies must not leave relays streaming the slot.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("relay %s: start: %w", r.name, err)
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	r.cmd, r.done = cmd, done
	return nil
}

// kill is SIGKILL: no drain, no last confirmation. It leaves the instance
// not wanted, so the supervisor does not restart it.
func (r *relayInst) kill() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.want = false
	if r.cmd == nil || isDone(r.done) {
		return fmt.Errorf("relay %s: kill: not running", r.name)
	}
	if err := r.cmd.Process.Kill(); err != nil {
		return fmt.Errorf("relay %s: kill: %w", r.name, err)
	}
	<-r.done
	r.paused = false
	r.appendNote("killed with SIGKILL")
	return nil
}

// pause is SIGSTOP: the process keeps its sockets and its memory, and does
// nothing at all until resume, as a stopped container, a frozen VM or a
// very long stop-the-world pause would. Its peers notice only through
// their own timeouts.
func (r *relayInst) pause() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cmd == nil || isDone(r.done) {
		return fmt.Errorf("relay %s: pause: not running", r.name)
	}
	if err := r.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("relay %s: pause: %w", r.name, err)
	}
	r.paused = true
	r.appendNote("stopped with SIGSTOP")
	return nil
}

// resume is SIGCONT of a paused process.
func (r *relayInst) resume() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.resumeLocked()
}

func (r *relayInst) resumeLocked() error {
	if !r.paused {
		return nil
	}
	r.paused = false
	if r.cmd == nil || isDone(r.done) {
		return nil
	}
	r.appendNote("continued with SIGCONT")
	if err := r.cmd.Process.Signal(syscall.SIGCONT); err != nil {
		return fmt.Errorf("relay %s: resume: %w", r.name, err)
	}
	return nil
}

// stop sends SIGTERM and kills the process if it is still there after
// timeout.
func (r *relayInst) stop(timeout time.Duration) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.want = false
	if r.cmd == nil || isDone(r.done) {
		return nil
	}
	// A stopped process would keep SIGTERM pending until the timeout.
	_ = r.resumeLocked()
	r.appendNote("SIGTERM")
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
		return nil
	case <-time.After(timeout):
	}
	_ = r.cmd.Process.Kill()
	<-r.done
	return fmt.Errorf("relay %s: no exit within %v of SIGTERM; killed", r.name, timeout)
}

func (r *relayInst) running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cmd != nil && !isDone(r.done)
}

// supervise restarts the instance after an exit nobody asked for.
func (r *relayInst) supervise() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.want || r.cmd == nil || !isDone(r.done) {
		return
	}
	r.exits++
	r.appendNote(fmt.Sprintf("exited on its own (%v); restarting", r.cmd.ProcessState))
	if r.onEvent != nil {
		r.onEvent(fmt.Sprintf("relay %s exited on its own (%v); restarting", r.name, r.cmd.ProcessState))
	}
	if err := r.startLocked(); err != nil && r.onEvent != nil {
		r.onEvent(err.Error())
	}
}

func isDone(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// scanLog returns the lines around each panic, fatal error or data race in
// the log.
func scanLog(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, bad := range []string{"WARNING: DATA RACE", "panic:", "fatal error:"} {
			if strings.Contains(line, bad) {
				if len(line) > 300 {
					line = line[:300]
				}
				out = append(out, fmt.Sprintf("%s: %s", path, line))
			}
		}
	}
	return out
}
