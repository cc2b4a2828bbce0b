package bigtable

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Statement is one statement pg_stat_statements recorded in the window.
type Statement struct {
	QueryID   int64   `json:"queryid"`
	Query     string  `json:"query"`
	Calls     int64   `json:"calls"`
	PerMinute float64 `json:"calls_per_minute"`
	MeanMS    float64 `json:"mean_ms"`
	MaxMS     float64 `json:"max_ms"`
	TotalMS   float64 `json:"total_ms"`
	Rows      int64   `json:"rows"`
	// BlocksPerCall is shared buffers hit and read per call: what one call
	// touched, the table's size or its batch's.
	BlocksPerCall float64 `json:"blocks_per_call"`
	// Plans is how many of its plans auto_explain logged in the window;
	// SeqScans how many of those scanned the outbox table sequentially.
	Plans    int `json:"plans"`
	SeqScans int `json:"plans_with_seq_scan"`
}

// Wide reports whether one call touched, on average, more than a twentieth
// of the outbox table's heap blocks: a walk of the table through an index
// is no seq scan, but no batch either. (Counting a million rows by an
// index-only scan of a small index stays under it.)
func (s Statement) Wide(heapBlocks int64) bool {
	return heapBlocks > 0 && s.BlocksPerCall > float64(heapBlocks)/20
}

// SeqScan reports whether a plan of the statement scanned the outbox table
// sequentially.
func (s Statement) SeqScan() bool { return s.SeqScans > 0 }

// statStatements makes pg_stat_statements readable in the database, or says
// why it cannot be.
func statStatements(ctx context.Context, conn *pgx.Conn) (bool, string) {
	var libs string
	if err := conn.QueryRow(ctx, `SHOW shared_preload_libraries`).Scan(&libs); err != nil {
		return false, fmt.Sprintf("read shared_preload_libraries: %v", err)
	}
	if !strings.Contains(libs, "pg_stat_statements") {
		return false, "pg_stat_statements is not loaded (start the server with bigtable.ServerConf)"
	}
	if _, err := conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return false, fmt.Sprintf("create extension pg_stat_statements: %v", err)
	}
	return true, ""
}

// explain turns auto_explain's logging of every statement's plan on or off
// for every session, from their next statement.
func explain(ctx context.Context, conn *pgx.Conn, on bool) error {
	v := "-1"
	if on {
		v = "0"
	}
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET auto_explain.log_min_duration = `+v); err != nil {
		return fmt.Errorf("auto_explain: %w", err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		return fmt.Errorf("auto_explain: reload: %w", err)
	}
	return nil
}

// planCount is what the plans logged for one statement showed.
type planCount struct{ plans, seqScans int }

// plans are the plans' counts by statement. PostgreSQL 15's auto_explain
// prints no query identifier (16's does, with log_verbose), so a plan is
// matched to pg_stat_statements' entry by its text with every constant and
// parameter taken out (pg_stat_statements writes constants as $n).
type plans struct {
	byID   map[int64]*planCount
	byText map[string]*planCount
	// cancelled counts the statements cancelled in the window (a
	// statement_timeout, or the client's context) by their text: neither
	// pg_stat_statements nor auto_explain records a statement that did not
	// finish.
	cancelled map[string]int
}

var cancelMark = []byte("ERROR:  canceling statement due to ")
var statementMark = []byte("STATEMENT:  ")

// readCancelled counts the statements cancelled in data: each error line is
// followed by a STATEMENT line with the statement's text, up to the next
// log line.
func readCancelled(data []byte, out map[string]int) {
	for {
		i := bytes.Index(data, cancelMark)
		if i < 0 {
			return
		}
		data = data[i+len(cancelMark):]
		j := bytes.Index(data, statementMark)
		if j < 0 {
			return
		}
		text := data[j+len(statementMark):]
		if k := bytes.Index(text, []byte("\n20")); k >= 0 {
			text = text[:k]
		}
		out[Oneline(string(text), 300)]++
	}
}

var (
	// Strings, numbers, parameters, and true, false and NULL (constants
	// too since PostgreSQL 15; IS NULL becomes IS ? on both sides alike).
	literals = regexp.MustCompile(`(?i)e?'(?:[^']|'')*'|\$[0-9]+|\b[0-9]+(?:\.[0-9]+)?\b|\b(?:true|false|null)\b`)
	// extract(epoch FROM x) is extract('epoch', x) to the parser: a
	// constant pg_stat_statements writes as $n.
	extractField = regexp.MustCompile(`(?i)\bextract\(\s*[a-z]+\s+from\b`)
)

// textKey is a statement's text with constants, parameters and layout
// taken out.
func textKey(q string) string {
	q = extractField.ReplaceAllString(q, "extract(? FROM")
	return strings.TrimSpace(spaces.ReplaceAllString(literals.ReplaceAllString(q, "?"), " "))
}

func (p plans) lookup(id int64, text string) *planCount {
	if pc := p.byID[id]; pc != nil {
		return pc
	}
	return p.byText[textKey(text)]
}

var planStart = []byte("plan:\n")

