package devenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSOptions configures StartNATS.
type NATSOptions struct {
	// Bin is the nats-server binary; empty means PinnedNATSServer, the
	// version go.mod pins, never whatever is on PATH.
	Bin string

	SyncAlways bool // JetStream sync_interval: always (fsync every write); needs a config file

	// Monitor serves nats-server's monitoring endpoints (/varz, ...) on a
	// free port of its own (MonitorURL).
	Monitor bool

	// KeepFiles makes Close stop the server gracefully and leave its store
	// directory and log behind, for a person to read after a failure.
	KeepFiles bool

	// Conf is more of the server's configuration file (accounts, users and
	// their permissions, limits): what has no command-line flag. With
	// users in it, ReadyUser and ReadyPassword are the user the readiness
	// check logs in as.
	Conf                     string
	ReadyUser, ReadyPassword string
	// ReadyOptions are more options of the readiness check's connection:
	// a client certificate when Conf requires TLS with one.
	ReadyOptions []nats.Option

	// NoAdvertise is for StartNATSCluster only: the servers do not tell
	// clients the other nodes' client URLs (cluster no_advertise), so a
	// client that reaches the cluster through proxies stays behind them.
	NoAdvertise bool
}

// NATS is a nats-server with JetStream running as a child process. Its store
// directory and port survive Kill/Stop and Start, so streams and clients'
// URLs outlive a simulated crash.
type NATS struct {
	binPath  string
	baseDir  string
	storeDir string
	logPath  string
	port     int
	args     []string
	keep     bool
	// readyUser, readyPassword: the user the readiness check logs in as.
	readyUser, readyPassword string
	readyOptions             []nats.Option
	// monitorPort serves /varz when started with NATSOptions.Monitor.
	monitorPort int

	// Set for a node of StartNATSCluster: its server_name, and readiness
	// means accepting clients, because JetStream answers only once the
	// cluster has a meta leader (NATSCluster.WaitJetStream).
	serverName  string
	clusterNode bool

	mu     sync.Mutex
	proc   *child
	closed bool
}

const (
	natsReadyTimeout = 60 * time.Second
	natsStopTimeout  = 60 * time.Second
)

// StartNATS starts a JetStream-enabled nats-server on a free port with a
// fresh store directory.
func StartNATS(opts NATSOptions) (*NATS, error) {
	bin, err := natsServerBin(opts)
	if err != nil {
		return nil, fmt.Errorf("start nats: %w", err)
	}
	base, err := os.MkdirTemp("", "outbox-relay-nats-")
	if err != nil {
		return nil, fmt.Errorf("start nats: create temp dir: %w", err)
	}
	n := &NATS{
		binPath:  bin,
		baseDir:  base,
		storeDir: filepath.Join(base, "store"),
		logPath:  filepath.Join(base, "nats.log"),
		keep:     opts.KeepFiles,

		readyUser: opts.ReadyUser, readyPassword: opts.ReadyPassword, readyOptions: opts.ReadyOptions,
	}
	var confPath string
	if opts.SyncAlways || opts.Conf != "" {
		// sync_interval has no command-line flag. The store directory stays
		// on the command line only: nats-server rejects it in both places.
		confPath = filepath.Join(base, "nats.conf")
		conf := opts.Conf + "\n"
		if opts.SyncAlways {
			conf += "jetstream {\n  sync_interval: always\n}\n"
		}
		if err := os.WriteFile(confPath, []byte(conf), 0o644); err != nil {
			n.removeAll()
			return nil, fmt.Errorf("start nats: write config: %w", err)
		}
	}
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			n.removeAll()
			return nil, fmt.Errorf("start nats: %w", err)
		}
		n.port = port
		n.args = []string{"-a", "127.0.0.1", "-p", strconv.Itoa(port), "-js", "-sd", n.storeDir}
		if opts.Monitor {
			mport, err := freePort()
			if err != nil {
				n.removeAll()
				return nil, fmt.Errorf("start nats: %w", err)
			}
			n.monitorPort = mport
			n.args = append(n.args, "-m", strconv.Itoa(mport))
		}
		if confPath != "" {
			n.args = append(n.args, "-c", confPath)
		}
		err = n.Start()
		if err == nil {
			return n, nil
		}
		// The free port may have been taken in the meantime by another process.
		if !errors.Is(err, errAddrInUse) || attempt == 3 {
			n.removeAll()
			return nil, err
		}
	}
}

