package devenv

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresOptions configures StartPostgres.
type PostgresOptions struct {
	Fsync bool              // default false for speed in tests; benchmarks and the demo set true
	Conf  map[string]string // extra postgresql.conf settings (-c key=value)

	// KeepFiles makes Close leave the data directory and log behind
	// (shutting the server down immediately all the same), for a person to
	// read after a failure.
	KeepFiles bool

	// Version asks for a major version (15, 16, 17, 18; see PostgresBinDir)
	// and BinDir for the binaries in a directory; at most one of them.
	// With neither, OUTBOX_RELAY_TEST_PG_BIN, then
	// OUTBOX_RELAY_TEST_PG_VERSION, then the highest
	// /usr/lib/postgresql/*/bin decide.
	Version int
	BinDir  string

	// ClockOffset runs the server on a wall clock this far ahead of the
	// host's (behind when negative), in whole seconds, through
	// libfaketime (Debian's faketime package): what clock skew between the
	// relay's host and the database does to leases, backoff and ages.
	// Monotonic clocks stay real, so the server's own timeouts are not
	// shifted. A standby of the server inherits it.
	ClockOffset time.Duration
}

// Postgres is a PostgreSQL server running as a child process with its own data
// directory. It can be stopped and started again on the same port and data, so
// clients can keep their connection URL across a simulated outage.
type Postgres struct {
	binDir  string
	major   int // from the data directory's PG_VERSION
	opts    PostgresOptions
	baseDir string
	dataDir string
	sockDir string
	logPath string
	port    int
	args    []string
	env     []string // added to the server's environment at every start
	cred    *syscall.Credential
	keep    bool

	// Set on a standby (StartStandby): its primary, the physical slot it
	// streams from and the primary_conninfo that Reconnect restores.
	primary     *Postgres
	slot        string
	primaryConn string

	mu     sync.Mutex
	proc   *child
	closed bool
}

const (
	pgReadyTimeout = 60 * time.Second
	pgStopTimeout  = 60 * time.Second
)

// StartPostgres initialises a fresh cluster in a temporary directory and starts
// it on a free port.
func StartPostgres(opts PostgresOptions) (*Postgres, error) {
	p, err := initPostgres(opts)
	if err != nil {
		return nil, fmt.Errorf("start postgres: %w", err)
	}
	if err := p.startOnFreePort(); err != nil {
		return nil, err
	}
	return p, nil
}

// startOnFreePort starts a server whose data directory is ready, removing
// its directory when it cannot.
func (p *Postgres) startOnFreePort() error {
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			p.removeAll()
			return fmt.Errorf("start postgres: %w", err)
		}
		p.port = port
		p.args = postgresArgs(p.dataDir, p.sockDir, port, p.opts)
		err = p.Start()
		if err == nil {
			return nil
		}
		// The free port may have been taken in the meantime by another process.
		if !errors.Is(err, errAddrInUse) || attempt == 3 {
			p.removeAll()
			return err
		}
	}
}

var errAddrInUse = errors.New("address already in use")

func initPostgres(opts PostgresOptions) (*Postgres, error) {
	binDir, want, err := postgresBinDir(opts)
	if err != nil {
		return nil, err
	}
	p, err := newPostgres(binDir, opts)
	if err != nil {
		return nil, err
	}
	initdb := exec.Command(filepath.Join(binDir, "initdb"),
		"-D", p.dataDir, "-U", "postgres", "--auth=trust", "-E", "UTF8",
		// A fixed locale keeps initdb from failing on hosts whose LANG names
		// a locale that is not installed.
		"--locale=C", "--no-sync")
	// initdb resolves its working directory; the postgres user may not be
	// allowed into the caller's.
	initdb.Dir = p.baseDir
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		p.removeAll()
		return nil, fmt.Errorf("initdb: %w: %s", err, strings.TrimSpace(string(out)))
	}
	hba := "local all all trust\n" +
		"host all all 127.0.0.1/32 trust\n" +
		"local replication all trust\n" +
		"host replication all 127.0.0.1/32 trust\n"
	if err := p.writeOwned(filepath.Join(p.dataDir, "pg_hba.conf"), hba); err != nil {
		p.removeAll()
		return nil, err
	}
	if err := p.readMajor(); err != nil {
		p.removeAll()
		return nil, err
	}
	if want != 0 && p.major != want {
		p.removeAll()
		return nil, fmt.Errorf("asked for PostgreSQL %d, but the binaries in %s made a cluster of version %d", want, binDir, p.major)
	}
	return p, nil
}

