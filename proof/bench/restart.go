package bench

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"
)

// Restart is the restart case (issue 21): how much WAL a restart decodes
// again, and how long the relay takes to catch up after one under load.
const Restart = "restart"

// RestartRound is one round of "rows committed while the relay is stopped,
// start it, drain, clean stop".
type RestartRound struct {
	Round int `json:"round"`
	// WAL from the slot's restart_lsn to the end when the relay starts:
	// what its walsender decodes in this round. Of it, StartAgainMB lies
	// before the confirmed position: decoded by an earlier session already.
	StartWALMB   float64 `json:"start_wal_mb_from_restart"`
	StartAgainMB float64 `json:"start_wal_mb_restart_to_confirmed"`
	MsgsPerSec   float64 `json:"drain_msgs_per_sec"`
	// WalsenderCPU of the drain's walsender, seconds.
	WalsenderCPU float64 `json:"walsender_cpu_seconds"`
	StopSeconds  float64 `json:"stop_seconds"`
	// WAL from restart_lsn to the end after the clean stop, and from the
	// confirmed position.
	StopWALMB          float64 `json:"stop_wal_mb_from_restart"`
	StopWALConfirmedMB float64 `json:"stop_wal_mb_from_confirmed"`
}

// RestartResult is the restart case's report.
type RestartResult struct {
	Server int            `json:"postgres_major"`
	Rows   int            `json:"rows_per_round"`
	Rounds []RestartRound `json:"rounds"`
	// Under a steady load: the relay stopped cleanly, left stopped for
	// StoppedSeconds, started again; CatchUpSeconds from its start until
	// the newest message in the stream committed less than catchUpLag ago.
	LoadRate          float64 `json:"load_rows_per_sec"`
	LoadStopWALMB     float64 `json:"load_stop_wal_mb_from_restart"`
	LoadStopSeconds   float64 `json:"load_stop_seconds"`
	StoppedSeconds    float64 `json:"stopped_seconds"`
	RestartStartWALMB float64 `json:"load_start_wal_mb_from_restart"`
	CatchUpSeconds    float64 `json:"catch_up_seconds"`
}

const (
	restartRounds  = 3
	catchUpLag     = time.Second
	restartRate    = 2000 // rows/s when -rate is not set
	loadBeforeStop = 10 * time.Second
	stoppedFor     = 5 * time.Second
	// commitTimeHeader is wire.HeaderCommitTime, a header of the message
	// format's contract (docs/design.md), named here so that the benchmark
	// does not import the format's package for one string.
	commitTimeHeader = "Outbox-Commit-Time"
)

func (b *bench) restart(ctx context.Context) (RestartResult, error) {
	res := RestartResult{Server: b.s.pg.Version(), Rows: b.cfg.Rows}
	p, err := b.setup(ctx, CDCBacklog, 0)
	defer b.teardown(p, "", 0)
	if err != nil {
		return res, err
	}
	total := 0
	for round := 1; round <= restartRounds; round++ {
		l := b.newLoad(p, b.cfg.Rows, 0)
		if _, err := l.run(ctx); err != nil {
			return res, err
		}
		p.idBase += b.cfg.Rows
		total += b.cfg.Rows
		rr := RestartRound{Round: round}
		var fromConfirmed float64
		if rr.StartWALMB, fromConfirmed, err = b.s.slotWAL(ctx, p.db, slotName); err != nil {
			return res, err
		}
		rr.StartAgainMB = rr.StartWALMB - fromConfirmed
		t0 := time.Now()
		pr, err := p.start()
		if err != nil {
			return res, err
		}
		wsPID, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
		if err != nil {
			_ = pr.stop()
			return res, err
		}
		_, settled, err := b.waitDrained(ctx, p, total, pr, drainTimeout(b.cfg.Rows))
		if err != nil {
			_ = pr.stop()
			return res, err
		}
		rr.MsgsPerSec = float64(b.cfg.Rows) / settled.Sub(t0).Seconds()
		rr.WalsenderCPU, _ = ProcCPU(wsPID)
		s0 := time.Now()
		if err := pr.stop(); err != nil {
			return res, err
		}
		rr.StopSeconds = time.Since(s0).Seconds()
		if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
			return res, err
		}
		if rr.StopWALMB, rr.StopWALConfirmedMB, err = b.s.slotWAL(ctx, p.db, slotName); err != nil {
			return res, err
		}
		b.cfg.logf("restart round %d: %.1f MB from restart_lsn at start (%.1f MB before the confirmed position), %.0f msg/s, stop %.2fs, %.1f MB from restart_lsn after it",
			round, rr.StartWALMB, rr.StartAgainMB, rr.MsgsPerSec, rr.StopSeconds, rr.StopWALMB)
		res.Rounds = append(res.Rounds, rr)
	}
	return res, b.catchUp(ctx, p, total, &res)
}