// StoreDir is the server's -sd store directory (tests cut its files).
func (n *NATS) StoreDir() string { return n.storeDir }

// Port returns the client port; it stays the same across restarts.
func (n *NATS) Port() int { return n.port }

// MonitorURL is the monitoring endpoint's base URL, "" unless started with
// NATSOptions.Monitor.
func (n *NATS) MonitorURL() string {
	if n.monitorPort == 0 {
		return ""
	}
	return fmt.Sprintf("http://127.0.0.1:%d", n.monitorPort)
}

// URL returns the client URL.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.port) }

// ServerName returns the server_name of a cluster node (as in
// StreamInfo.Cluster.Leader); it is empty for a server from StartNATS.
func (n *NATS) ServerName() string { return n.serverName }

// LogPath returns the file that collects the server's output.
func (n *NATS) LogPath() string { return n.logPath }

// Start starts the server again on the same port and store directory and
// waits until JetStream answers, which includes recovering the streams.
func (n *NATS) Start() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return errors.New("start nats: already closed")
	}
	if n.proc != nil && !n.proc.exited() {
		return errors.New("start nats: already running")
	}
	cmd := exec.Command(n.binPath, n.args...)
	cmd.Dir = n.baseDir
	// Do not let a crashed parent (test binary or demo) leave a server holding
	// the port.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	proc, offset, err := startChild(cmd, n.logPath)
	if err != nil {
		return fmt.Errorf("start nats: %w", err)
	}
	n.proc = proc
	if err := n.waitReady(proc); err != nil {
		_ = proc.stop(syscall.SIGKILL, 10*time.Second)
		log := logSince(n.logPath, offset)
		if isAddrInUse(log) {
			err = fmt.Errorf("%w: %w", errAddrInUse, err)
		}
		return fmt.Errorf("start nats on port %d: %w\n--- %s ---\n%s", n.port, err, n.logPath, log)
	}
	return nil
}

func (n *NATS) waitReady(proc *child) error {
	ctx, cancel := context.WithTimeout(context.Background(), natsReadyTimeout)
	defer cancel()
	var lastErr error
	for {
		if proc.exited() {
			return fmt.Errorf("nats-server exited during startup: %v", proc.err)
		}
		lastErr = n.ping(ctx)
		if lastErr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("jetstream not answering after %v: %w", natsReadyTimeout, lastErr)
		case <-proc.done:
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func (n *NATS) ping(ctx context.Context) error {
	nc, err := nats.Connect(n.URL(), append([]nats.Option{nats.Timeout(2 * time.Second), nats.NoReconnect(), nats.UserInfo(n.readyUser, n.readyPassword)}, n.readyOptions...)...)
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer nc.Close()
	if n.clusterNode {
		return nil
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("jetstream: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		return fmt.Errorf("jetstream account info: %w", err)
	}
	return nil
}

// Kill simulates a crash: the server gets no chance to flush or close
// anything.
func (n *NATS) Kill() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc == nil || n.proc.exited() {
		return errors.New("kill nats: not running")
	}
	if err := n.proc.stop(syscall.SIGKILL, natsStopTimeout); err != nil {
		return fmt.Errorf("kill nats: %w", err)
	}
	return nil
}

// Stop shuts the server down gracefully and waits for it to exit. A server
// that does not stop within 60s is killed and an error returned.
func (n *NATS) Stop() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc == nil || n.proc.exited() {
		return errors.New("stop nats: not running")
	}
	if err := n.proc.stop(syscall.SIGTERM, natsStopTimeout); err != nil {
		return fmt.Errorf("stop nats: %w", err)
	}
	return nil
}

// Restart stops the server gracefully and starts it again.
func (n *NATS) Restart() error {
	if err := n.Stop(); err != nil {
		return err
	}
	return n.Start()
}

// Close kills the server and removes its directory, unless
// NATSOptions.KeepFiles was set. It is safe to call more than once.
func (n *NATS) Close() { n.Shutdown(n.keep) }

// Shutdown is Close with the choice of keeping the directory made now: a
// test run decides that only once it knows whether it failed.
func (n *NATS) Shutdown(keep bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return
	}
	n.closed = true
	if n.proc != nil && !n.proc.exited() {
		// Graceful when keeping files so the log ends like a real shutdown;
		// otherwise the store is thrown away and there is nothing to flush.
		sig := syscall.SIGKILL
		if keep {
			sig = syscall.SIGTERM
		}
		_ = n.proc.stop(sig, natsStopTimeout)
	}
	if !keep {
		n.removeAll()
	}
}