// newPostgres makes the directories of a server that has no data yet.
func newPostgres(binDir string, opts PostgresOptions) (*Postgres, error) {
	cred, err := postgresCredential()
	if err != nil {
		return nil, err
	}
	env, err := clockEnv(opts.ClockOffset)
	if err != nil {
		return nil, err
	}
	base, err := os.MkdirTemp("", "outbox-relay-pg-")
	if err != nil {
		return nil, fmt.Errorf("create temp dir: %w", err)
	}
	p := &Postgres{
		binDir:  binDir,
		opts:    opts,
		env:     env,
		baseDir: base,
		dataDir: filepath.Join(base, "data"),
		sockDir: filepath.Join(base, "run"),
		logPath: filepath.Join(base, "postgres.log"),
		cred:    cred,
		keep:    opts.KeepFiles,
	}
	if err := p.prepareDirs(); err != nil {
		p.removeAll()
		return nil, err
	}
	return p, nil
}

// faketimeGlob finds Debian's libfaketime whatever the multiarch directory.
const faketimeGlob = "/usr/lib/*/faketime/libfaketime.so.1"

// clockEnv returns the environment that makes libfaketime shift the
// server's wall clock by offset, or nothing for a zero offset.
func clockEnv(offset time.Duration) ([]string, error) {
	if offset == 0 {
		return nil, nil
	}
	if offset%time.Second != 0 {
		return nil, fmt.Errorf("clock offset %v: use whole seconds", offset)
	}
	libs, err := filepath.Glob(faketimeGlob)
	if err != nil {
		return nil, fmt.Errorf("clock offset %v: find libfaketime: %w", offset, err)
	}
	if len(libs) == 0 {
		return nil, fmt.Errorf("clock offset %v needs libfaketime (%s), which is not installed: apt-get install faketime (or make setup)", offset, faketimeGlob)
	}
	secs := int64(offset / time.Second)
	return []string{
		"LD_PRELOAD=" + libs[0],
		// libfaketime takes the number as seconds and ignores the "s",
		// which is there for whoever reads the environment.
		fmt.Sprintf("FAKETIME=%+ds", secs),
		// PostgreSQL times its timeouts and waits on the monotonic clock,
		// which a shifted wall clock must leave alone.
		"FAKETIME_DONT_FAKE_MONOTONIC=1",
	}, nil
}

// readMajor reads the major version from PG_VERSION, which initdb writes:
// no process to run, and it is the version the data is in.
func (p *Postgres) readMajor() error {
	b, err := os.ReadFile(filepath.Join(p.dataDir, "PG_VERSION"))
	if err != nil {
		return fmt.Errorf("read the cluster's version: %w", err)
	}
	v, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return fmt.Errorf("read the cluster's version: PG_VERSION holds %q", b)
	}
	p.major = v
	return nil
}

// Version returns the server's major version (15, 16, ...), for tests of
// what only some versions have (failover slots from 17).
func (p *Postgres) Version() int { return p.major }

// prepareDirs makes the directories the server writes to belong to the
// postgres user while every parent stays traversable, which initdb and
// postgres require when they cannot run as root.
func (p *Postgres) prepareDirs() error {
	if err := os.Chmod(p.baseDir, 0o755); err != nil {
		return fmt.Errorf("chmod %s: %w", p.baseDir, err)
	}
	for dir, mode := range map[string]os.FileMode{p.dataDir: 0o700, p.sockDir: 0o755} {
		if err := os.Mkdir(dir, mode); err != nil {
			return fmt.Errorf("create %s: %w", dir, err)
		}
		if err := p.chown(dir); err != nil {
			return err
		}
	}
	return nil
}

func (p *Postgres) chown(path string) error {
	if p.cred == nil {
		return nil
	}
	if err := os.Chown(path, int(p.cred.Uid), int(p.cred.Gid)); err != nil {
		return fmt.Errorf("chown %s to postgres: %w", path, err)
	}
	return nil
}

func (p *Postgres) writeOwned(path, content string) error {
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return p.chown(path)
}

