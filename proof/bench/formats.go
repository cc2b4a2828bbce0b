package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"
)

// Formats is issue 45's case: a backlog of -rows rows drained through the
// relay's CDC path for each payload type (migrate --payload-type) and
// message format (run --message-format) in formatCombos, each on a fresh
// database and stream, -rounds times interleaved; with -baseline-bin also
// the jsonb × outbox drain by a relay built before issue 45, so that
// today's build and the earlier one are compared in one run. Run only when
// named in -cases.
const Formats = "formats"

func init() { extraCases[Formats] = (*bench).formats }

// FormatCombo is one drain of the case: a payload type, a message format,
// and whether the relay is the -baseline-bin one.
type FormatCombo struct {
	PayloadType string `json:"payload_type"`
	Format      string `json:"message_format"`
	Baseline    bool   `json:"baseline,omitempty"`
}

func (c FormatCombo) String() string {
	s := c.PayloadType + " × " + c.Format
	if c.Baseline {
		s = "baseline " + s
	}
	return s
}

// formatCombos are the case's drains: the baseline first (when there is
// one), then the new build's jsonb × outbox, the reference of the ratios.
func formatCombos(baseline bool) []FormatCombo {
	var out []FormatCombo
	if baseline {
		out = append(out, FormatCombo{PayloadType: "jsonb", Format: "outbox", Baseline: true})
	}
	for _, c := range []struct{ typ, formats string }{
		{"jsonb", "outbox,cloudevents,cloudevents-structured"},
		{"json", "outbox"},
		{"bytea", "outbox,cloudevents,cloudevents-structured"},
	} {
		for _, f := range strings.Split(c.formats, ",") {
			out = append(out, FormatCombo{PayloadType: c.typ, Format: f})
		}
	}
	return out
}

// formatOrder is the order of round round (from 1): the combos as listed
// in odd rounds, reversed in even ones, so that no combo always runs first
// on a cold server or always right after the same neighbour.
func formatOrder(combos []FormatCombo, round int) []FormatCombo {
	out := slices.Clone(combos)
	if round%2 == 0 {
		slices.Reverse(out)
	}
	return out
}

// FormatRun is one combo's drain in one round.
type FormatRun struct {
	Combo FormatCombo `json:"combo"`
	Round int         `json:"round"`
	// Result is backlogThen's: msg/s from the relay's start to every row
	// settled, the relay's CPU from /proc.
	Result Result `json:"result"`
	// StreamBytesPerMsg is the stream's stored bytes over its messages
	// (subject, headers, data and the store's own framing); DataBytes and
	// HeaderBytes are the first message's data and headers as sent
	// (NATS/1.0 header block).
	StreamBytesPerMsg float64 `json:"stream_bytes_per_msg"`
	DataBytes         int     `json:"data_bytes"`
	HeaderBytes       int     `json:"header_bytes"`
	LoadAvg           string  `json:"loadavg"`
}

// FormatRow is one combo over the rounds: medians, each of its own.
type FormatRow struct {
	Combo      FormatCombo `json:"combo"`
	Runs       int         `json:"runs"`
	MsgsPerSec float64     `json:"median_msgs_per_sec"`
	Rates      []float64   `json:"msgs_per_sec_by_round"`
	PubUSPerMs float64     `json:"median_relay_cpu_us_per_msg"`
	// WSUSPerMsg is the walsender's CPU per message (pgoutput's text of
	// each row: jsonb_out, json's text, bytea's hex).
	WSUSPerMsg float64 `json:"median_walsender_cpu_us_per_msg"`
	// OverBaseline and OverJSONB are MsgsPerSec over the baseline's and
	// over the new build's jsonb × outbox (0 when that combo did not run).
	OverBaseline      float64 `json:"msgs_per_sec_over_baseline,omitempty"`
	OverJSONB         float64 `json:"msgs_per_sec_over_jsonb_outbox,omitempty"`
	StreamBytesPerMsg float64 `json:"stream_bytes_per_msg"`
	DataBytes         int     `json:"data_bytes"`
	HeaderBytes       int     `json:"header_bytes"`
}

// FormatsResult is the case's report.
type FormatsResult struct {
	Rows        int         `json:"rows"`
	Payload     int         `json:"payload_bytes"`
	BaselineBin string      `json:"baseline_bin,omitempty"`
	Runs        []FormatRun `json:"runs"`
	Table       []FormatRow `json:"table"`
}