// readPlans reads auto_explain's JSON plans from the server log after
// offset and counts, per query identifier, the plans and those with a Seq
// Scan on table.
func readPlans(path string, offset int64, table string) plans {
	out := plans{byID: map[int64]*planCount{}, byText: map[string]*planCount{}, cancelled: map[string]int{}}
	f, err := os.Open(path)
	if err != nil {
		return out
	}
	defer f.Close()
	if _, err := f.Seek(offset, io.SeekStart); err != nil {
		return out
	}
	data, err := io.ReadAll(bufio.NewReader(f))
	if err != nil {
		return out
	}
	readCancelled(data, out.cancelled)
	for {
		i := bytes.Index(data, planStart)
		if i < 0 {
			return out
		}
		data = data[i+len(planStart):]
		var plan map[string]any
		dec := json.NewDecoder(bytes.NewReader(data))
		dec.UseNumber() // a query identifier is a 64-bit integer
		if err := dec.Decode(&plan); err != nil {
			continue
		}
		data = data[dec.InputOffset():]
		seq := seqScanOn(plan["Plan"], table)
		count := func(pc *planCount) {
			pc.plans++
			if seq {
				pc.seqScans++
			}
		}
		if num, ok := plan["Query Identifier"].(json.Number); ok {
			id, _ := num.Int64()
			if out.byID[id] == nil {
				out.byID[id] = &planCount{}
			}
			count(out.byID[id])
		}
		text, _ := plan["Query Text"].(string)
		k := textKey(text)
		if out.byText[k] == nil {
			out.byText[k] = &planCount{}
		}
		count(out.byText[k])
	}
}

func seqScanOn(node any, table string) bool {
	m, ok := node.(map[string]any)
	if !ok {
		return false
	}
	if m["Node Type"] == "Seq Scan" && m["Relation Name"] == table {
		return true
	}
	sub, _ := m["Plans"].([]any)
	for _, s := range sub {
		if seqScanOn(s, table) {
			return true
		}
	}
	return false
}

// harness marks the run's own statements, left out of the list.
var harness = regexp.MustCompile(`pg_stat_|pg_reload_conf|ALTER SYSTEM|pg_replication_slots|pg_total_relation_size`)

// readStatements reads pg_stat_statements for this database since its reset,
// with the plans' counts.
func readStatements(ctx context.Context, conn *pgx.Conn, plans plans, seconds float64) ([]Statement, error) {
	rows, err := conn.Query(ctx, `SELECT queryid, query, calls, mean_exec_time, max_exec_time, total_exec_time, rows,
			(shared_blks_hit + shared_blks_read)::float8 / greatest(calls, 1)
		FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND calls > 0`)
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	var out []Statement
	var s Statement
	_, err = pgx.ForEachRow(rows, []any{&s.QueryID, &s.Query, &s.Calls, &s.MeanMS, &s.MaxMS, &s.TotalMS, &s.Rows, &s.BlocksPerCall}, func() error {
		if harness.MatchString(s.Query) {
			return nil
		}
		s.PerMinute = float64(s.Calls) / seconds * 60
		s.Plans, s.SeqScans = 0, 0
		if pc := plans.lookup(s.QueryID, s.Query); pc != nil {
			s.Plans, s.SeqScans = pc.plans, pc.seqScans
		}
		out = append(out, s)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].TotalMS > out[j].TotalMS })
	return out, nil
}

// Cancelled is a statement cancelled in the window, and how often.
type Cancelled struct {
	Query string `json:"query"`
	N     int    `json:"n"`
}

func cancelledList(m map[string]int) []Cancelled {
	var out []Cancelled
	for q, n := range m {
		if !harness.MatchString(q) {
			out = append(out, Cancelled{q, n})
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].N > out[j].N })
	return out
}

