package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"runtime/trace"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

// IdleResult is what the relay does with no outbox traffic, its poller
// paused (--poll-interval 1h) and table metrics off (--stats-interval 0).
type IdleResult struct {
	Seconds float64 `json:"seconds"`
	// Transactions committed or rolled back in the relay's database over the
	// window (pg_stat_database; the window includes 11 s for backends to
	// flush their counters).
	Xacts int64 `json:"xacts"`
	// Backends of the relay (by application_name) whose state changed in the
	// window: any query moves state_change.
	BackendsActive int     `json:"backends_with_activity"`
	Backends       int     `json:"backends"`
	RelayCPU       float64 `json:"relay_cpu_seconds"`
	WalsenderCPU   float64 `json:"walsender_cpu_seconds"`
}

type activity map[int32]time.Time

func (b *bench) activity(ctx context.Context, db string) (activity, int64, error) {
	rows, err := b.s.admin.Query(ctx, `SELECT pid, coalesce(state_change, backend_start) FROM pg_stat_activity
		WHERE datname = $1 AND application_name = $2`, db, relayAppName)
	if err != nil {
		return nil, 0, err
	}
	a := activity{}
	for rows.Next() {
		var pid int32
		var t time.Time
		if err := rows.Scan(&pid, &t); err != nil {
			return nil, 0, err
		}
		a[pid] = t
	}
	if err := rows.Err(); err != nil {
		return nil, 0, err
	}
	var x int64
	err = b.s.admin.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = $1`, db).Scan(&x)
	return a, x, err
}

func (b *bench) idle(ctx context.Context) (IdleResult, error) {
	var ir IdleResult
	p, err := b.setup(ctx, CDCLive, 0)
	defer b.teardown(p, "", 0)
	if err != nil {
		return ir, err
	}
	// Autovacuum would analyze the table after the warm-up rows below and
	// count as transactions in the relay's database.
	if err := execIn(ctx, p.url, `ALTER TABLE outbox SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)`); err != nil {
		return ir, err
	}
	args := b.relayArgs(p, time.Hour)
	pr, err := startProc("relay", filepath.Join(b.dir, "idle.log"), b.cfg.RelayBin, args...)
	if err != nil {
		return ir, err
	}
	defer pr.stop() //nolint:errcheck // stopped below; this covers the error paths
	wsPID, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
	if err != nil {
		return ir, err
	}
	// Some traffic first, so the idle time follows real work.
	l := b.newLoad(p, 1000, 0)
	if _, err := l.run(ctx); err != nil {
		return ir, err
	}
	if _, _, err := b.waitDrained(ctx, p, 1000, pr, time.Minute); err != nil {
		return ir, err
	}
	time.Sleep(11 * time.Second) // counters of the work above reach pg_stat_database
	a0, x0, err := b.activity(ctx, p.db)
	if err != nil {
		return ir, err
	}
	relayCPU := newCPUMeter(pidCPU(pr.pid()))
	wsCPU := newCPUMeter(pidCPU(wsPID))
	win := time.Duration(b.cfg.IdleSeconds*float64(time.Second)) + 11*time.Second
	time.Sleep(win)
	a1, x1, err := b.activity(ctx, p.db)
	if err != nil {
		return ir, err
	}
	ir.Seconds, ir.Xacts, ir.Backends = win.Seconds(), x1-x0, len(a1)
	for pid, t := range a1 {
		if t0, ok := a0[pid]; !ok || !t0.Equal(t) {
			ir.BackendsActive++
		}
	}
	ir.RelayCPU, ir.WalsenderCPU = relayCPU.delta(), wsCPU.delta()
	return ir, pr.stop()
}

func rusageCPU() (float64, error) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0, err
	}
	tv := func(t syscall.Timeval) float64 { return float64(t.Sec) + float64(t.Usec)/1e6 }
	return tv(ru.Utime) + tv(ru.Stime), nil
}

// profiledBacklog is the CDC backlog case with the relay running inside
// this process (app.Run, as `outbox-relay run` does) under the CPU profiler;
// its CPU is this process's rusage delta, which also holds the benchmark's
// own polling of the stream and the table during the drain.
func (b *bench) profiledBacklog(ctx context.Context) (Result, error) {
	r := Result{Case: "cdc-backlog-inprocess"}
	p, err := b.setup(ctx, CDCBacklog, 99)
	defer b.teardown(p, "", 0)
	if err != nil {
		return r, err
	}
	l := b.newLoad(p, b.cfg.Rows, 0)
	el, err := l.run(ctx)
	if err != nil {
		return r, err
	}
	r.Rows, r.InsertRate = l.rows, float64(l.rows)/el.Seconds()
	logf, err := os.Create(filepath.Join(b.dir, "inprocess.log"))
	if err != nil {
		return r, err
	}
	defer logf.Close()
	o := b.appOptions(p)
	f, err := os.Create(b.cfg.CPUProfile)
	if err != nil {
		return r, err
	}
	defer f.Close()
	cpu0, _ := rusageCPU()
	if err := pprof.StartCPUProfile(f); err != nil {
		return r, err
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	t0 := time.Now()
	go func() { done <- app.Run(rctx, o, zerolog.New(logf).Level(zerolog.WarnLevel)) }()
	var heapErr error
	onAcked := func() {
		// Every message acked, marks still to come: the relay holds the
		// most here.
		if b.cfg.MemProfile == "" {
			return
		}
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		r.Extra = map[string]float64{"heap_inuse_mb_at_ack": float64(ms.HeapInuse) / (1 << 20), "heap_sys_mb_at_ack": float64(ms.HeapSys) / (1 << 20)}
		hf, err := os.Create(b.cfg.MemProfile)
		if err != nil {
			heapErr = err
			return
		}
		defer hf.Close()
		heapErr = pprof.Lookup("heap").WriteTo(hf, 0)
	}
	acked, settled, err := b.waitDrainedThen(ctx, p, l.rows, nil, drainTimeout(l.rows), onAcked)
	if err == nil {
		err = heapErr
	}
	cpu1, _ := rusageCPU()
	pprof.StopCPUProfile()
	cancel()
	if rerr := <-done; rerr != nil && err == nil {
		err = fmt.Errorf("relay: %w", rerr)
	}
	if err != nil {
		return r, err
	}
	r.Seconds = settled.Sub(t0).Seconds()
	r.MsgsPerSec = float64(l.rows) / r.Seconds
	r.PubCPUSeconds = cpu1 - cpu0
	r.PubCPUPerMsgUS = r.PubCPUSeconds / float64(l.rows) * 1e6
	if r.Extra == nil {
		r.Extra = map[string]float64{}
	}
	r.Extra["acked_seconds"] = acked.Sub(t0).Seconds()
	return r, nil
}

func execIn(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// appOptions are the defaults of `outbox-relay run` with the bench's names.
func (b *bench) appOptions(p *path) app.Options {
	tbl, _ := store.ParseTable("outbox")
	pol, _ := store.ParsePolicy(b.cfg.Policy)
	return app.Options{
		DatabaseURL: b.relayURL(p.url), NATSURL: b.s.nats.URL(), Table: tbl, Slot: slotName, Publication: "outbox_relay",
		Stream: p.stream, SubjectPrefix: p.prefix, Policy: pol,
		DuplicateWindow: 2 * time.Minute, StreamReplicas: 1, AckTimeout: 10 * time.Second,
		MaxInFlight: 1024, MaxInFlightBytes: 4 << 20, StatusInterval: 2 * time.Second, DrainTimeout: 10 * time.Second,
		AppName: relayAppName, WorkerID: "bench", PollInterval: time.Second,
	}
}

// profiledLive is the CDC live case with the relay in this process under
// the CPU profiler. The profile also holds the producers and the consumer;
// look at the relay's packages in it (pprof -focus).
func (b *bench) profiledLive(ctx context.Context) (Result, error) {
	r := Result{Case: "cdc-live-inprocess"}
	p, err := b.setup(ctx, CDCLive, 99)
	defer b.teardown(p, "", 0)
	if err != nil {
		return r, err
	}
	logf, err := os.Create(filepath.Join(b.dir, "inprocess.log"))
	if err != nil {
		return r, err
	}
	defer logf.Close()
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx, b.appOptions(p), zerolog.New(logf).Level(zerolog.WarnLevel)) }()
	if _, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second); err != nil {
		return r, err
	}
	n := b.cfg.liveRows()
	l := b.newLoad(p, n, b.cfg.Rate)
	col, err := collect(ctx, b.s.js, p.stream, l.base, n, 0)
	if err != nil {
		return r, err
	}
	f, err := os.Create(b.cfg.CPUProfile)
	if err != nil {
		return r, err
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return r, err
	}
	if b.cfg.Trace != "" {
		tf, err := os.Create(b.cfg.Trace)
		if err != nil {
			return r, err
		}
		defer tf.Close()
		if err := trace.Start(tf); err != nil {
			return r, err
		}
		defer trace.Stop()
	}
	el, err := l.run(ctx)
	if err == nil {
		err = col.wait(ctx, drainTimeout(n))
	}
	trace.Stop()
	pprof.StopCPUProfile()
	if err != nil {
		return r, err
	}
	cancel()
	if rerr := <-done; rerr != nil {
		return r, fmt.Errorf("relay: %w", rerr)
	}
	_, last := firstLast(col.recvNs)
	r.Rows, r.InsertRate = n, float64(n)/el.Seconds()
	r.Seconds = time.Duration(last).Seconds()
	r.MsgsPerSec = float64(n) / r.Seconds
	sum := Summarize(latencies(l.commitNs, col.recvNs))
	r.Latency = &sum
	return r, nil
}
