package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
)

// activeRelay is the instance whose walsender streams the slot, with that
// walsender's pid; when none does (between sessions) it is the primary
// with pid 0.
func (r *runner) activeRelay(ctx context.Context) (*relayInst, int32, error) {
	s, err := r.readSlot(ctx)
	if err != nil {
		return nil, 0, err
	}
	for _, ri := range r.relays {
		if s.pid != 0 && s.app == ri.appName {
			return ri, s.pid, nil
		}
	}
	return r.relays[r.primary], 0, nil
}

// count records an injection of kind, starting now: its window (for the
// figures counted by fault) starts at this moment and WAL position.
func (r *runner) count(kind string) {
	w := FaultWindow{Kind: kind, Start: time.Now()}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var lsn string
	if c, err := pgx.Connect(ctx, r.db()); err == nil {
		if c.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn) == nil {
			w.StartLSN, _ = pglogrepl.ParseLSN(lsn)
		}
		c.Close(context.Background())
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	w.N = r.faultN
	if w.StartLSN == 0 && len(r.windows) > 0 {
		// Not reachable (a restart under way): the previous window's
		// position is a lower bound.
		w.StartLSN = r.windows[len(r.windows)-1].StartLSN
	}
	r.windows = append(r.windows, w)
	r.report.Faults[kind]++
}

// bit records that an injection of kind did what FaultBite says.
func (r *runner) bit(kind string) {
	r.mu.Lock()
	r.report.FaultsBit[kind]++
	r.mu.Unlock()
}

func (r *runner) skip(kind, why string) {
	r.mu.Lock()
	r.report.FaultsSkipped[kind]++
	r.report.FaultsSkipReason[kind] = why
	r.mu.Unlock()
	r.logf("fault %s skipped: %s", kind, why)
}

