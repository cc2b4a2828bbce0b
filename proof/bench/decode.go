package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// probeSlot is the decode case's second slot: created before the backlog,
// streamed by a client that discards everything, dropped before the relay
// drains the same backlog through its own slot.
const probeSlot = "decode_probe"

// decode measures how far one slot goes. A backlog is committed while the
// relay is stopped; then
//
//  1. a bare replication client (pgoutput, the relay's publication and
//     options, every message discarded) streams it from a second slot:
//     the walsender alone, with no broker and no relay behind it, which is
//     the slot's ceiling;
//  2. the relay drains it through its own slot, to the broker, marking (or
//     deleting) each row, as in cdc-backlog.
//
// Each phase records the walsender's CPU, the WAL it had to decode and the
// machine's load; the drain also records the relay's and nats-server's CPU
// and the WAL the relay's own marks wrote. Autovacuum is off on the table,
// so the WAL written during the drain is the relay's (see docs/scaling.md).
func (b *bench) decode(ctx context.Context, p *path) (Result, error) {
	r := Result{Extra: map[string]float64{}}
	r.Extra["load1_start"] = load1()
	conn, err := pgx.Connect(ctx, p.url)
	if err != nil {
		return r, err
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, `ALTER TABLE outbox SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)`); err != nil {
		return r, fmt.Errorf("autovacuum off on outbox: %w", err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, probeSlot); err != nil {
		return r, fmt.Errorf("create slot %s: %w", probeSlot, err)
	}
	lsn0, err := currentLSN(ctx, conn)
	if err != nil {
		return r, err
	}
	l := b.newLoad(p, b.cfg.Rows, 0)
	el, err := l.run(ctx)
	if err != nil {
		return r, err
	}
	r.Rows, r.InsertRate = l.rows, float64(l.rows)/el.Seconds()
	lsn1, err := currentLSN(ctx, conn)
	if err != nil {
		return r, err
	}
	producerWAL := float64(lsn1 - lsn0)
	r.Extra["producer_wal_mb"] = producerWAL / 1e6
	r.Extra["producer_wal_bytes_per_row"] = producerWAL / float64(l.rows)
	b.logWALStats(ctx, "producers' WAL", lsn0, lsn1, r.Extra, "producer_wal_fpi_share")

	// 1: the walsender alone.
	r.Extra["load1_probe"] = load1()
	pr, err := b.probe(ctx, p, l.rows)
	if err != nil {
		return r, err
	}
	r.Extra["probe_seconds"] = pr.seconds
	r.Extra["probe_rows_per_sec"] = float64(l.rows) / pr.seconds
	r.Extra["probe_wal_mb_per_sec"] = producerWAL / 1e6 / pr.seconds
	r.Extra["probe_walsender_cpu_seconds"] = pr.walsenderCPU
	r.Extra["probe_walsender_us_per_row"] = pr.walsenderCPU / float64(l.rows) * 1e6
	r.Extra["probe_walsender_busy"] = pr.walsenderCPU / pr.seconds
	// Rows per second of walsender CPU: what one fully available core
	// decodes, the figure least bent by a shared machine.
	r.Extra["probe_rows_per_walsender_cpu_second"] = float64(l.rows) / pr.walsenderCPU
	r.Extra["probe_client_cpu_seconds"] = pr.clientCPU
	r.Extra["probe_pgoutput_mb"] = float64(pr.bytes) / 1e6
	if err := b.s.waitSlotInactive(ctx, p.db, probeSlot, 30*time.Second); err != nil {
		return r, err
	}
	// Dropped, or its walsender would hold the WAL and the relay's
	// walsender would be the only one to decode it anyway.
	if _, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, probeSlot); err != nil {
		return r, fmt.Errorf("drop slot %s: %w", probeSlot, err)
	}

	// 2: the relay drains the same backlog.
	r.Extra["load1_drain"] = load1()
	lsn2, err := currentLSN(ctx, conn)
	if err != nil {
		return r, err
	}
	natsCPU := newCPUMeter(pidCPU(b.s.nats.PID()))
	machine := newCPUMeter(MachineBusy)
	t0 := time.Now()
	relay, err := p.start()
	if err != nil {
		return r, err
	}
	defer relay.stop() //nolint:errcheck // stopped below; this covers the error paths
	wsPID, err := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
	if err != nil {
		return r, err
	}
	acked, settled, err := b.waitDrained(ctx, p, l.rows+int(p.baseMsgs), relay, drainTimeout(l.rows))
	if err != nil {
		return r, err
	}
	lsn3, err := currentLSN(ctx, conn)
	if err != nil {
		return r, err
	}
	b.logWALStats(ctx, "WAL written during the drain", lsn2, lsn3, r.Extra, "mark_wal_fpi_share")
	r.Seconds = settled.Sub(t0).Seconds()
	r.MsgsPerSec = float64(l.rows) / r.Seconds
	r.Extra["acked_seconds"] = acked.Sub(t0).Seconds()
	if r.PubCPUSeconds, r.PubPeakRSSMB, err = relay.usage(); err != nil {
		return r, err
	}
	r.PubCPUPerMsgUS = r.PubCPUSeconds / float64(l.rows) * 1e6
	// A new walsender started with this relay: all its CPU is this drain's.
	if r.WalsenderCPU, err = ProcCPU(wsPID); err != nil {
		return r, fmt.Errorf("walsender %d: %w", wsPID, err)
	}
	r.NATSCPU, r.MachineBusy = natsCPU.delta(), machine.delta()
	markWAL := float64(lsn3 - lsn2)
	r.Extra["mark_wal_mb"] = markWAL / 1e6
	r.Extra["mark_wal_bytes_per_row"] = markWAL / float64(l.rows)
	r.Extra["mark_wal_over_producer_wal"] = markWAL / producerWAL
	// The relay's walsender decodes the producers' WAL and, behind it,
	// the marks the relay writes while it drains.
	r.Extra["drain_wal_mb_per_sec"] = (producerWAL + markWAL) / 1e6 / r.Seconds
	r.Extra["walsender_us_per_msg"] = r.WalsenderCPU / float64(l.rows) * 1e6
	r.Extra["walsender_busy"] = r.WalsenderCPU / r.Seconds
	r.Extra["nats_us_per_msg"] = r.NATSCPU / float64(l.rows) * 1e6
	r.Extra["load1_end"] = load1()
	return r, relay.stop()
}

