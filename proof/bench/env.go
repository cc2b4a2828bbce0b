package bench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// servers are the PostgreSQL and nats-server every case of a run shares.
type servers struct {
	pg    *testenv.Postgres
	nats  *testenv.NATS
	nc    *nats.Conn
	js    jetstream.JetStream
	admin *pgx.Conn // to the postgres database
	dir   string    // logs of the children
}

func startServers(ctx context.Context, dir string) (*servers, error) {
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Fsync: true})
	if err != nil {
		return nil, err
	}
	nt, err := testenv.StartNATS(testenv.NATSOptions{})
	if err != nil {
		pg.Close()
		return nil, err
	}
	s := &servers{pg: pg, nats: nt, dir: dir}
	if s.nc, err = nats.Connect(nt.URL(), nats.Name("outbox-bench")); err != nil {
		s.close()
		return nil, fmt.Errorf("connect to nats: %w", err)
	}
	if s.js, err = jetstream.New(s.nc, jetstream.WithPublishAsyncMaxPending(4096)); err != nil {
		s.close()
		return nil, err
	}
	if s.admin, err = pgx.Connect(ctx, pg.URL("postgres")); err != nil {
		s.close()
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	return s, nil
}

func (s *servers) close() {
	if s.admin != nil {
		_ = s.admin.Close(context.Background())
	}
	if s.nc != nil {
		s.nc.Close()
	}
	s.nats.Close()
	s.pg.Close()
}

// createDB creates a fresh database for one case and returns its URL.
func (s *servers) createDB(ctx context.Context, name string) (string, error) {
	if _, err := s.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return s.pg.URL(name), nil
}

// dropDB drops a case's database and its slots, so that no slot holds WAL
// for the cases after it.
func (s *servers) dropDB(ctx context.Context, name string) error {
	deadline := time.Now().Add(15 * time.Second)
	for {
		var n int
		err := s.admin.QueryRow(ctx, `SELECT count(*) FROM (
			SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = $1 AND active_pid IS NOT NULL) t`, name).Scan(&n)
		if err == nil {
			_, err = s.admin.Exec(ctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1`, name)
		}
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("drop slots of %s: %w", name, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := s.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

func (s *servers) deleteStream(ctx context.Context, name string) {
	if err := s.js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		fmt.Fprintf(os.Stderr, "outbox-bench: delete stream %s: %v\n", name, err)
	}
}

// streamMsgs returns the number of messages stored in a stream (0 when it
// does not exist yet).
func (s *servers) streamMsgs(ctx context.Context, name string) (uint64, error) {
	st, err := s.js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.State.Msgs, nil
}

// walsenderPID waits for the slot to be streamed and returns the pid of the
// walsender that streams it.
func (s *servers) walsenderPID(ctx context.Context, db, slot string, timeout time.Duration) (int, error) {
	deadline := time.Now().Add(timeout)
	for {
		var pid *int32
		// Streaming, not only active: while CREATE_REPLICATION_SLOT runs the
		// slot is already listed with its walsender, but it is ephemeral
		// and goes away if the relay stops then (seen: the setup's stop
		// lost the slot, and the case found none).
		err := s.admin.QueryRow(ctx,
			`SELECT s.active_pid FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
			WHERE s.slot_name = $1 AND s.database = $2 AND r.state IN ('catchup', 'streaming')`, slot, db).Scan(&pid)
		if err == nil && pid != nil {
			return int(*pid), nil
		}
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return 0, fmt.Errorf("find walsender of slot %s: %w", slot, err)
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("slot %s in %s not streamed after %v", slot, db, timeout)
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// slotWAL returns how much WAL (MB) the slot's next reader must decode:
// from its restart_lsn, and from its confirmed position, to the server's
// current position. Logical decoding reads every record in that range, of
// every table and database, before it reaches the newest commit.
func (s *servers) slotWAL(ctx context.Context, db, slot string) (fromRestart, fromConfirmed float64, err error) {
	err = s.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn) / 1e6,
		pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn) / 1e6
		FROM pg_replication_slots WHERE slot_name = $1 AND database = $2`, slot, db).Scan(&fromRestart, &fromConfirmed)
	if err != nil {
		return 0, 0, fmt.Errorf("slot %s in %s: read its WAL positions: %w", slot, db, err)
	}
	return fromRestart, fromConfirmed, nil
}

// waitSlotInactive waits until no walsender streams the slot.
func (s *servers) waitSlotInactive(ctx context.Context, db, slot string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var active bool
		err := s.admin.QueryRow(ctx,
			`SELECT active FROM pg_replication_slots WHERE slot_name = $1 AND database = $2`, slot, db).Scan(&active)
		if err != nil {
			return fmt.Errorf("slot %s in %s: %w", slot, db, err)
		}
		if !active {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("slot %s in %s still active after %v", slot, db, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// proc is a publisher running as a child process (the relay or the polling
// publisher), so its CPU time and peak RSS can be read from /proc.
type proc struct {
	name string
	cmd  *exec.Cmd
	done chan struct{}
	err  error
	log  string
}

func startProc(name, logPath, bin string, args ...string) (*proc, error) {
	return startProcEnv(name, logPath, bin, nil, args...)
}

// startProcEnv is startProc with extra environment variables (KEY=value).
func startProcEnv(name, logPath, bin string, extraEnv []string, args ...string) (*proc, error) {
	f, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	// Flags only: no OUTBOX_RELAY_* setting of the caller's leaks in.
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OUTBOX_RELAY_") {
			env = append(env, kv)
		}
	}
	cmd.Env = append(env, extraEnv...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &proc{name: name, cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p, nil
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and waits; after 30s it kills.
func (p *proc) stop() error {
	if p.exited() {
		return fmt.Errorf("%s exited early: %v (log %s)", p.name, p.err, p.log)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("%s did not exit within 30s of SIGTERM; killed (log %s)", p.name, p.log)
	}
}

// usage is the publisher's CPU seconds and peak RSS (MiB), read while it runs.
func (p *proc) usage() (cpu, rssMB float64, err error) {
	if p.exited() {
		return 0, 0, fmt.Errorf("%s exited: %v (log %s)", p.name, p.err, p.log)
	}
	if cpu, err = ProcCPU(p.pid()); err != nil {
		return 0, 0, err
	}
	rssMB, err = ProcPeakRSS(p.pid())
	return cpu, rssMB, err
}

// buildRelay builds cmd/outbox-relay of the module in the working directory.
func buildRelay(dir string) (string, error) {
	out := filepath.Join(dir, "outbox-relay")
	return out, testenv.BuildRelay(out, false)
}
