package devenv

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"
)

// child is a started server process. Wait runs in its own goroutine from the
// start so the process is reaped as soon as it exits (no zombies, even if the
// test never stops it) and so that stopping can wait with a timeout.
type child struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // valid once done is closed
}

// startChild starts cmd with its stdout and stderr appended to logPath. It
// returns the log size before the start so that readiness failures can show
// what this start logged rather than earlier runs.
func startChild(cmd *exec.Cmd, logPath string) (*child, int64, error) {
	logFile, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, 0, fmt.Errorf("open log: %w", err)
	}
	// The child holds its own descriptor; ours is not needed after Start.
	defer logFile.Close()
	var offset int64
	if fi, err := logFile.Stat(); err == nil {
		offset = fi.Size()
	}
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	if err := cmd.Start(); err != nil {
		return nil, 0, fmt.Errorf("exec %s: %w", cmd.Path, err)
	}
	c := &child{cmd: cmd, done: make(chan struct{})}
	go func() {
		c.err = cmd.Wait()
		close(c.done)
	}()
	return c, offset, nil
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

// stop sends sig and waits up to timeout for the exit. A process that does
// not exit in time is sent each of escalate in turn (10s apart) so that a hung
// server never outlives the test, but the timeout is still reported as an
// error because the requested shutdown mode did not happen.
func (c *child) stop(sig syscall.Signal, timeout time.Duration, escalate ...syscall.Signal) error {
	if err := c.cmd.Process.Signal(sig); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("send %v to pid %d: %w", sig, c.cmd.Process.Pid, err)
	}
	select {
	case <-c.done:
		return nil
	case <-time.After(timeout):
	}
	for _, s := range escalate {
		_ = c.cmd.Process.Signal(s)
		select {
		case <-c.done:
			return fmt.Errorf("pid %d did not exit within %v after %v; exited after %v", c.cmd.Process.Pid, timeout, sig, s)
		case <-time.After(10 * time.Second):
		}
	}
	_ = c.cmd.Process.Kill()
	<-c.done
	return fmt.Errorf("pid %d did not exit within %v after %v; killed", c.cmd.Process.Pid, timeout, sig)
}

// freePort asks the kernel for an unused port. Another process could take it
// before the server binds; the Start functions retry with a new port when
// the server reports that the address is in use.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("find free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("find free port: %w", err)
	}
	return port, nil
}

// logSince returns what was appended to the log after offset, limited to the
// last 4KiB, which is where a startup failure is explained.
func logSince(path string, offset int64) string {
	const max = 4096
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log %s: %v)", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Sprintf("(cannot read log %s: %v)", path, err)
	}
	if fi.Size()-offset > max {
		offset = fi.Size() - max
	}
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return fmt.Sprintf("(cannot read log %s: %v)", path, err)
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return fmt.Sprintf("(cannot read log %s: %v)", path, err)
	}
	return strings.TrimSpace(string(b))
}

func isAddrInUse(log string) bool {
	l := strings.ToLower(log)
	return strings.Contains(l, "address already in use") || strings.Contains(l, "could not bind")
}

// pid returns the process id of a running child, or 0 when c is nil or
// has exited.
func (c *child) pid() int {
	if c == nil || c.exited() {
		return 0
	}
	return c.cmd.Process.Pid
}