func (n *NATS) removeAll() { _ = os.RemoveAll(n.baseDir) }

// PID returns the process id of the running nats-server, or 0 when it is not
// running. Benchmarks read its CPU time from /proc/<pid>/stat.
func (n *NATS) PID() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc.pid()
}

// TailCut is what CutStreamTail did to a stream's store.
type TailCut struct {
	Block        string // the message block cut
	Before, Kept int64  // its size before and after, in bytes
	Removed      []string
}

// CutStreamTail simulates a broker that loses acknowledged writes it had
// not synced (G19): it truncates the newest message block of stream in the
// store to keep (0..1) of its size and removes every other file beside the
// blocks (the stream's index.db and per-block index and state files, which
// would otherwise restore the stream's state past the cut). The server must
// be stopped; Start then recovers the stream from what the blocks hold.
func (n *NATS) CutStreamTail(stream string, keep float64) (TailCut, error) {
	n.mu.Lock()
	running := n.proc != nil && !n.proc.exited()
	n.mu.Unlock()
	if running {
		return TailCut{}, fmt.Errorf("cut stream %s: nats-server is running", stream)
	}
	return CutStreamTail(filepath.Join(n.storeDir, "jetstream", "$G", "streams", stream), keep)
}

// CutStreamTail is NATS.CutStreamTail on a stream's store directory
// (<store>/jetstream/<account>/streams/<name>).
func CutStreamTail(dir string, keep float64) (TailCut, error) {
	var cut TailCut
	if keep < 0 || keep >= 1 {
		return cut, fmt.Errorf("cut stream tail in %s: keep %v: want 0 <= keep < 1", dir, keep)
	}
	msgs := filepath.Join(dir, "msgs")
	entries, err := os.ReadDir(msgs)
	if err != nil {
		return cut, fmt.Errorf("cut stream tail: read %s: %w", msgs, err)
	}
	// Blocks are named <index>.blk; the newest has the highest index,
	// which a name sort gets wrong past 9.
	newest := -1
	for _, e := range entries {
		var i int
		if _, err := fmt.Sscanf(e.Name(), "%d.blk", &i); err == nil && filepath.Ext(e.Name()) == ".blk" && i > newest {
			newest, cut.Block = i, filepath.Join(msgs, e.Name())
		}
	}
	if newest < 0 {
		return cut, fmt.Errorf("cut stream tail: no message blocks in %s", msgs)
	}
	fi, err := os.Stat(cut.Block)
	if err != nil {
		return cut, fmt.Errorf("cut stream tail: %w", err)
	}
	cut.Before, cut.Kept = fi.Size(), int64(float64(fi.Size())*keep)
	if err := os.Truncate(cut.Block, cut.Kept); err != nil {
		return cut, fmt.Errorf("cut stream tail: truncate %s: %w", cut.Block, err)
	}
	for _, e := range entries {
		if filepath.Ext(e.Name()) == ".blk" {
			continue
		}
		if err := os.RemoveAll(filepath.Join(msgs, e.Name())); err != nil {
			return cut, fmt.Errorf("cut stream tail: remove %s: %w", e.Name(), err)
		}
		cut.Removed = append(cut.Removed, e.Name())
	}
	return cut, nil
}