// formatRows sums runs up per combo, in the order of combos.
func formatRows(combos []FormatCombo, runs []FormatRun) []FormatRow {
	var rows []FormatRow
	for _, c := range combos {
		row := FormatRow{Combo: c}
		var cpu, ws, stored []float64
		for _, r := range runs {
			if r.Combo != c {
				continue
			}
			row.Runs++
			row.Rates = append(row.Rates, r.Result.MsgsPerSec)
			cpu = append(cpu, r.Result.PubCPUPerMsgUS)
			ws = append(ws, r.Result.WalsenderCPU/float64(max(r.Result.Rows, 1))*1e6)
			stored = append(stored, r.StreamBytesPerMsg)
			row.DataBytes, row.HeaderBytes = r.DataBytes, r.HeaderBytes
		}
		if row.Runs == 0 {
			continue
		}
		row.MsgsPerSec, row.PubUSPerMs, row.WSUSPerMsg, row.StreamBytesPerMsg = Median(row.Rates), Median(cpu), Median(ws), Median(stored)
		rows = append(rows, row)
	}
	ref := func(c FormatCombo) float64 {
		for _, r := range rows {
			if r.Combo == c {
				return r.MsgsPerSec
			}
		}
		return 0
	}
	base := ref(FormatCombo{PayloadType: "jsonb", Format: "outbox", Baseline: true})
	jsonb := ref(FormatCombo{PayloadType: "jsonb", Format: "outbox"})
	for i := range rows {
		if base > 0 {
			rows[i].OverBaseline = rows[i].MsgsPerSec / base
		}
		if jsonb > 0 {
			rows[i].OverJSONB = rows[i].MsgsPerSec / jsonb
		}
	}
	return rows
}

const (
	formatsDB     = "formats"
	formatsStream = "FORMATS"
	formatsPrefix = "formats."
)

func (b *bench) formats(ctx context.Context, rep *Report) error {
	combos := formatCombos(b.cfg.BaselineBin != "")
	if b.cfg.BaselineBin == "" {
		b.cfg.logf("%s: no -baseline-bin, so no baseline drain", Formats)
	}
	res := FormatsResult{Rows: b.cfg.Rows, Payload: b.cfg.Payload, BaselineBin: b.cfg.BaselineBin}
	// bytea rows are -payload random bytes, sent as hex text and decoded
	// by the producers' INSERT.
	raw := make([]byte, b.cfg.Payload)
	_, _ = rand.Read(raw)
	byteaPayload := hex.EncodeToString(raw)
	want := map[string][]byte{"jsonb": []byte(b.payload), "json": []byte(b.payload), "bytea": raw}
	for round := 1; round <= b.cfg.Rounds; round++ {
		for _, c := range formatOrder(combos, round) {
			b.cfg.logf("%s: round %d: %s", Formats, round, c)
			fb := *b // the same servers; its own payload
			switch c.PayloadType {
			case "bytea":
				fb.payload, fb.payloadSQL = byteaPayload, "decode(p, 'hex')"
			case "json":
				fb.payloadSQL = "p::json"
			}
			run, err := fb.formatDrain(ctx, c, round, want[c.PayloadType])
			if err != nil {
				return fmt.Errorf("%s, round %d, %s: %w", Formats, round, c, err)
			}
			b.cfg.logf("%s: round %d: %s: %.0f msg/s, relay %.2f µs/msg, %.0f B/msg stored (data %d B)",
				Formats, round, c, run.Result.MsgsPerSec, run.Result.PubCPUPerMsgUS, run.StreamBytesPerMsg, run.DataBytes)
			res.Runs = append(res.Runs, run)
		}
	}
	res.Table = formatRows(combos, res.Runs)
	rep.Formats = &res
	return nil
}

// formatDrain is one combo's drain: a fresh database and stream (the same
// names for every combo, so that subjects and the CloudEvents source are
// the same size in each), a backlog, the drain, the stream's count, and
// the first message's data, which outside the structured envelope is the
// payload as inserted (data).
func (b *bench) formatDrain(ctx context.Context, c FormatCombo, round int, data []byte) (FormatRun, error) {
	run := FormatRun{Combo: c, Round: round, LoadAvg: loadAvg()}
	p, err := b.formatsPath(ctx, c, round)
	defer b.teardown(p, Formats, round)
	if err != nil {
		return run, err
	}
	// As runCase before a measured backlog.
	if err := b.s.checkpoint(ctx); err != nil {
		return run, err
	}
	r, err := b.backlogThen(ctx, p, b.cfg.Rows, nil)
	if err != nil {
		return run, err
	}
	r.Case, r.Round = Formats+" "+c.String(), round
	run.Result = r
	st, err := b.s.js.Stream(ctx, p.stream)
	if err != nil {
		return run, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return run, err
	}
	if info.State.Msgs != uint64(b.cfg.Rows) {
		return run, fmt.Errorf("stream %s holds %d messages for %d rows", p.stream, info.State.Msgs, b.cfg.Rows)
	}
	run.StreamBytesPerMsg = float64(info.State.Bytes) / float64(info.State.Msgs)
	m, err := st.GetMsg(ctx, info.State.FirstSeq)
	if err != nil {
		return run, err
	}
	run.DataBytes = len(m.Data)
	if c.Format != "cloudevents-structured" && !bytes.Equal(m.Data, data) {
		return run, fmt.Errorf("message %d's data is %q, not the payload %q", m.Sequence, m.Data, data)
	}
	run.HeaderBytes = len("NATS/1.0\r\n\r\n")
	for k, vs := range m.Header {
		for _, v := range vs {
			run.HeaderBytes += len(k) + len(": \r\n") + len(v)
		}
	}
	return run, nil
}

