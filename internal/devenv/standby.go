package devenv

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyOptions configures StartStandby.
type StandbyOptions struct {
	// Slot names the physical replication slot on the primary that the
	// standby streams from (lowercase letters, digits and underscores);
	// default standby_<primary port>_<n>.
	Slot string

	// SynchronizedStandbySlots (PostgreSQL 17+) adds Slot to the primary's
	// synchronized_standby_slots, so that logical walsenders of failover
	// slots send nothing this standby has not flushed: what a promotion
	// without lost or taken-back messages needs. Off, the primary does not
	// wait for the standby, which is what a lagging-standby test wants.
	SynchronizedStandbySlots bool

	// KeepFiles as in PostgresOptions; the primary's setting applies too.
	KeepFiles bool
}

const standbyReadyTimeout = 60 * time.Second

var (
	slotNameOK = regexp.MustCompile(`^[a-z0-9_]{1,63}$`)
	standbySeq atomic.Int64
)

// StartStandby makes a physical streaming standby of p and starts it on a
// free port. pg_basebackup is not among the npm-packaged binaries, so the
// standby is a copy of p's data directory taken while p is stopped: p is
// shut down (fast) for the copy and started again on its port, which its
// clients see as a restart. The primary keeps a physical slot for the
// standby, so it retains the WAL the standby has not received, also while
// the standby is cut off (CutOff).
//
// The standby runs with hot_standby_feedback, and from PostgreSQL 17 with
// sync_replication_slots, so the primary's failover logical slots appear on
// it (pg_replication_slots.synced) and survive a promotion. It returns when
// the standby streams from p. Close it before p; the primary's slot is
// removed with the primary.
func (p *Postgres) StartStandby(opts StandbyOptions) (*Postgres, error) {
	if p.primary != nil {
		return nil, errors.New("start standby: cascading standbys are not supported: start it from the primary")
	}
	slot := opts.Slot
	if slot == "" {
		slot = fmt.Sprintf("standby_%d_%d", p.port, standbySeq.Add(1))
	}
	if !slotNameOK.MatchString(slot) {
		return nil, fmt.Errorf("start standby: slot name %q: use lowercase letters, digits and underscores", slot)
	}
	if opts.SynchronizedStandbySlots && p.major < 17 {
		return nil, fmt.Errorf("start standby: synchronized_standby_slots needs PostgreSQL 17 or later; this is %d", p.major)
	}
	err := p.withConn(30*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		// Reserved now, so the primary keeps WAL from before the copy.
		if _, err := conn.Exec(ctx, "SELECT pg_create_physical_replication_slot($1, true)", slot); err != nil {
			return fmt.Errorf("create physical slot %s: %w", slot, err)
		}
		if !opts.SynchronizedStandbySlots {
			return nil
		}
		var cur string
		if err := conn.QueryRow(ctx, "SHOW synchronized_standby_slots").Scan(&cur); err != nil {
			return fmt.Errorf("read synchronized_standby_slots: %w", err)
		}
		if cur != "" {
			cur += ","
		}
		// Takes effect with the restart below.
		if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronized_standby_slots = "+quoteLiteral(cur+slot)); err != nil {
			return fmt.Errorf("set synchronized_standby_slots: %w", err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("start standby of %s: %w", p.URL(""), err)
	}
	if err := p.Stop("fast"); err != nil {
		return nil, fmt.Errorf("start standby: stop the primary for the copy: %w", err)
	}
	s, copyErr := p.copyForStandby(slot, opts)
	// The primary comes back whatever happened to the copy: callers expect
	// the server they had.
	if err := p.Start(); err != nil {
		if s != nil {
			s.removeAll()
		}
		return nil, fmt.Errorf("start standby: start the primary again after the copy: %w", err)
	}
	if copyErr != nil {
		return nil, fmt.Errorf("start standby: %w", copyErr)
	}
	if err := s.startOnFreePort(); err != nil {
		return nil, fmt.Errorf("start standby: %w", err)
	}
	if err := s.waitStreaming(slot); err != nil {
		s.Close()
		return nil, fmt.Errorf("start standby: %w", err)
	}
	return s, nil
}

// copyForStandby copies the stopped primary's data directory into a new
// server's and turns the copy into a standby of p.
func (p *Postgres) copyForStandby(slot string, opts StandbyOptions) (*Postgres, error) {
	sopts := p.opts
	sopts.KeepFiles = opts.KeepFiles || p.keep
	sopts.Conf = maps.Clone(p.opts.Conf)
	// A standby that inherited it would, once promoted, hold its own
	// logical walsenders back for a standby it does not have.
	delete(sopts.Conf, "synchronized_standby_slots")
	s, err := newPostgres(p.binDir, sopts)
	if err != nil {
		return nil, err
	}
	// As the server's user: the copy keeps postgres as the owner and the
	// modes postgres insists on.
	cp := exec.Command("cp", "-a", p.dataDir+"/.", s.dataDir)
	cp.Dir = s.baseDir
	cp.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	if out, err := cp.CombinedOutput(); err != nil {
		s.removeAll()
		return nil, fmt.Errorf("copy %s to %s: %w: %s", p.dataDir, s.dataDir, err, strings.TrimSpace(string(out)))
	}
	if err := s.configureStandby(p, slot); err != nil {
		s.removeAll()
		return nil, err
	}
	return s, nil
}

func (s *Postgres) configureStandby(primary *Postgres, slot string) error {
	s.major = primary.major
	s.primary = primary
	s.slot = slot
	s.primaryConn = fmt.Sprintf("host=127.0.0.1 port=%d user=postgres dbname=postgres application_name=%s", primary.port, slot)
	// The primary's slots are its own, as pg_basebackup leaves them out: a
	// copied logical slot would stop slot synchronisation ("slot with the
	// same name already exists") and a copied physical one would pin WAL.
	slots, err := filepath.Glob(filepath.Join(s.dataDir, "pg_replslot", "*"))
	if err != nil {
		return fmt.Errorf("list copied slots: %w", err)
	}
	for _, path := range append(slots, filepath.Join(s.dataDir, "postmaster.pid"), filepath.Join(s.dataDir, "postmaster.opts")) {
		if err := os.RemoveAll(path); err != nil {
			return fmt.Errorf("remove %s from the standby's copy: %w", path, err)
		}
	}
	if err := s.writeOwned(filepath.Join(s.dataDir, "standby.signal"), ""); err != nil {
		return err
	}
	// In postgresql.auto.conf rather than on the command line, which
	// would override ALTER SYSTEM and so CutOff.
	settings := map[string]string{
		"primary_conninfo":     quoteLiteral(s.primaryConn),
		"primary_slot_name":    quoteLiteral(slot),
		"hot_standby_feedback": "on",
	}
	if s.major >= 17 {
		settings["sync_replication_slots"] = "on"
	}
	autoConf := filepath.Join(s.dataDir, "postgresql.auto.conf")
	old, err := os.ReadFile(autoConf)
	if err != nil {
		return fmt.Errorf("read the copy's postgresql.auto.conf: %w", err)
	}
	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(string(old), "\n"), "\n") {
		key, _, _ := strings.Cut(line, "=")
		key = strings.TrimSpace(key)
		// synchronized_standby_slots: the primary's, for its standbys (see
		// copyForStandby).
		if _, ours := settings[key]; ours || key == "synchronized_standby_slots" {
			continue
		}
		b.WriteString(line + "\n")
	}
	for _, k := range []string{"primary_conninfo", "primary_slot_name", "hot_standby_feedback", "sync_replication_slots"} {
		if v, ok := settings[k]; ok {
			fmt.Fprintf(&b, "%s = %s\n", k, v)
		}
	}
	return s.writeOwned(autoConf, b.String())
}