// catchUp restarts the relay under a steady load and times how long it
// takes to be within catchUpLag of the producers again.
func (b *bench) catchUp(ctx context.Context, p *path, total int, res *RestartResult) error {
	rate := b.cfg.Rate
	if rate <= 0 {
		rate = restartRate
	}
	res.LoadRate = rate
	seconds := loadBeforeStop + stoppedFor + 30*time.Second
	l := b.newLoad(p, int(rate*seconds.Seconds()), rate)
	pr, err := p.start()
	if err != nil {
		return err
	}
	if _, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
		_ = pr.stop()
		return err
	}
	loadDone := make(chan error, 1)
	var loadEnd atomic.Int64 // unix nanos of the load's last commit, 0 while it runs
	go func() {
		_, err := l.run(ctx)
		loadEnd.Store(time.Now().UnixNano())
		loadDone <- err
	}()
	time.Sleep(loadBeforeStop)
	s0 := time.Now()
	if err := pr.stop(); err != nil {
		return err
	}
	res.LoadStopSeconds = time.Since(s0).Seconds()
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return err
	}
	if res.LoadStopWALMB, _, err = b.s.slotWAL(ctx, p.db, slotName); err != nil {
		return err
	}
	time.Sleep(stoppedFor - time.Since(s0))
	res.StoppedSeconds = time.Since(s0).Seconds()
	if res.RestartStartWALMB, _, err = b.s.slotWAL(ctx, p.db, slotName); err != nil {
		return err
	}
	t0 := time.Now()
	if pr, err = p.start(); err != nil {
		return err
	}
	defer pr.stop() //nolint:errcheck // stopped below; this covers the error paths
	st, err := b.s.js.Stream(ctx, p.stream)
	if err != nil {
		return err
	}
	for {
		if pr.exited() {
			return fmt.Errorf("relay exited: %v (log %s)", pr.err, pr.log)
		}
		if time.Since(t0) > 5*time.Minute {
			return fmt.Errorf("relay not within %v of the load 5 minutes after its restart", catchUpLag)
		}
		info, err := st.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.LastSeq > 0 {
			m, err := st.GetMsg(ctx, info.State.LastSeq)
			if err != nil {
				return err
			}
			// Behind the producers' newest commit, or their last one once
			// the load is over.
			newest := time.Now()
			if e := loadEnd.Load(); e != 0 {
				newest = time.Unix(0, e)
			}
			if ct, err := time.Parse(time.RFC3339Nano, m.Header.Get(commitTimeHeader)); err == nil && newest.Sub(ct) < catchUpLag {
				break
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	res.CatchUpSeconds = time.Since(t0).Seconds()
	b.cfg.logf("restart under %.0f rows/s: stop %.2fs, %.1f MB from restart_lsn after it, %.1f MB at restart; within %v of the load %.2fs after the restart",
		rate, res.LoadStopSeconds, res.LoadStopWALMB, res.RestartStartWALMB, catchUpLag, res.CatchUpSeconds)
	if err := <-loadDone; err != nil {
		return err
	}
	if _, _, err := b.waitDrained(ctx, p, total+l.rows, pr, drainTimeout(l.rows)); err != nil {
		return err
	}
	return pr.stop()
}

// renderRestart is the restart case's table.
func renderRestart(r *RestartResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nrestart (PostgreSQL %d, %d rows committed while stopped, per round)\n\n", r.Server, r.Rows)
	sb.WriteString("| round | MB from restart_lsn at start | of it before confirmed (decoded again) | drain msg/s | walsender CPU s | stop s | MB from restart_lsn after stop | from confirmed |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n")
	for _, x := range r.Rounds {
		fmt.Fprintf(&sb, "| %d | %.1f | %.1f | %.0f | %.2f | %.2f | %.1f | %.1f |\n", x.Round, x.StartWALMB, x.StartAgainMB, x.MsgsPerSec, x.WalsenderCPU, x.StopSeconds, x.StopWALMB, x.StopWALConfirmedMB)
	}
	fmt.Fprintf(&sb, "\nunder %.0f rows/s: clean stop %.2f s, %.1f MB from restart_lsn after it; restarted after %.1f s with %.1f MB from restart_lsn; within %v of the load %.2f s after the restart\n",
		r.LoadRate, r.LoadStopSeconds, r.LoadStopWALMB, r.StoppedSeconds, r.RestartStartWALMB, catchUpLag, r.CatchUpSeconds)
	return sb.String()
}