type probeResult struct {
	seconds      float64 // START_REPLICATION to the last row's INSERT message
	walsenderCPU float64
	clientCPU    float64 // this process over the probe: the client's share
	bytes        int64   // pgoutput bytes received
}

// probe streams the probe slot until rows INSERT messages have arrived,
// discarding them: the walsender's decode rate with nothing behind it
// that could hold it back.
func (b *bench) probe(ctx context.Context, p *path, rows int) (probeResult, error) {
	var pr probeResult
	cfg, err := pgconn.ParseConfig(p.url)
	if err != nil {
		return pr, err
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = "outbox-bench-probe"
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return pr, fmt.Errorf("probe: connect for replication: %w", err)
	}
	defer conn.Close(context.Background())
	self0, err := ProcCPU(os.Getpid())
	if err != nil {
		return pr, err
	}
	t0 := time.Now()
	// The relay's options (replication/stream.go): the same output plugin
	// work, the publication's row filter included.
	err = pglogrepl.StartReplication(ctx, conn, probeSlot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names 'outbox_relay'"},
	})
	if err != nil {
		return pr, fmt.Errorf("probe: start replication on %s: %w", probeSlot, err)
	}
	wsPID, err := b.s.walsenderPID(ctx, p.db, probeSlot, 30*time.Second)
	if err != nil {
		return pr, err
	}
	// A read deadline instead of a cancellable context: pgconn starts a
	// watcher goroutine per call for one, and the client must stay far
	// cheaper than the walsender it measures.
	timeout := drainTimeout(rows)
	if err := conn.Conn().SetReadDeadline(t0.Add(timeout)); err != nil {
		return pr, err
	}
	var last pglogrepl.LSN
	inserts := 0
	for inserts < rows {
		msg, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			return pr, fmt.Errorf("probe: %d of %d rows received within %v: %w", inserts, rows, timeout, err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 {
			if er, ok := msg.(*pgproto3.ErrorResponse); ok {
				return pr, fmt.Errorf("probe: server error: %s", er.Message)
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			pk, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return pr, fmt.Errorf("probe: keepalive: %w", err)
			}
			if pk.ReplyRequested {
				if err := pglogrepl.SendStandbyStatusUpdate(context.Background(), conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: last}); err != nil {
					return pr, fmt.Errorf("probe: status update: %w", err)
				}
			}
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return pr, fmt.Errorf("probe: xlogdata: %w", err)
			}
			pr.bytes += int64(len(x.WALData))
			last = x.WALStart
			if len(x.WALData) > 0 && x.WALData[0] == 'I' {
				inserts++
			}
		}
	}
	pr.seconds = time.Since(t0).Seconds()
	// Read while the walsender lives: it exits with the connection.
	if pr.walsenderCPU, err = ProcCPU(wsPID); err != nil {
		return pr, fmt.Errorf("probe walsender %d: %w", wsPID, err)
	}
	self1, err := ProcCPU(os.Getpid())
	if err != nil {
		return pr, err
	}
	pr.clientCPU = self1 - self0
	_ = conn.Conn().SetReadDeadline(time.Time{})
	return pr, nil
}