// inject applies one fault and heals it before returning: faults never
// overlap, so every observation (a G3 check, a takeover time) has one
// cause. An error means the run cannot go on (a server will not start
// again), not that the relay misbehaved: that is measured, not returned.
func (r *runner) inject(ctx context.Context, kind string, n int) error {
	hold := r.between(time.Second, r.cfg.MaxHold)
	label := fmt.Sprintf("#%d %s", n, kind)
	r.mu.Lock()
	r.faultN = n
	r.mu.Unlock()
	if why := r.cfg.notApplicable(kind); why != "" {
		r.mu.Lock()
		r.report.FaultsNotApplicable[kind] = why
		r.mu.Unlock()
		r.skip(kind, "not applicable: "+why)
		return nil
	}
	switch kind {
	case FaultNATSLoseTail:
		return r.loseTail(ctx, kind, label)

	case FaultRelayKillLong:
		return r.killLong(ctx, kind, label)

	case FaultRelayKill:
		ri, pid, err := r.activeRelay(ctx)
		if err != nil {
			return err
		}
		if !ri.running() {
			r.skip(kind, "relay not running")
			return nil
		}
		if err := ri.kill(); err != nil {
			return err
		}
		r.count(kind)
		if pid != 0 {
			r.bit(kind)
		}
		r.logf("fault %s: SIGKILL relay %s (walsender %d; bit: %v)", label, ri.name, pid, pid != 0)
		if err := r.g3Check(ctx, label, pid); err != nil {
			return err
		}
		r.pause(ctx, r.between(0, 2*time.Second))
		return ri.start()

	case FaultNATSNodeKill:
		return r.nodeKill(ctx, kind, label, hold)

	case FaultNATSKill:
		if r.cl != nil {
			return r.nodeKill(ctx, kind, label, hold)
		}
		ri, pid, err := r.activeRelay(ctx)
		if err != nil {
			return err
		}
		conns := ri.nsProxy.Conns()
		if err := r.ns.Kill(); err != nil {
			return err
		}
		r.count(kind)
		if pid != 0 && conns > 0 {
			r.bit(kind)
		}
		r.logf("fault %s: SIGKILL nats-server for %v (relay %s streaming: %v, %d connections to it)", label, hold, ri.name, pid != 0, conns)
		r.pause(ctx, hold)
		return r.ns.Start()

	case FaultPGRestartFast, FaultPGRestartImmed:
		mode := "fast"
		if kind == FaultPGRestartImmed {
			mode = "immediate"
		}
		s, err := r.readSlot(ctx)
		if err != nil {
			return err
		}
		r.count(kind)
		if s.pid != 0 {
			// A restart ends every session: the walsender streaming
			// the slot at that moment goes with it.
			r.bit(kind)
		}
		r.logf("fault %s: PostgreSQL restart -m %s (walsender %d streamed the slot)", label, mode, s.pid)
		return r.pg.Restart(mode)

	case FaultPGTermWalsender, FaultPGTermConns:
		backend := "walsender"
		if kind == FaultPGTermConns {
			backend = "client backend"
		}
		var pids []int32
		err := r.withDB(ctx, func(c *pgx.Conn) error {
			rows, err := c.Query(ctx, `SELECT pid FROM pg_stat_activity
				WHERE backend_type = $1 AND application_name LIKE 'chaos-relay-%' AND pg_terminate_backend(pid)`, backend)
			if err != nil {
				return err
			}
			pids, err = pgx.CollectRows(rows, pgx.RowTo[int32])
			return err
		})
		if err != nil {
			return fmt.Errorf("pg_terminate_backend: %w", err)
		}
		if len(pids) == 0 {
			r.skip(kind, "no "+backend+" of a relay found")
			return nil
		}
		r.count(kind)
		r.bit(kind)
		r.logf("fault %s: pg_terminate_backend of the relay's %s pids %v", label, backend, pids)
		return nil

	case FaultNATSCut, FaultPGCut, FaultNATSLatency, FaultPGLatency:
		ri, _, err := r.activeRelay(ctx)
		if err != nil {
			return err
		}
		p := ri.nsProxy
		if kind == FaultPGCut || kind == FaultPGLatency {
			p = ri.pgProxy
		}
		mode, delay := Cut, time.Duration(0)
		if kind == FaultNATSLatency || kind == FaultPGLatency {
			mode, delay = Latency, time.Duration(20+r.rng.IntN(280))*time.Millisecond
			hold = r.between(2*time.Second, 2*r.cfg.MaxHold)
		}
		r.count(kind)
		r.logf("fault %s: relay %s proxy %s (delay %v) for %v", label, ri.name, mode, delay, hold)
		conns, delayed := p.Conns(), p.Delayed()
		p.Set(mode, delay)
		r.pause(ctx, hold)
		delayed = p.Delayed() - delayed
		p.Set(Pass, 0)
		if (mode == Cut && conns > 0) || (mode == Latency && delayed > 0) {
			r.bit(kind)
		}
		r.logf("fault %s healed: %d connections open at the start, %d chunks delayed", label, conns, delayed)
		return nil

	case FaultTakeoverKill, FaultTakeoverPartition:
		return r.takeoverFault(ctx, kind, label)

	case FaultPGFailover:
		return r.failoverFault(ctx, kind, label)

	case FaultBrokerSlow:
		return r.brokerSlow(ctx, kind, label)

	case FaultRelayPaused:
		return r.relayPaused(ctx, kind, label)

	case FaultPollerKilled:
		return r.pollerKilled(ctx, kind, label)

	case FaultConsumerLimit:
		return r.consumerLimit(ctx, kind, label)

	case FaultPGClockShifted:
		return r.clockShifted(ctx, kind, label)
	}
	return fmt.Errorf("unknown fault %q", kind)
}

