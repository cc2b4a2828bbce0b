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

// The decode case's extra slots, each created before the backlog, read by
// a client that discards everything and dropped before the relay drains:
// probeSlot with the relay's publication; sameDBSlot in the same database
// with a publication of another (empty) table, so it decodes the backlog
// and sends none of it, as a slot of a second outbox table would;
// otherDBSlot in another database, as a relay of another database would.
const (
	probeSlot   = "decode_probe"
	sameDBSlot  = "decode_same_db"
	otherDBSlot = "decode_other_db"
	otherPub    = "decode_other"
)

// decode measures how far one slot goes. A backlog is committed while the
// relay is stopped; then
//
//  1. a bare replication client (pgoutput, the relay's publication and
//     options, every message discarded) streams it from a second slot:
//     the walsender alone, with no broker and no relay behind it, which is
//     the slot's ceiling;
//  2. the same client reads a slot of the same database that publishes
//     none of it, and one of another database: what a further slot costs;
//  3. the relay drains it through its own slot, to the broker, marking (or
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
	for _, q := range []string{
		`ALTER TABLE outbox SET (autovacuum_enabled = off, toast.autovacuum_enabled = off)`,
		// -same-table keeps the database for the next round.
		`CREATE TABLE IF NOT EXISTS decode_other (id int PRIMARY KEY)`,
		`DROP PUBLICATION IF EXISTS ` + otherPub,
		`CREATE PUBLICATION ` + otherPub + ` FOR TABLE decode_other`,
		`SELECT pg_create_logical_replication_slot('` + probeSlot + `', 'pgoutput')`,
		`SELECT pg_create_logical_replication_slot('` + sameDBSlot + `', 'pgoutput')`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return r, fmt.Errorf("prepare the decode case: %s: %w", q, err)
		}
	}
	otherDB := p.db + "_other"
	otherURL, err := b.s.createDB(ctx, otherDB)
	if err != nil {
		return r, err
	}
	defer func() {
		if err := b.s.dropDB(context.Background(), otherDB); err != nil {
			b.cfg.logf("drop %s: %v", otherDB, err)
		}
	}()
	// Two statements: a slot cannot be created in a transaction that wrote.
	for _, q := range []string{`CREATE PUBLICATION ` + otherPub, `SELECT pg_create_logical_replication_slot('` + otherDBSlot + `', 'pgoutput')`} {
		if err := execIn(ctx, otherURL, q); err != nil {
			return r, fmt.Errorf("prepare %s: %s: %w", otherDB, q, err)
		}
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
	pr, err := b.readSlot(ctx, p.url, p.db, probeSlot, "outbox_relay", l.rows, 0)
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
	// Dropped once read: a slot holds the WAL from its position on.
	if err := b.dropSlot(ctx, conn, p.db, probeSlot); err != nil {
		return r, err
	}

	// 2: slots that publish none of the backlog.
	r.Extra["load1_bystanders"] = load1()
	same, err := b.readSlot(ctx, p.url, p.db, sameDBSlot, otherPub, 0, lsn1)
	if err != nil {
		return r, err
	}
	if err := b.dropSlot(ctx, conn, p.db, sameDBSlot); err != nil {
		return r, err
	}
	r.Extra["same_db_seconds"] = same.seconds
	r.Extra["same_db_walsender_us_per_row"] = same.walsenderCPU / float64(l.rows) * 1e6
	r.Extra["same_db_wal_mb_per_walsender_cpu_second"] = producerWAL / 1e6 / same.walsenderCPU
	other, err := b.readSlot(ctx, otherURL, otherDB, otherDBSlot, otherPub, 0, lsn1)
	if err != nil {
		return r, err
	}
	r.Extra["other_db_seconds"] = other.seconds
	r.Extra["other_db_walsender_us_per_row"] = other.walsenderCPU / float64(l.rows) * 1e6
	r.Extra["other_db_wal_mb_per_walsender_cpu_second"] = producerWAL / 1e6 / other.walsenderCPU

	// 3: the relay drains the same backlog.
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

type slotRead struct {
	seconds      float64 // START_REPLICATION to the end
	walsenderCPU float64
	clientCPU    float64 // this process over the read: the client's share
	bytes        int64   // pgoutput bytes received
}

// readSlot streams a slot of the database at url with pgoutput and the
// publication pub, discarding what arrives, until rows INSERT messages have
// arrived or, with rows 0, until the walsender has read the WAL up to end
// (pg_stat_replication.sent_lsn: a logical walsender's read position, which
// moves also while it sends nothing). It measures the walsender with
// nothing behind it that could hold it back.
func (b *bench) readSlot(ctx context.Context, url, db, slot, pub string, rows int, end pglogrepl.LSN) (slotRead, error) {
	var sr slotRead
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		return sr, err
	}
	cfg.RuntimeParams["replication"] = "database"
	cfg.RuntimeParams["application_name"] = "outbox-bench-" + slot
	conn, err := pgconn.ConnectConfig(ctx, cfg)
	if err != nil {
		return sr, fmt.Errorf("read slot %s: connect for replication: %w", slot, err)
	}
	defer conn.Close(context.Background())
	self0, err := ProcCPU(os.Getpid())
	if err != nil {
		return sr, err
	}
	t0 := time.Now()
	// The relay's options (replication/stream.go): the same output plugin
	// work, a publication's row filter included.
	err = pglogrepl.StartReplication(ctx, conn, slot, 0, pglogrepl.StartReplicationOptions{
		Mode:       pglogrepl.LogicalReplication,
		PluginArgs: []string{"proto_version '1'", "publication_names '" + pub + "'"},
	})
	if err != nil {
		return sr, fmt.Errorf("read slot %s: start replication: %w", slot, err)
	}
	wsPID, err := b.s.walsenderPID(ctx, db, slot, 30*time.Second)
	if err != nil {
		return sr, err
	}
	timeout := drainTimeout(max(rows, b.cfg.Rows))
	var last pglogrepl.LSN
	inserts := 0
	for {
		if rows > 0 && inserts >= rows {
			break
		}
		if rows == 0 {
			var sent string
			if err := b.s.admin.QueryRow(ctx, `SELECT coalesce(sent_lsn, '0/0')::text FROM pg_stat_replication WHERE pid = $1`, wsPID).Scan(&sent); err != nil {
				return sr, fmt.Errorf("read slot %s: walsender %d: sent_lsn: %w", slot, wsPID, err)
			}
			if at, err := pglogrepl.ParseLSN(sent); err == nil && at >= end {
				break
			}
		}
		if err := ctx.Err(); err != nil {
			return sr, err
		}
		if time.Since(t0) > timeout {
			return sr, fmt.Errorf("read slot %s: %d of %d rows received, or %s not reached, within %v", slot, inserts, rows, end, timeout)
		}
		// A read deadline instead of a cancellable context: pgconn starts a
		// watcher goroutine per call for one, and the client must stay far
		// cheaper than the walsender it measures. A timeout leaves the
		// connection usable; ctx is checked after it.
		wait := time.Second
		if rows == 0 {
			wait = 50 * time.Millisecond
		}
		if err := conn.Conn().SetReadDeadline(time.Now().Add(wait)); err != nil {
			return sr, err
		}
		msg, err := conn.ReceiveMessage(context.Background())
		if err != nil {
			if pgconn.Timeout(err) {
				continue
			}
			return sr, fmt.Errorf("read slot %s: %d of %d rows received: %w", slot, inserts, rows, err)
		}
		cd, ok := msg.(*pgproto3.CopyData)
		if !ok || len(cd.Data) == 0 {
			if er, ok := msg.(*pgproto3.ErrorResponse); ok {
				return sr, fmt.Errorf("read slot %s: server error: %s", slot, er.Message)
			}
			continue
		}
		switch cd.Data[0] {
		case pglogrepl.PrimaryKeepaliveMessageByteID:
			pk, err := pglogrepl.ParsePrimaryKeepaliveMessage(cd.Data[1:])
			if err != nil {
				return sr, fmt.Errorf("read slot %s: keepalive: %w", slot, err)
			}
			if pk.ReplyRequested {
				if err := pglogrepl.SendStandbyStatusUpdate(context.Background(), conn, pglogrepl.StandbyStatusUpdate{WALWritePosition: last}); err != nil {
					return sr, fmt.Errorf("read slot %s: status update: %w", slot, err)
				}
			}
		case pglogrepl.XLogDataByteID:
			x, err := pglogrepl.ParseXLogData(cd.Data[1:])
			if err != nil {
				return sr, fmt.Errorf("read slot %s: xlogdata: %w", slot, err)
			}
			sr.bytes += int64(len(x.WALData))
			last = x.WALStart
			if len(x.WALData) > 0 && x.WALData[0] == 'I' {
				inserts++
			}
		}
	}
	sr.seconds = time.Since(t0).Seconds()
	// Read while the walsender lives: it exits with the connection.
	if sr.walsenderCPU, err = ProcCPU(wsPID); err != nil {
		return sr, fmt.Errorf("read slot %s: walsender %d: %w", slot, wsPID, err)
	}
	self1, err := ProcCPU(os.Getpid())
	if err != nil {
		return sr, err
	}
	sr.clientCPU = self1 - self0
	_ = conn.Conn().SetReadDeadline(time.Time{})
	return sr, nil
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

// dropSlot drops a slot of the decode case once its walsender is gone.
func (b *bench) dropSlot(ctx context.Context, conn *pgx.Conn, db, slot string) error {
	if err := b.s.waitSlotInactive(ctx, db, slot, 30*time.Second); err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err != nil {
		return fmt.Errorf("drop slot %s: %w", slot, err)
	}
	return nil
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
			num(e["same_db_walsender_us_per_row"]), num(e["other_db_walsender_us_per_row"]),
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
		"unpublished ws µs/row", "other db ws µs/row",
		"drain rows/s", "drain WAL MB/s", "ws µs/msg", "ws busy", "relay µs/msg", "nats µs/msg",
		"producer WAL B/row", "mark WAL B/row", "mark/producer WAL"}
	var b strings.Builder
	fmt.Fprintf(&b, "\ndecode (one slot; policy %s): \"alone\" is a bare client streaming the backlog from a second slot and discarding it; "+
		"\"unpublished\": a slot of the same database whose publication holds none of it; \"other db\": a slot of another database; "+
		"\"drain\" is the relay draining it through its own slot to the broker; ws = that slot's walsender; "+
		"mark WAL = WAL written from the relay's start to the last row %s\n\n", rep.Config.Policy, markVerb(rep.Config.Policy))
	b.WriteString(FormatTable(header, rows))
	return b.String()
}

func markVerb(policy string) string {
	switch policy {
	case "delete":
		return "deleted"
	case "none":
		return "covered by the watermark"
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