func postgresArgs(dataDir, sockDir string, port int, opts PostgresOptions) []string {
	onOff := "off"
	if opts.Fsync {
		onOff = "on"
	}
	conf := map[string]string{
		"wal_level":               "logical",
		"max_replication_slots":   "64",
		"max_wal_senders":         "64",
		"max_connections":         "300",
		"listen_addresses":        "127.0.0.1",
		"port":                    strconv.Itoa(port),
		"unix_socket_directories": sockDir,
		"fsync":                   onOff,
		"full_page_writes":        onOff,
		"shared_buffers":          "128MB",
		"wal_sender_timeout":      "60s",
		"log_min_messages":        "warning",
	}
	for k, v := range opts.Conf {
		conf[k] = v
	}
	keys := make([]string, 0, len(conf))
	for k := range conf {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	args := []string{"-D", dataDir}
	for _, k := range keys {
		args = append(args, "-c", k+"="+conf[k])
	}
	return args
}

// postgresCredential returns the identity to run initdb and postgres as: both
// refuse to run as root, which is how tests run here and in CI.
func postgresCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("running as root and cannot find the postgres user to run the server as: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parse uid of postgres user: %w", err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("parse gid of postgres user: %w", err)
	}
	// An empty Groups drops root's supplementary groups.
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// Port returns the TCP port the server listens on; it stays the same across
// restarts.
func (p *Postgres) Port() int { return p.port }

// URL returns a connection URL for database dbname as the superuser.
func (p *Postgres) URL(dbname string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", p.port, url.PathEscape(dbname))
}

// LogPath returns the file that collects the server's stdout and stderr.
func (p *Postgres) LogPath() string { return p.logPath }

// Start starts the server again on the same port and data directory and waits
// until it accepts connections, which after an immediate stop includes crash
// recovery.
func (p *Postgres) Start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("start postgres: already closed")
	}
	if p.proc != nil && !p.proc.exited() {
		return errors.New("start postgres: already running")
	}
	cmd := exec.Command(filepath.Join(p.binDir, "postgres"), p.args...)
	cmd.Dir = p.baseDir
	if len(p.env) > 0 {
		// Exec'd directly under the postgres credential, not through
		// runuser or su, so nothing in between resets the environment;
		// the postmaster's backends inherit it by fork.
		cmd.Env = append(os.Environ(), p.env...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Credential: p.cred,
		// SIGQUIT is PostgreSQL's immediate shutdown: the postmaster takes its
		// backends down with it if its parent dies. (The signal is tied to
		// the spawning OS thread, which the Go runtime keeps alive.)
		Pdeathsig: syscall.SIGQUIT,
	}
	proc, offset, err := startChild(cmd, p.logPath)
	if err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	p.proc = proc
	if err := p.waitReady(proc); err != nil {
		_ = proc.stop(syscall.SIGQUIT, 10*time.Second)
		log := logSince(p.logPath, offset)
		if isAddrInUse(log) {
			err = fmt.Errorf("%w: %w", errAddrInUse, err)
		}
		return fmt.Errorf("start postgres on port %d: %w\n--- %s ---\n%s", p.port, err, p.logPath, log)
	}
	return nil
}

func (p *Postgres) waitReady(proc *child) error {
	ctx, cancel := context.WithTimeout(context.Background(), pgReadyTimeout)
	defer cancel()
	var lastErr error
	for {
		if proc.exited() {
			return fmt.Errorf("postgres exited during startup: %v", proc.err)
		}
		lastErr = pingPostgres(ctx, p.URL("postgres"))
		if lastErr == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("not accepting connections after %v: %w", pgReadyTimeout, lastErr)
		case <-proc.done:
		case <-time.After(20 * time.Millisecond):
		}
	}
}

func pingPostgres(ctx context.Context, connURL string) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, connURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	var one int
	return conn.QueryRow(ctx, "SELECT 1").Scan(&one)
}

var pgStopSignals = map[string]syscall.Signal{
	"smart":     syscall.SIGTERM,
	"fast":      syscall.SIGINT,
	"immediate": syscall.SIGQUIT,
}

// Stop shuts the server down in one of PostgreSQL's shutdown modes ("smart",
// "fast" or "immediate") and waits for the postmaster to exit. A server that
// does not stop within 60s is taken down immediately and an error returned.
func (p *Postgres) Stop(mode string) error {
	sig, ok := pgStopSignals[mode]
	if !ok {
		return fmt.Errorf("stop postgres: unknown shutdown mode %q (want smart, fast or immediate)", mode)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.proc == nil || p.proc.exited() {
		return errors.New("stop postgres: not running")
	}
	// SIGKILL on the postmaster alone would orphan its backends and block the
	// next start on their shared memory, so escalate via immediate shutdown.
	if err := p.proc.stop(sig, pgStopTimeout, syscall.SIGQUIT); err != nil {
		return fmt.Errorf("stop postgres (%s): %w", mode, err)
	}
	return nil
}

// KillImmediate is Stop("immediate"), pg_ctl -m immediate: the way a
// primary crashes in a failover test, without a shutdown checkpoint or a
// last word to its standbys.
func (p *Postgres) KillImmediate() error { return p.Stop("immediate") }

// Restart stops the server in the given mode and starts it again.
func (p *Postgres) Restart(mode string) error {
	if err := p.Stop(mode); err != nil {
		return err
	}
	return p.Start()
}

// Close stops the server immediately and removes its directory unless
// PostgresOptions.KeepFiles was set. It is safe to call more than once.
func (p *Postgres) Close() { p.Shutdown(p.keep) }

// Shutdown is Close with the choice of keeping the directory made now: a
// test run decides that only once it knows whether it failed.
func (p *Postgres) Shutdown(keep bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	p.closed = true
	if p.proc != nil && !p.proc.exited() {
		_ = p.proc.stop(syscall.SIGQUIT, pgStopTimeout)
	}
	if !keep {
		p.removeAll()
	}
}

func (p *Postgres) removeAll() { _ = os.RemoveAll(p.baseDir) }

// PID returns the process id of the running postmaster, or 0 when it is not
// running. Benchmarks use it to tell the server's processes from others.
func (p *Postgres) PID() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.proc.pid()
}