// takeoverFault runs the standby beside the active relay, then kills the
// active one or cuts it off from both servers without closing anything (a
// partition), and measures until the standby's walsender holds the slot.
// After a SIGKILL the walsender exits at once; after a partition it holds
// the slot until wal_sender_timeout passes without a reply.
func (r *runner) takeoverFault(ctx context.Context, kind, label string) error {
	var act *relayInst
	var pid int32
	deadline := time.Now().Add(10 * time.Second)
	for {
		var err error
		if act, pid, err = r.activeRelay(ctx); err != nil {
			return err
		}
		if pid != 0 {
			break
		}
		if time.Now().After(deadline) {
			r.skip(kind, "no relay streams the slot")
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	other, otherIdx := r.relays[0], 0
	if other == act {
		other, otherIdx = r.relays[1], 1
	}
	if err := other.start(); err != nil {
		return err
	}
	// Long enough for the standby to be past its start-up checks and
	// retrying START_REPLICATION.
	r.pause(ctx, r.between(2*time.Second, 4*time.Second))
	r.count(kind)
	cause := "sigkill"
	t0 := time.Now()
	if kind == FaultTakeoverKill {
		if err := act.kill(); err != nil {
			return err
		}
	} else {
		cause = "partition"
		act.pgProxy.Set(Blackhole, 0)
		act.nsProxy.Set(Blackhole, 0)
	}
	limit := time.Minute + r.cfg.WalSenderTimeout
	ok := false
	for time.Since(t0) < limit && ctx.Err() == nil {
		s, err := r.readSlot(ctx)
		if err != nil {
			return err
		}
		if s.pid != 0 && s.app == other.appName {
			ok = true
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	took := time.Since(t0)
	r.mu.Lock()
	r.takeover = append(r.takeover, Takeover{Cause: cause, Seconds: took.Seconds(), OK: ok})
	r.mu.Unlock()
	if ok {
		r.bit(kind)
	}
	r.logf("fault %s: relay %s -> %s took over after %.2fs (ok %v)", label, act.name, other.name, took.Seconds(), ok)
	if kind == FaultTakeoverKill {
		if err := r.g3Check(ctx, label, pid); err != nil {
			return err
		}
		if err := act.start(); err != nil {
			return err
		}
	} else {
		act.pgProxy.Set(Pass, 0)
		act.nsProxy.Set(Pass, 0)
	}
	// The old active one comes back as a standby for a while, then leaves
	// with SIGTERM; the new one runs on alone.
	r.pause(ctx, r.between(time.Second, 3*time.Second))
	if err := act.stop(15 * time.Second); err != nil {
		r.logf("%v", err)
	}
	if ok {
		r.primary = otherIdx
	} else {
		// Without a takeover the run continues with the instance that is
		// still there.
		if err := act.start(); err != nil {
			return err
		}
	}
	return nil
}

// loseTailKeep is the share of the newest message block nats-lose-tail
// keeps.
const loseTailKeep = 0.6

// loseTail is nats-lose-tail: JetStream losing writes it acknowledged and
// had not synced (G19). The server stops, the newest block of the stream's
// store is cut and its index files removed, and the server starts again on
// the same port and store with a stream that ends below sequences it
// acknowledged. The relay must find the rows recorded published past the
// new end and publish them again; the checker forgets the lost messages
// (their sequences are handed out again) so that only the republished
// copies can count them stored.
func (r *runner) loseTail(ctx context.Context, kind, label string) error {
	before, err := r.streamLastSeq(ctx)
	if err != nil {
		return err
	}
	if before == 0 {
		r.skip(kind, "the stream is empty")
		return nil
	}
	// The checker holds every message up to before, so it knows which
	// ones the cut takes away.
	if err := r.catchUpStream(ctx, before); err != nil {
		return err
	}
	if err := r.ns.Stop(); err != nil {
		return err
	}
	r.count(kind)
	cut, cutErr := r.ns.CutStreamTail(streamName, loseTailKeep)
	if err := r.ns.Start(); err != nil {
		return err
	}
	if cutErr != nil {
		return cutErr
	}
	after, err := r.streamLastSeq(ctx)
	if err != nil {
		return err
	}
	var gone []string
	r.streamMu.Lock()
	if after < r.ledger.LastSeq() {
		gone = r.ledger.LoseTail(after)
	}
	r.streamMu.Unlock()
	bit := after < before
	if bit {
		r.bit(kind)
	}
	r.logf("fault %s: nats-server stopped, %s cut from %d to %d bytes (removed %v), started: stream last seq %d -> %d, %d stored rows lost (bit: %v)",
		label, cut.Block, cut.Before, cut.Kept, cut.Removed, before, after, len(gone), bit)
	if len(gone) == 0 {
		return nil
	}
	// Until the relay hands the lost rows back, a G3 check would find them
	// 'published' and missing: that is the broker's loss, which the relay
	// repairs, not the relay's. The next faults wait for the repair.
	t0 := time.Now()
	limit := time.Minute
	for {
		last, err := r.streamLastSeq(ctx)
		if err != nil {
			return err
		}
		if err := r.catchUpStream(ctx, last); err != nil {
			return err
		}
		var missing []string
		for _, id := range gone {
			if !r.ledger.Stored(id) {
				missing = append(missing, id)
			}
		}
		// A lost row whose deadline passed meanwhile is expired, not
		// published again (G13 before G19): settled all the same.
		var expired int
		if len(missing) > 0 {
			if err := r.withDB(ctx, func(c *pgx.Conn) error {
				return c.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = ANY($1) AND state = 'expired'`, missing).Scan(&expired)
			}); err != nil {
				return err
			}
		}
		if len(missing) == expired {
			r.logf("fault %s: all %d lost rows settled after %.2fs: %d stored again, %d expired (their deadline passed first)", label, len(gone), time.Since(t0).Seconds(), len(gone)-expired, expired)
			return nil
		}
		if time.Since(t0) > limit || ctx.Err() != nil {
			// Not an error of the run: the end figures count them lost.
			r.logf("fault %s: %d of %d lost rows still not stored again after %v (%d more expired)", label, len(missing)-expired, len(gone), limit, expired)
			return nil
		}
		r.pause(ctx, 200*time.Millisecond)
	}
}

// killLong is relay-kill-long: SIGKILL of the streaming relay under load,
// which stays down for several duplicate windows before it starts again.
// The replay then repeats rows the stream stored so long ago that the
// broker no longer drops the repeats; the relay's read-back (G18) must
// find them. It bites when the relay was down longer than the window and
// its restart's read-back found replayed rows already stored.
func (r *runner) killLong(ctx context.Context, kind, label string) error {
	ri, pid, err := r.activeRelay(ctx)
	if err != nil {
		return err
	}
	if !ri.running() {
		r.skip(kind, "relay not running")
		return nil
	}
	w := r.cfg.DuplicateWindow
	down := 3*w + r.between(0, w)
	if err := ri.kill(); err != nil {
		return err
	}
	t0 := time.Now()
	r.count(kind)
	r.logf("fault %s: SIGKILL relay %s (walsender %d), down for %v (duplicate window %v)", label, ri.name, pid, down, w)
	if err := r.g3Check(ctx, label, pid); err != nil {
		return err
	}
	r.pause(ctx, down-time.Since(t0))
	offset := logSize(ri.logPath)
	took := time.Since(t0)
	if err := ri.start(); err != nil {
		return err
	}
	rb, ok := waitReadBack(ctx, ri.logPath, offset, 30*time.Second)
	bit := ok && took > w && rb.Stored > 0
	if bit {
		r.bit(kind)
	}
	r.logf("fault %s: relay %s started again after %.2fs down; its read-back (seen: %v) read %d messages and found %d replayed rows stored (bit: %v)",
		label, ri.name, took.Seconds(), ok, rb.Read, rb.Stored, bit)
	return nil
}

func logSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// readBackLine is the relay's log line of a session start's read-back
// (internal/relay/readback.go).
type readBackLine struct {
	Message  string    `json:"message"`
	Read     int       `json:"read"`
	Stored   int       `json:"stored"`
	AfterSeq *uint64   `json:"after_seq"`
	Since    string    `json:"since"`
	Time     time.Time `json:"time"`
	Took     float64   `json:"took"` // milliseconds
}

// started is when the read began (the relay's clock: this host's).
func (l readBackLine) started() time.Time {
	return l.Time.Add(-time.Duration(l.Took * float64(time.Millisecond)))
}

// from says where the read started: a stream position, or a time (the
// fallback that trusts the clocks to agree).
func (l readBackLine) from() string {
	switch {
	case l.AfterSeq != nil:
		return fmt.Sprintf("from position %d", *l.AfterSeq)
	case l.Since != "":
		return "BY TIME since " + l.Since
	}
	return "from an unknown start"
}

// waitReadBack waits for the first read-back line the relay logs after
// offset in its log.
func waitReadBack(ctx context.Context, path string, offset int64, timeout time.Duration) (readBackLine, bool) {
	deadline := time.Now().Add(timeout)
	for ctx.Err() == nil && time.Now().Before(deadline) {
		if l, ok := findReadBack(path, offset); ok {
			return l, true
		}
		time.Sleep(100 * time.Millisecond)
	}
	return readBackLine{}, false
}

func findReadBack(path string, offset int64) (readBackLine, bool) {
	f, err := os.Open(path)
	if err != nil {
		return readBackLine{}, false
	}
	defer f.Close()
	if _, err := f.Seek(offset, 0); err != nil {
		return readBackLine{}, false
	}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), "the stream back") {
			continue
		}
		// Only a read that ended: "could not read the stream back ..." is
		// an attempt that failed.
		var l readBackLine
		if json.Unmarshal(line, &l) == nil && strings.HasPrefix(l.Message, "read the stream back") {
			return l, true
		}
	}
	return readBackLine{}, false
}