// formatsPath is setup's CDC path for a combo: the table migrated by the
// combo's relay with its --payload-type (none for the baseline, which
// predates the flag), and the relay started once so that the slot and the
// stream exist before the backlog, and stopped again.
func (b *bench) formatsPath(ctx context.Context, c FormatCombo, round int) (*path, error) {
	url, err := b.s.createDB(ctx, formatsDB)
	if err != nil {
		return nil, err
	}
	p := &path{kind: "cdc", db: formatsDB, url: url, stream: formatsStream, prefix: formatsPrefix,
		table: "outbox", remaining: unsettledSQL(b.cfg.Policy)}
	bin, migrateArgs, runArgs := b.cfg.RelayBin, []string{"--payload-type", c.PayloadType}, []string{"--message-format", c.Format}
	if c.Baseline {
		bin, migrateArgs, runArgs = b.cfg.BaselineBin, nil, nil
	}
	cmd := exec.Command(bin, append([]string{"migrate", "--database-url", url}, migrateArgs...)...)
	if out, err := cmd.CombinedOutput(); err != nil {
		return p, fmt.Errorf("%s migrate: %w: %s", bin, err, out)
	}
	name := strings.NewReplacer(" × ", "_", " ", "_").Replace(c.String())
	logPath := filepath.Join(b.dir, fmt.Sprintf("formats_r%d_%s.log", round, name))
	p.start = func() (*proc, error) {
		return startProcEnv("relay", logPath, bin, b.cfg.RelayEnv, b.relayArgs(p, time.Second, runArgs...)...)
	}
	pr, err := p.start()
	if err != nil {
		return p, err
	}
	_, werr := b.s.walsenderPID(ctx, p.db, slotName, 60*time.Second)
	for werr == nil {
		if _, err := b.s.js.Stream(ctx, p.stream); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := pr.stop(); err != nil || werr != nil {
		return p, fmt.Errorf("first start: %v, %v (log %s)", werr, err, logPath)
	}
	// The next relay must find its own walsender, not this one exiting.
	return p, b.s.waitSlotInactive(ctx, p.db, slotName, 30*time.Second)
}

// renderFormats is the case's table.
func renderFormats(r *FormatsResult) string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "\nmessage formats (issue 45): a backlog of %d rows of %d B payloads drained through the relay's CDC path per payload type × message format, each on a fresh database and stream; "+
		"msg/s from the relay's start to every row settled, relay and walsender µs/msg their CPU from /proc, each the median of its rounds; stored B/msg = the stream's bytes over its messages; data and headers B = one message's\n\n",
		r.Rows, r.Payload)
	header := []string{"relay", "payload", "format", "msg/s", "rounds", "/baseline", "/jsonb outbox", "relay µs/msg", "walsender µs/msg", "stored B/msg", "data B", "headers B"}
	var rows [][]string
	for _, x := range r.Table {
		build := "new"
		if x.Combo.Baseline {
			build = "baseline"
		}
		rates := make([]string, len(x.Rates))
		for i, v := range x.Rates {
			rates[i] = num(v)
		}
		over := func(v float64) string {
			if v == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2fx", v)
		}
		rows = append(rows, []string{build, x.Combo.PayloadType, x.Combo.Format, num(x.MsgsPerSec), strings.Join(rates, " "),
			over(x.OverBaseline), over(x.OverJSONB), num(x.PubUSPerMs), num(x.WSUSPerMsg), num(x.StreamBytesPerMsg), fmt.Sprint(x.DataBytes), fmt.Sprint(x.HeaderBytes)})
	}
	sb.WriteString(FormatTable(header, rows))
	var loads []string
	for _, run := range r.Runs {
		loads = append(loads, run.LoadAvg)
	}
	if len(loads) > 0 {
		fmt.Fprintf(&sb, "\nload average before each drain, in run order: %s\n", strings.Join(loads, ", "))
	}
	if r.BaselineBin != "" {
		fmt.Fprintf(&sb, "baseline relay: %s\n", r.BaselineBin)
	}
	return sb.String()
}