func currentLSN(ctx context.Context, conn *pgx.Conn) (pglogrepl.LSN, error) {
	var s string
	if err := conn.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&s); err != nil {
		return 0, fmt.Errorf("read pg_current_wal_lsn: %w", err)
	}
	lsn, err := pglogrepl.ParseLSN(s)
	if err != nil {
		return 0, fmt.Errorf("parse lsn %q: %w", s, err)
	}
	return lsn, nil
}

// load1 is the machine's 1-minute load average (-1 when unreadable):
// every decode figure is a floor under that much competition for 2 cores.
func load1() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) == 0 {
		return -1
	}
	v, err := strconv.ParseFloat(f[0], 64)
	if err != nil {
		return -1
	}
	return v
}

// renderDecode prints every decode round: the ceiling of the walsender
// alone beside the relay's drain of the same backlog, with the WAL each
// side wrote. The best round is the floor to quote: the machine is shared.
func renderDecode(rep Report) string {
	var rows [][]string
	best, bestRate := -1, 0.0
	for _, r := range rep.Results {
		if r.Case != Decode || r.Extra == nil {
			continue
		}
		e := r.Extra
		if e["probe_rows_per_sec"] > bestRate {
			best, bestRate = len(rows), e["probe_rows_per_sec"]
		}
		rows = append(rows, []string{
			fmt.Sprint(r.Round), fmt.Sprint(r.Rows),
			fmt.Sprintf("%.1f/%.1f/%.1f", e["load1_probe"], e["load1_drain"], e["load1_end"]),
			num(e["probe_rows_per_sec"]), num(e["probe_wal_mb_per_sec"]), num(e["probe_walsender_us_per_row"]),
			fmt.Sprintf("%.0f%%", 100*e["probe_walsender_busy"]), num(e["probe_rows_per_walsender_cpu_second"]),
			num(e["probe_client_cpu_seconds"]),
			num(r.MsgsPerSec), num(e["drain_wal_mb_per_sec"]), num(e["walsender_us_per_msg"]),
			fmt.Sprintf("%.0f%%", 100*e["walsender_busy"]), num(r.PubCPUPerMsgUS), num(e["nats_us_per_msg"]),
			num(e["producer_wal_bytes_per_row"]), num(e["mark_wal_bytes_per_row"]),
			fmt.Sprintf("%.0f%%", 100*e["mark_wal_over_producer_wal"]),
		})
	}
	if len(rows) == 0 {
		return ""
	}
	rows[best][0] += " (best)"
	header := []string{"round", "rows", "load 1m probe/drain/end",
		"alone rows/s", "alone WAL MB/s", "alone ws µs/row", "alone ws busy", "alone rows/ws CPU-s", "alone client CPU s",
		"drain rows/s", "drain WAL MB/s", "ws µs/msg", "ws busy", "relay µs/msg", "nats µs/msg",
		"producer WAL B/row", "mark WAL B/row", "mark/producer WAL"}
	var b strings.Builder
	fmt.Fprintf(&b, "\ndecode (one slot; policy %s): \"alone\" is a bare client streaming the backlog from a second slot and discarding it; "+
		"\"drain\" is the relay draining it through its own slot to the broker; ws = that slot's walsender; "+
		"mark WAL = WAL written from the relay's start to the last row %s\n\n", rep.Config.Policy, markVerb(rep.Config.Policy))
	b.WriteString(FormatTable(header, rows))
	return b.String()
}

