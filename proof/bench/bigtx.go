package bench

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// BigTx is the case of one very large transaction (G15): one INSERT ...
// SELECT generate_series of -bigtx-rows rows committed while the relay is
// stopped, then relayed by the relay binary without and with
// --standby-slot naming the physical slot of a real streaming standby;
// and the same for -bigtx-large-rows rows of -bigtx-large-payload bytes.
// It reports the relay's peak RSS (VmHWM), the drain time and rate, whether
// the walsender was ever dropped (wal_sender_timeout) and the stream's
// message count, which must equal the rows.
const BigTx = "bigtx"

// BigTxConfig is the bigtx case's workload.
type BigTxConfig struct {
	Rows         int
	Payload      int
	LargeRows    int
	LargePayload int
}

// Flags registers the bigtx flags on fs.
func (c *BigTxConfig) Flags(fs *flag.FlagSet) {
	fs.IntVar(&c.Rows, "bigtx-rows", 10_000_000, "bigtx: rows in the one large transaction")
	fs.IntVar(&c.Payload, "bigtx-payload", 200, "bigtx: payload bytes of those rows")
	fs.IntVar(&c.LargeRows, "bigtx-large-rows", 2000, "bigtx: rows in the transaction of large rows (0: skip it)")
	fs.IntVar(&c.LargePayload, "bigtx-large-payload", 900<<10, "bigtx: payload bytes of the large rows")
}

// bigTxStandbySlot is the physical slot of the bench's streaming standby.
const bigTxStandbySlot = "bigtx_standby"

// bigTx runs the bigtx variants and prints their table.
func (b *bench) bigTx(ctx context.Context, rep *Report) error {
	c := b.cfg.BigTx
	if c.Rows < 1 || c.Payload < 16 {
		return fmt.Errorf("-bigtx-rows must be positive and -bigtx-payload at least 16")
	}
	// A real standby: it starts once, before any relay runs (the primary
	// restarts for the copy), and streams all the cases' WAL.
	b.cfg.logf("bigtx: starting a streaming standby (slot %s)", bigTxStandbySlot)
	sb, err := b.s.pg.StartStandby(testenv.StandbyOptions{Slot: bigTxStandbySlot})
	if err != nil {
		return fmt.Errorf("start the standby: %w", err)
	}
	defer sb.Close()
	_ = b.s.admin.Close(context.Background())
	if b.s.admin, err = pgx.Connect(ctx, b.s.pg.URL("postgres")); err != nil {
		return fmt.Errorf("reconnect to postgres after the standby's copy: %w", err)
	}
	type variant struct {
		name          string
		rows, payload int
		gated         bool
	}
	vs := []variant{
		{BigTx, c.Rows, c.Payload, false},
		{BigTx + "-standby", c.Rows, c.Payload, true},
	}
	if c.LargeRows > 0 {
		vs = append(vs, variant{BigTx + "-large", c.LargeRows, c.LargePayload, false},
			variant{BigTx + "-large-standby", c.LargeRows, c.LargePayload, true})
	}
	var rows [][]string
	for _, v := range vs {
		b.cfg.logf("%s: %d rows of %d B in one transaction, --standby-slot %v", v.name, v.rows, v.payload, v.gated)
		r, err := b.bigTxRun(ctx, v.name, v.rows, v.payload, v.gated)
		if err != nil {
			return fmt.Errorf("%s: %w", v.name, err)
		}
		b.cfg.logf("%s: drained in %.1fs (%.0f rows/s), relay peak RSS %.1f MB, stream %.0f messages, walsender drops %.0f",
			v.name, r.Seconds, r.MsgsPerSec, r.PubPeakRSSMB, r.Extra["stream_msgs"], r.Extra["walsender_drops"])
		rep.Results = append(rep.Results, r.Result)
		rows = append(rows, []string{v.name, fmt.Sprint(v.rows), fmt.Sprint(v.payload), num(r.Extra["insert_seconds"]),
			num(r.Seconds), num(r.MsgsPerSec), num(r.PubPeakRSSMB), num(r.PubCPUSeconds), num(r.WalsenderCPU),
			fmt.Sprintf("%.0f", r.Extra["stream_msgs"]), fmt.Sprintf("%.0f", r.Extra["walsender_drops"]), r.load})
	}
	fmt.Fprintf(b.cfg.Out, "\nbigtx: one transaction relayed by the relay binary (peak RSS is VmHWM; walsender drops: sessions ended or walsenders replaced during the drain)\n\n%s",
		FormatTable([]string{"case", "rows", "payload B", "insert s", "drain s", "rows/s", "relay peak RSS MB", "relay CPU s",
			"walsender CPU s", "stream msgs", "walsender drops", "load (1/5/15 min) at start, end"}, rows))
	return nil
}