// waitStreaming waits until the primary reports the standby's slot active,
// so a misconfigured standby fails here rather than as missing rows later.
func (s *Postgres) waitStreaming(slot string) error {
	deadline := time.Now().Add(standbyReadyTimeout)
	for {
		var active bool
		err := s.primary.withConn(10*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
			return conn.QueryRow(ctx, "SELECT active FROM pg_replication_slots WHERE slot_name = $1", slot).Scan(&active)
		})
		if err == nil && active {
			return nil
		}
		if time.Now().After(deadline) {
			if err == nil {
				err = errors.New("slot inactive")
			}
			return fmt.Errorf("standby on port %d not streaming from slot %s after %v: %w\n--- %s ---\n%s",
				s.port, slot, standbyReadyTimeout, err, s.logPath, logSince(s.logPath, 0))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Promote makes a standby a primary (what pg_ctl promote does, through
// pg_promote) and returns once it accepts writes.
func (s *Postgres) Promote() error {
	if s.primary == nil {
		return errors.New("promote: not a standby")
	}
	err := s.withConn(90*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		var promoted bool
		if err := conn.QueryRow(ctx, "SELECT pg_promote(true, 60)").Scan(&promoted); err != nil {
			return err
		}
		var inRecovery bool
		if err := conn.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil {
			return err
		}
		if !promoted || inRecovery {
			return fmt.Errorf("still in recovery after 60s (pg_promote returned %v)", promoted)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("promote standby on port %d: %w", s.port, err)
	}
	return nil
}

// CutOff disconnects a standby from its primary (sets primary_conninfo to
// the empty string) and returns once its WAL receiver has stopped: from then on it falls
// behind, a lagging standby on demand. The primary keeps the WAL for it in
// its slot. Reconnect undoes it.
func (s *Postgres) CutOff() error {
	if err := s.setPrimaryConninfo(""); err != nil {
		return fmt.Errorf("cut standby on port %d off: %w", s.port, err)
	}
	return nil
}

// Reconnect restores the standby's primary_conninfo after CutOff and
// returns once it streams again; catching up may take longer.
func (s *Postgres) Reconnect() error {
	if err := s.setPrimaryConninfo(s.primaryConn); err != nil {
		return fmt.Errorf("reconnect standby on port %d: %w", s.port, err)
	}
	return nil
}

func (s *Postgres) setPrimaryConninfo(conninfo string) error {
	if s.primary == nil {
		return errors.New("not a standby")
	}
	return s.withConn(standbyReadyTimeout+10*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, "ALTER SYSTEM SET primary_conninfo = "+quoteLiteral(conninfo)); err != nil {
			return fmt.Errorf("set primary_conninfo: %w", err)
		}
		if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
			return fmt.Errorf("reload configuration: %w", err)
		}
		// The view has a row exactly while a WAL receiver runs.
		want := "SELECT count(*) = 0 FROM pg_stat_wal_receiver"
		if conninfo != "" {
			want = "SELECT count(*) = 1 FROM pg_stat_wal_receiver WHERE status = 'streaming'"
		}
		deadline := time.Now().Add(standbyReadyTimeout)
		for {
			var done bool
			if err := conn.QueryRow(ctx, want).Scan(&done); err != nil {
				return fmt.Errorf("read pg_stat_wal_receiver: %w", err)
			}
			if done {
				return nil
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("WAL receiver not in the expected state after %v (%s)", standbyReadyTimeout, want)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
}

// WaitReplayed waits until the standby has replayed everything the primary
// had written when it was called, so a test can read on the standby what it
// committed on the primary.
func (s *Postgres) WaitReplayed(timeout time.Duration) error {
	if s.primary == nil {
		return errors.New("wait for replay: not a standby")
	}
	var target string
	err := s.primary.withConn(10*time.Second, func(ctx context.Context, conn *pgx.Conn) error {
		return conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&target)
	})
	if err != nil {
		return fmt.Errorf("wait for replay: read the primary's WAL position: %w", err)
	}
	err = s.withConn(timeout, func(ctx context.Context, conn *pgx.Conn) error {
		for {
			var done bool
			if err := conn.QueryRow(ctx, "SELECT coalesce(pg_last_wal_replay_lsn() >= $1::pg_lsn, false)", target).Scan(&done); err != nil {
				return err
			}
			if done {
				return nil
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(20 * time.Millisecond):
			}
		}
	})
	if err != nil {
		return fmt.Errorf("wait for standby on port %d to replay up to %s: %w", s.port, target, err)
	}
	return nil
}

// StandbySlot returns the name of the physical slot a standby streams from
// on its primary ("" on a primary): what `run --standby-slot` names.
func (s *Postgres) StandbySlot() string { return s.slot }

// MultiHostURL returns a URL of database dbname that names every server
// and asks for the one that accepts writes (target_session_attrs=read-write),
// the way an application follows a failover: the client tries the hosts in
// order and skips standbys.
func MultiHostURL(dbname string, servers ...*Postgres) string {
	hosts := make([]string, len(servers))
	for i, s := range servers {
		hosts[i] = fmt.Sprintf("127.0.0.1:%d", s.port)
	}
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write",
		strings.Join(hosts, ","), url.PathEscape(dbname))
}

// withConn runs f on a new connection to the server's postgres database.
func (p *Postgres) withConn(timeout time.Duration, f func(ctx context.Context, conn *pgx.Conn) error) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, p.URL("postgres"))
	if err != nil {
		return fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(context.Background())
	return f(ctx, conn)
}

// quoteLiteral quotes a string as an SQL literal, for the statements
// (ALTER SYSTEM) that take no parameters.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