func markVerb(policy string) string {
	if policy == "delete" {
		return "deleted"
	}
	return "marked"
}

// logWALStats logs what pg_waldump says of a range and records its share
// of full-page images under key; a failure is logged, not fatal.
func (b *bench) logWALStats(ctx context.Context, what string, from, to pglogrepl.LSN, extra map[string]float64, key string) {
	fpi, top, err := b.walStats(ctx, from, to)
	if err != nil {
		b.cfg.logf("%s: no record statistics: %v", what, err)
		return
	}
	extra[key] = fpi
	b.cfg.logf("%s (%s to %s, %.1f MB): %.0f%% full-page images; largest record types: %s",
		what, from, to, float64(to-from)/1e6, 100*fpi, strings.Join(top, "; "))
}

// walStats runs pg_waldump --stats=record over [from, to) of the server's
// WAL (best effort: the binary is the server's own, found through
// pg_config, and a checkpoint may already have recycled the segments). It
// returns the share of full-page images in the range's WAL and the lines of
// the largest record types.
func (b *bench) walStats(ctx context.Context, from, to pglogrepl.LSN) (fpiShare float64, top []string, err error) {
	var dataDir, binDir string
	if err := b.s.admin.QueryRow(ctx, `SELECT current_setting('data_directory'), (SELECT setting FROM pg_config WHERE name = 'BINDIR')`).Scan(&dataDir, &binDir); err != nil {
		return 0, nil, fmt.Errorf("find the data directory and pg_waldump: %w", err)
	}
	out, err := exec.CommandContext(ctx, filepath.Join(binDir, "pg_waldump"), "--stats=record",
		"-p", filepath.Join(dataDir, "pg_wal"), "-s", from.String(), "-e", to.String()).CombinedOutput()
	if err != nil {
		return 0, nil, fmt.Errorf("pg_waldump %s-%s: %w: %.300s", from, to, err, out)
	}
	type rec struct {
		line     string
		combined float64
	}
	var recs []rec
	for _, line := range strings.Split(string(out), "\n") {
		if m := walTotal.FindStringSubmatch(line); m != nil {
			fpi, _ := strconv.ParseFloat(m[2], 64)
			if combined, _ := strconv.ParseFloat(m[3], 64); combined > 0 {
				fpiShare = fpi / combined
			}
		} else if m := walRecord.FindStringSubmatch(line); m != nil {
			combined, _ := strconv.ParseFloat(m[5], 64)
			recs = append(recs, rec{line: fmt.Sprintf("%s: %s records, %s B of records, %s B of full-page images", m[1], m[2], m[3], m[4]), combined: combined})
		}
	}
	sort.Slice(recs, func(i, j int) bool { return recs[i].combined > recs[j].combined })
	for i := 0; i < len(recs) && i < 4; i++ {
		top = append(top, recs[i].line)
	}
	return fpiShare, top, nil
}

// pg_waldump --stats lines: a record type (count, record bytes, FPI bytes,
// combined bytes, each with its share in parentheses) and the total.
var (
	walRecord = regexp.MustCompile(`^(\S+)\s+(\d+)\s+\(\s*[\d.]+\s*\)\s+(\d+)\s+\(\s*[\d.]+\s*\)\s+(\d+)\s+\(\s*[\d.]+\s*\)\s+(\d+)\s+\(`)
	walTotal  = regexp.MustCompile(`^Total\s+\d+\s+(\d+)\s+\[[^\]]*\]\s+(\d+)\s+\[[^\]]*\]\s+(\d+)`)
)