// bigTxResult is a Result with the load next to it.
type bigTxResult struct {
	Result
	load string
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// bigTxRun runs one variant on a fresh database and stream, dropped after.
func (b *bench) bigTxRun(ctx context.Context, name string, rows, payload int, gated bool) (bigTxResult, error) {
	r := bigTxResult{Result: Result{Case: name, Rows: rows, Extra: map[string]float64{}}}
	flat := strings.ReplaceAll(name, "-", "_")
	p := &path{kind: "cdc", db: flat, stream: strings.ToUpper(flat), prefix: flat + ".", table: "outbox"}
	url, err := b.s.createDB(ctx, p.db)
	if err != nil {
		return r, err
	}
	p.url = url
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		if err := b.s.dropDB(cctx, p.db); err != nil {
			fmt.Fprintf(os.Stderr, "outbox-bench: %v\n", err)
		}
		b.s.deleteStream(cctx, p.stream)
		// Let the server recycle the case's WAL before the next one.
		_, _ = b.s.admin.Exec(cctx, "CHECKPOINT")
	}()
	if err := b.migrate(url); err != nil {
		return r, err
	}
	args := b.relayArgs(p, time.Second)
	if gated {
		args = append(args, "--standby-slot", bigTxStandbySlot)
	}
	logPath := filepath.Join(b.dir, flat+".log")
	start := func() (*proc, error) { return startProcEnv("relay", logPath, b.cfg.RelayBin, b.cfg.RelayEnv, args...) }
	// The slot and the stream exist before the rows (rows committed before
	// the slot would go to the poller, G9).
	pr, err := start()
	if err != nil {
		return r, err
	}
	_, werr := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
	for werr == nil {
		if _, err := b.s.js.Stream(ctx, p.stream); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := pr.stop(); err != nil || werr != nil {
		return r, fmt.Errorf("create the slot and the stream: %w %v", werr, err)
	}
	if err := b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second); err != nil {
		return r, err
	}

	insertStart := time.Now()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return r, err
	}
	var end string
	_, err = conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload)
		SELECT 'm' || g, 'bench', $1::jsonb FROM generate_series(1, $2::int) g`, makePayload(payload), rows)
	if err == nil {
		err = conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&end)
	}
	conn.Close(context.Background())
	if err != nil {
		return r, fmt.Errorf("insert %d rows: %w", rows, err)
	}
	r.Extra["insert_seconds"] = time.Since(insertStart).Seconds()
	if gated {
		// The standby has the transaction before the relay starts: the
		// case measures what the gate costs, not the standby's lag.
		if err := b.waitStandbyFlushed(ctx, end, 10*time.Minute); err != nil {
			return r, err
		}
	}
	drops0, err := countInFile(b.s.pg.LogPath(), "replication timeout")
	if err != nil {
		return r, err
	}

	load0 := loadAvg()
	machine := newCPUMeter(MachineBusy)
	natsCPU := newCPUMeter(pidCPU(b.s.nats.PID()))
	began := time.Now()
	if pr, err = start(); err != nil {
		return r, err
	}
	defer pr.stop() //nolint:errcheck // stopped below; this covers the error paths
	wsPID, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
	if err != nil {
		return r, err
	}
	// The walsender decodes the whole transaction (spilled to disk past
	// logical_decoding_work_mem) before it sends the first row: allow for
	// a slow disk, not only for the row count.
	timeout := max(drainTimeout(rows), time.Duration(int64(rows)*int64(payload)/(1<<20))*time.Second)
	if err := b.waitBigTxDrained(ctx, p, rows, end, pr, timeout); err != nil {
		return r, err
	}
	r.Seconds = time.Since(began).Seconds()
	r.MsgsPerSec = float64(rows) / r.Seconds
	var cpu float64
	if cpu, r.PubPeakRSSMB, err = pr.usage(); err != nil {
		return r, err
	}
	r.PubCPUSeconds = cpu
	r.PubCPUPerMsgUS = cpu / float64(rows) * 1e6
	r.WalsenderCPU, _ = ProcCPU(wsPID)
	r.NATSCPU, r.MachineBusy = natsCPU.delta(), machine.delta()
	// Every row once: the stream's count (the broker dropped any repeat
	// by its Nats-Msg-Id, so a count of rows means none was lost).
	msgs, err := b.s.streamMsgs(ctx, p.stream)
	if err != nil {
		return r, err
	}
	r.Extra["stream_msgs"] = float64(msgs)
	// A walsender dropped by wal_sender_timeout shows in the server's log,
	// in the relay's (a session ended), and as a new walsender pid.
	drops1, err := countInFile(b.s.pg.LogPath(), "replication timeout")
	if err != nil {
		return r, err
	}
	sessions, err := countInFile(logPath, "replication session ended")
	if err != nil {
		return r, err
	}
	drops := float64(drops1 - drops0 + sessions)
	if pid, err := b.s.walsenderPID(ctx, p.db, slotName, time.Second); err != nil || pid != wsPID {
		drops++
	}
	r.Extra["walsender_drops"] = drops
	r.load = load0 + " → " + loadAvg()
	if err := pr.stop(); err != nil {
		return r, err
	}
	if msgs != uint64(rows) {
		return r, fmt.Errorf("stream %s holds %d messages, want %d (one per row)", p.stream, msgs, rows)
	}
	return r, nil
}

// waitBigTxDrained waits until the stream holds n messages and the slot is
// confirmed past end: every row published and settled (the relay confirms
// a transaction only once all its rows are).
func (b *bench) waitBigTxDrained(ctx context.Context, p *path, n int, end string, pr *proc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		got, err := b.s.streamMsgs(ctx, p.stream)
		if err != nil {
			return err
		}
		var past bool
		if got >= uint64(n) {
			if err := b.s.admin.QueryRow(ctx, `SELECT confirmed_flush_lsn >= $3::pg_lsn FROM pg_replication_slots
				WHERE slot_name = $1 AND database = $2`, slotName, p.db, end).Scan(&past); err != nil {
				return err
			}
		}
		if past {
			return nil
		}
		if pr.exited() {
			return fmt.Errorf("%s exited: %v (log %s)", pr.name, pr.err, pr.log)
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stream %s holds %d of %d messages after %v", p.stream, got, n, timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// waitStandbyFlushed waits until the standby's slot has flushed lsn.
func (b *bench) waitStandbyFlushed(ctx context.Context, lsn string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var ok bool
		if err := b.s.admin.QueryRow(ctx, `SELECT coalesce(restart_lsn >= $2::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1`,
			bigTxStandbySlot, lsn).Scan(&ok); err != nil {
			return fmt.Errorf("read the standby's slot: %w", err)
		}
		if ok {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("the standby did not flush %s within %v", lsn, timeout)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func countInFile(path, s string) (int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	return strings.Count(string(data), s), nil
}