// waitStored waits until the stream holds a message for every trickle row.
func waitStored(ctx context.Context, js jetstreamAPI, stream string, commits map[string]time.Time, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		n, err := streamMsgs(ctx, js, stream)
		if err == nil && n >= uint64(len(commits)) {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stream %s holds %d messages of %d trickle rows after %v (err %v)", stream, n, len(commits), timeout, err)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// measure reads the stream and fills the trickle's part of r.
func measure(ctx context.Context, js jetstreamAPI, stream string, commits map[string]time.Time, kinds map[string]string, r *Result) error {
	stored, err := readStream(ctx, js, stream)
	if err != nil {
		return err
	}
	var lat, dlat []float64
	byKind := map[string][]float64{}
	seen := map[string]bool{}
	for _, m := range stored {
		if seen[m.id] {
			r.Duplicates = append(r.Duplicates, m.id)
			continue
		}
		seen[m.id] = true
		c, ok := commits[m.id]
		if !ok {
			continue // a row of the preload, or a trickle insert whose return the producer never saw
		}
		if kinds[m.id] == rowDelayed {
			d := max(float64(m.at.Sub(c.Add(trickleDelay)))/float64(time.Millisecond), 0)
			dlat = append(dlat, d)
			byKind[rowDelayed] = append(byKind[rowDelayed], d)
			continue
		}
		d := float64(m.at.Sub(c)) / float64(time.Millisecond)
		if d < 0 {
			r.Early++
			d = 0
		}
		lat = append(lat, d)
		byKind[kinds[m.id]] = append(byKind[kinds[m.id]], d)
	}
	r.ByKind = map[string]Latency{}
	for k, xs := range byKind {
		slices.Sort(xs)
		r.ByKind[k] = Latency{N: len(xs), P50MS: percentile(xs, 0.5), P99MS: percentile(xs, 0.99), MaxMS: xs[len(xs)-1]}
	}
	for id := range commits {
		if !seen[id] {
			r.Missing = append(r.Missing, id)
		}
	}
	slices.Sort(r.Missing)
	r.Stored = len(lat) + len(dlat)
	r.Delayed = len(dlat)
	slices.Sort(dlat)
	r.DelayedP99MS = percentile(dlat, 0.99)
	slices.Sort(lat)
	r.P50MS, r.P99MS = percentile(lat, 0.50), percentile(lat, 0.99)
	if len(lat) > 0 {
		r.MaxMS = lat[len(lat)-1]
	}
	return nil
}

// percentile of sorted xs, nearest rank.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	i := int(float64(len(xs))*p+0.999999) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

// Table prints the result: the window's figures, then the statements
// (those that ran at least once a minute or scanned the table, most total
// time first).
func (r Result) Table() string {
	var b strings.Builder
	fmt.Fprintf(&b, "table: %d rows preloaded (%.0f MB with indexes, loaded in %.0f s), dead letter %s with %d rows behind it\n",
		r.Rows, r.TableMB, r.LoadSeconds, r.DeadLetter, r.HeldRows)
	fmt.Fprintf(&b, "heap: %d blocks; a statement marked wide touched more than a twentieth of them per call\n", r.HeapBlocks)
	fmt.Fprintf(&b, "window: %.0f s: outbox seq_scan +%d (rows read %d), idx_scan +%d\n", r.WindowSeconds, r.SeqScans, r.SeqTupRead, r.IdxScans)
	fmt.Fprintf(&b, "trickle: %d rows committed, %d stored once, %d missing, %d duplicates; commit-to-stored p50 %.1f ms, p99 %.1f ms, max %.1f ms (%d stored before the commit returned); "+
		"the %d delayed rows (poller): due-to-stored p99 %.0f ms\n",
		r.Trickle, r.Stored, len(r.Missing), len(r.Duplicates), r.P50MS, r.P99MS, r.MaxMS, r.Early, r.Delayed, r.DelayedP99MS)
	for _, k := range []string{rowUnordered, rowNewAgg, rowOldAgg, rowDelayed} {
		if l, ok := r.ByKind[k]; ok {
			fmt.Fprintf(&b, "  %s rows: %d, p50 %.1f ms, p99 %.1f ms, max %.1f ms\n", k, l.N, l.P50MS, l.P99MS, l.MaxMS)
		}
	}
	names := make([]string, 0, len(r.Fetches))
	for n := range r.Fetches {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		f := r.Fetches[n]
		fmt.Fprintf(&b, "fetched %s %d times: mean %.1f ms, max %.1f ms\n", n, f.N, f.SumMS/max(float64(f.N), 1), f.MaxMS)
	}
	if len(r.FetchErrors) > 0 {
		fmt.Fprintf(&b, "fetch errors (%d), the first: %s\n", len(r.FetchErrors), Oneline(r.FetchErrors[0], 200))
	}
	if r.StatementsNote != "" {
		fmt.Fprintf(&b, "statements: %s\n", r.StatementsNote)
		return b.String()
	}
	for _, c := range r.Cancelled {
		fmt.Fprintf(&b, "cancelled %d times (not in the table below: a statement that does not finish is not counted): %s\n", c.N, Oneline(c.Query, 160))
	}
	b.WriteString("\n| seq scan | calls/min | mean ms | max ms | total ms | blocks/call | rows/call | statement |\n")
	b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
	for _, s := range r.Statements {
		if s.PerMinute < 1 && !s.SeqScan() && !s.Wide(r.HeapBlocks) {
			continue
		}
		scan := "no"
		switch {
		case s.SeqScan():
			scan = fmt.Sprintf("YES %d/%d", s.SeqScans, s.Plans)
		case s.Plans == 0:
			scan = "?"
		}
		if s.Wide(r.HeapBlocks) {
			scan += ", wide"
		}
		fmt.Fprintf(&b, "| %s | %.1f | %.3f | %.1f | %.0f | %.0f | %.1f | %s |\n", scan, s.PerMinute, s.MeanMS, s.MaxMS, s.TotalMS,
			s.BlocksPerCall, float64(s.Rows)/max(float64(s.Calls), 1), Oneline(s.Query, 160))
	}
	return b.String()
}

var spaces = regexp.MustCompile(`\s+`)

// Oneline squeezes a statement's text onto one line of at most n bytes.
func Oneline(q string, n int) string {
	q = strings.TrimSpace(spaces.ReplaceAllString(q, " "))
	q = strings.ReplaceAll(q, "|", `\|`)
	if len(q) > n {
		q = q[:n] + "…"
	}
	return q
}
