package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

const (
	headerCommitLSN = "Outbox-Commit-LSN" // relay.HeaderCommitLSN; spelled out so the test reads the wire format
	headerTrace     = "traceparent"
)

// testSeed returns the seed of the test's random choices: OUTBOX_RELAY_E2E_SEED
// when set (to replay a failure), else the clock. It is always logged.
func testSeed(t *testing.T) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OUTBOX_RELAY_E2E_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("OUTBOX_RELAY_E2E_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (replay with OUTBOX_RELAY_E2E_SEED=%d)", seed, seed)
	return seed
}

func runArgs(dbURL, natsURL, stream, prefix, slot, publication string, extra ...string) []string {
	return append([]string{
		"--database-url", dbURL,
		"--nats-url", natsURL,
		"--slot", slot,
		"--publication", publication,
		"--stream", stream,
		"--subject-prefix", prefix,
		"--log-format", "json",
	}, extra...)
}

// outRow is one row a producer inserted, with what its message must carry.
type outRow struct {
	id    string
	kind  string
	n     int
	pad   string
	trace string // "" means no headers
}

func (r outRow) payload() string {
	return fmt.Sprintf(`{"n":%d,"pad":%q}`, r.n, r.pad)
}

// insertRows inserts rows in tx with one statement.
func insertRows(ctx context.Context, tx pgx.Tx, rows []outRow) error {
	ids := make([]string, len(rows))
	kinds := make([]string, len(rows))
	payloads := make([]string, len(rows))
	headers := make([]*string, len(rows))
	for i, r := range rows {
		ids[i], kinds[i], payloads[i] = r.id, r.kind, r.payload()
		if r.trace != "" {
			h := fmt.Sprintf(`{%q:%q}`, headerTrace, r.trace)
			headers[i] = &h
		}
	}
	_, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, headers)
		SELECT w, k, p::jsonb, h::jsonb FROM unnest($1::text[], $2::text[], $3::text[], $4::text[]) AS u(w, k, p, h)`,
		ids, kinds, payloads, headers)
	return err
}

// witness is the test's own record of the transactions, read from a
// test_decoding slot created before the first insert: for every inserted
// work_id, its transaction and that transaction's end LSN.
type witness struct {
	end map[string]pglogrepl.LSN
	xid map[string]uint32
}

var insertLine = regexp.MustCompile(`^table [^ ]+\.outbox: INSERT: work_id\[text\]:'([^']*)'`)

func createWitness(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	slot := uniqueName("e2e_witness")
	if _, err := conn.Exec(context.Background(), `SELECT pg_create_logical_replication_slot($1, 'test_decoding')`, slot); err != nil {
		t.Fatalf("create test_decoding slot: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := conn.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, slot); err != nil {
			t.Errorf("drop test_decoding slot %s: %v", slot, err)
		}
	})
	return slot
}

func readWitness(t *testing.T, conn *pgx.Conn, slot string) witness {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rows, err := conn.Query(ctx, `SELECT lsn::text, xid::text, data FROM pg_logical_slot_peek_changes($1, NULL, NULL, 'include-xids', '1')`, slot)
	if err != nil {
		t.Fatalf("peek test_decoding slot: %v", err)
	}
	w := witness{end: map[string]pglogrepl.LSN{}, xid: map[string]uint32{}}
	commitEnd := map[uint32]pglogrepl.LSN{}
	for rows.Next() {
		var lsnText, xidText, data string
		if err := rows.Scan(&lsnText, &xidText, &data); err != nil {
			t.Fatalf("peek test_decoding slot: %v", err)
		}
		xid64, err := strconv.ParseUint(xidText, 10, 32)
		if err != nil {
			t.Fatalf("xid %q: %v", xidText, err)
		}
		xid := uint32(xid64)
		if m := insertLine.FindStringSubmatch(data); m != nil {
			w.xid[m[1]] = xid
			continue
		}
		if strings.HasPrefix(data, "COMMIT") {
			lsn, err := pglogrepl.ParseLSN(lsnText)
			if err != nil {
				t.Fatalf("lsn %q: %v", lsnText, err)
			}
			commitEnd[xid] = lsn
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("peek test_decoding slot: %v", err)
	}
	for id, xid := range w.xid {
		end, ok := commitEnd[xid]
		if !ok {
			t.Fatalf("test_decoding shows %s inserted by xid %d without a COMMIT", id, xid)
		}
		w.end[id] = end
	}
	return w
}

// killRecord is what the test saw right after one kill -9, once the killed
// relay's walsender had released the slot.
type killRecord struct {
	index       int
	mode        string
	atRows      int64 // rows committed by the producers when it was killed
	confirmed   pglogrepl.LSN
	walNow      pglogrepl.LSN
	lastSeq     uint64
	unpublished map[string]bool // work_ids not published in the table at that moment
	published   []string        // work_ids the table counted as published (marked, or covered by the watermark)
}

// TestKill9DuringLoad kills the relay with SIGKILL again and again while four
// producers commit rows (and roll some back), and checks on the data that
// nothing committed was lost (G1), nothing rolled back was published (G2),
// nothing was stored twice (G5), and that the slot was never confirmed past a
// transaction before its messages were in the stream and its rows marked (G3).
//
// It runs under --on-publish mark and none (G17). Under none the rows the
// CDC path published stay 'ready' and the recorded watermark says they were
// published: after each kill every row the watermark covers must already
// be in the stream, and at the end every row is either marked by the
// poller or covered, exactly once in the stream.
func TestKill9DuringLoad(t *testing.T) {
	t.Parallel()
	for _, policy := range []string{"mark", "none"} {
		t.Run(policy, func(t *testing.T) {
			t.Parallel()
			testKill9DuringLoad(t, policy)
		})
	}
}

// coveredSQL: the outbox row o is covered by the table's newest watermark
// (--on-publish none); written out here, not taken from the store, so the
// test checks the relay's watermark with its own reading of it.
const coveredSQL = `coalesce(pg_visible_in_snapshot(o.xact_id, (SELECT watermark_snapshot FROM outbox_slots
	WHERE watermark_lsn IS NOT NULL ORDER BY watermark_lsn DESC LIMIT 1)), false)`

// publishedSQL: the outbox row o was published, by the policy's evidence.
func publishedSQL(policy string) string {
	if policy == "none" {
		return `(o.state = 'published' OR (o.state = 'ready' AND ` + coveredSQL + `))`
	}
	return `(o.state = 'published')`
}

func testKill9DuringLoad(t *testing.T, policy string) {
	const (
		totalRows = 10000
		producers = 4
		kills     = 6
		maxTxRows = 50
		// Pacing: a producer pauses up to this long (uniform) between
		// transactions, so the load lasts several seconds and the kills land
		// while it runs. Pacing load is not waiting for anything.
		maxPause = 110 * time.Millisecond
	)
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(seed, 1))
	slot, publication := uniqueName("e2e_relay"), "outbox_relay"
	started := time.Now()

	migrate(t, dbURL, publication)
	conn := connectPG(t, dbURL)
	witnessSlot := createWitness(t, conn)
	js := connectNATS(t, env.NATS.URL())

	r := newRelay(t, runArgs(dbURL, env.NATS.URL(), stream, prefix, slot, publication,
		"--status-interval", "100ms", "--ack-timeout", "5s", "--on-publish", policy)...)
	r.start()
	// Producers start once the relay's slot exists: rows committed before it
	// are the snapshot hand-off's business (G9), not this test's.
	waitSlot(t, conn, slot, true, 60*time.Second)

	// --- load ---
	ctx, cancel := context.WithCancel(context.Background())
	var (
		wg          sync.WaitGroup
		budget      atomic.Int64
		committed   atomic.Int64
		done        atomic.Int32
		results     = make([]struct{ committed, rolledBack []outRow }, producers)
		errs        = make([]error, producers)
		committedTx atomic.Int64
		rolledTx    atomic.Int64
	)
	budget.Store(totalRows)
	take := func(n int64) int64 {
		for {
			left := budget.Load()
			if left <= 0 {
				return 0
			}
			k := min(n, left)
			if budget.CompareAndSwap(left, left-k) {
				return k
			}
		}
	}
	t.Cleanup(func() { cancel(); wg.Wait() })
	for p := range producers {
		prng := rand.New(rand.NewPCG(seed, uint64(p)+100))
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer done.Add(1)
			errs[p] = func() error {
				pc, err := pgx.Connect(ctx, dbURL)
				if err != nil {
					return err
				}
				defer pc.Close(context.Background())
				seq := 0
				row := func(prefix string) outRow {
					seq++
					r := outRow{
						id:   fmt.Sprintf("%s-%d-%d", prefix, p, seq),
						kind: []string{"order", "invoice", "mail"}[prng.IntN(3)],
						n:    p*1_000_000 + seq,
						pad:  strings.Repeat("x", prng.IntN(200)),
					}
					if prng.IntN(10) == 0 {
						r.trace = fmt.Sprintf("00-%032x-%016x-01", prng.Uint64(), prng.Uint64())
					}
					return r
				}
				for ctx.Err() == nil {
					if prng.IntN(8) == 0 {
						// A transaction that inserts and rolls back: its
						// rows must never reach the stream (G2).
						rows := make([]outRow, 1+prng.IntN(5))
						for i := range rows {
							rows[i] = row("rb")
						}
						tx, err := pc.Begin(ctx)
						if err != nil {
							return err
						}
						if err := insertRows(ctx, tx, rows); err != nil {
							return err
						}
						if err := tx.Rollback(ctx); err != nil {
							return err
						}
						results[p].rolledBack = append(results[p].rolledBack, rows...)
						rolledTx.Add(1)
					}
					n := take(1 + prng.Int64N(maxTxRows))
					if n == 0 {
						return nil
					}
					rows := make([]outRow, n)
					for i := range rows {
						rows[i] = row("w")
					}
					tx, err := pc.Begin(ctx)
					if err != nil {
						return err
					}
					if err := insertRows(ctx, tx, rows); err != nil {
						_ = tx.Rollback(ctx)
						return err
					}
					if err := tx.Commit(ctx); err != nil {
						return fmt.Errorf("commit (outcome unknown, the test cannot go on): %w", err)
					}
					results[p].committed = append(results[p].committed, rows...)
					committed.Add(n)
					committedTx.Add(1)
					time.Sleep(time.Duration(prng.Int64N(int64(maxPause))))
				}
				return ctx.Err()
			}()
		}()
	}

	// --- kills ---
	// Kill k comes once the producers have committed a random number of rows
	// inside the k-th slice of 5%..90% of the load: either at once, or right
	// after the relay's next confirmation reached the slot, the moment when
	// a confirmation that ran ahead of the acks or the marks would still be
	// uncovered.
	var records []killRecord
	for k := range kills {
		lo := totalRows * (5 + 85*k/kills) / 100
		hi := totalRows * (5 + 85*(k+1)/kills) / 100
		at := int64(lo + rng.IntN(hi-lo))
		afterConfirm := rng.IntN(2) == 0
		testenv.WaitFor(t, 2*time.Minute, fmt.Sprintf("producers to commit %d rows", at), func() (bool, error) {
			return committed.Load() >= at || done.Load() == producers, nil
		})
		if done.Load() == producers {
			break
		}
		mode := "at once"
		if afterConfirm {
			mode = "no confirmation within 5s, then"
			before, err := readSlot(context.Background(), conn, slot)
			if err != nil {
				t.Fatalf("read slot: %v", err)
			}
			if poll(5*time.Second, time.Millisecond, func() bool {
				st, err := readSlot(context.Background(), conn, slot)
				return err == nil && st.confirmed > before.confirmed
			}) {
				mode = "right after a confirmation"
			}
		}
		r.requireRunning()
		rows := committed.Load()
		r.kill()
		// A killed relay's walsender notices the closed socket a moment
		// later; until it exits it may still apply a status update the
		// relay sent before dying, so only then is confirmed_flush_lsn final.
		st := waitSlot(t, conn, slot, false, 60*time.Second)
		rec := killRecord{index: k + 1, mode: mode, atRows: rows, confirmed: st.confirmed, walNow: currentWAL(t, conn), unpublished: map[string]bool{}}
		info, err := streamInfo(t, js, stream)
		if err != nil {
			t.Fatalf("stream info after kill %d: %v", k+1, err)
		}
		rec.lastSeq = info.State.LastSeq
		ids, err := queryStrings(conn, `SELECT work_id FROM outbox o WHERE NOT `+publishedSQL(policy))
		if err != nil {
			t.Fatalf("read unpublished rows after kill %d: %v", k+1, err)
		}
		for _, id := range ids {
			rec.unpublished[id] = true
		}
		if rec.published, err = queryStrings(conn, `SELECT work_id FROM outbox o WHERE `+publishedSQL(policy)); err != nil {
			t.Fatalf("read published rows after kill %d: %v", k+1, err)
		}
		records = append(records, rec)
		r.start()
	}
	wg.Wait()
	for p, err := range errs {
		if err != nil {
			t.Fatalf("producer %d: %v", p, err)
		}
	}
	if len(records) < 4 {
		t.Fatalf("only %d kills happened while the producers ran (want at least 4): the load finished too fast; raise maxPause", len(records))
	}
	loadDone := time.Since(started)

	var committedRows, rolledRows []outRow
	for _, res := range results {
		committedRows = append(committedRows, res.committed...)
		rolledRows = append(rolledRows, res.rolledBack...)
	}
	if len(committedRows) != totalRows {
		t.Fatalf("producers committed %d rows, want %d", len(committedRows), totalRows)
	}
	want := make(map[string]outRow, len(committedRows))
	for _, row := range committedRows {
		want[row.id] = row
	}
	rolledBack := make(map[string]bool, len(rolledRows))
	for _, row := range rolledRows {
		rolledBack[row.id] = true
	}

	// --- drain ---
	// Up to 120s, but a drain that makes no progress for 30s has stalled
	// (rows skipped by an early confirmation stay 'ready' for good): then
	// go on to the evidence, which says which guarantee broke.
	var published, inTable int
	lastProgress, lastPublished := time.Now(), -1
	if !poll(120*time.Second, 20*time.Millisecond, func() bool {
		r.requireRunning()
		if err := conn.QueryRow(context.Background(), `SELECT count(*) FILTER (WHERE `+publishedSQL(policy)+`), count(*) FROM outbox o`).Scan(&published, &inTable); err != nil {
			t.Fatalf("count published rows: %v", err)
		}
		if published != lastPublished {
			lastProgress, lastPublished = time.Now(), published
		}
		return (published == totalRows && inTable == totalRows) || time.Since(lastProgress) > 30*time.Second
	}) || published != totalRows || inTable != totalRows {
		t.Errorf("the drain stalled: %d of %d committed rows published (%d in the table); checking the evidence anyway", published, totalRows, inTable)
	}
	drained := time.Since(started)

	// --- evidence ---
	wit := readWitness(t, conn, witnessSlot)
	for id := range want {
		if _, ok := wit.end[id]; !ok {
			t.Fatalf("test_decoding does not show committed row %s: the witness is incomplete", id)
		}
	}
	msgs := readStream(t, js, stream)
	type seen struct {
		seqs []uint64
		lsn  string
	}
	byID := map[string]*seen{}
	var phantoms, unknown, badMsgs []string
	for _, m := range msgs {
		id := m.header.Get(jetstream.MsgIDHeader)
		s := byID[id]
		if s == nil {
			s = &seen{}
			byID[id] = s
		}
		s.seqs = append(s.seqs, m.seq)
		s.lsn = m.header.Get(headerCommitLSN)
		row, ok := want[id]
		switch {
		case rolledBack[id]:
			phantoms = append(phantoms, id)
			continue
		case !ok:
			unknown = append(unknown, fmt.Sprintf("seq %d id %q", m.seq, id))
			continue
		}
		// G4 (light): the message is the committed row.
		var body struct {
			N   int    `json:"n"`
			Pad string `json:"pad"`
		}
		if err := json.Unmarshal(m.data, &body); err != nil || body.N != row.n || body.Pad != row.pad {
			badMsgs = append(badMsgs, fmt.Sprintf("%s: payload %s (err %v)", id, m.data, err))
		}
		if m.subject != prefix+row.kind {
			badMsgs = append(badMsgs, fmt.Sprintf("%s: subject %q, want %q", id, m.subject, prefix+row.kind))
		}
		if m.header.Get(headerTrace) != row.trace {
			badMsgs = append(badMsgs, fmt.Sprintf("%s: traceparent %q, want %q", id, m.header.Get(headerTrace), row.trace))
		}
	}
	var lost []string
	duplicates := 0
	for id := range want {
		s := byID[id]
		if s == nil {
			lost = append(lost, id)
			continue
		}
		duplicates += len(s.seqs) - 1
	}
	// Outbox-Commit-LSN is the commit record's start: the same for every row
	// of a transaction and below the transaction's end LSN.
	txLSN := map[uint32]string{}
	for id, s := range byID {
		if _, ok := want[id]; !ok {
			continue
		}
		lsn, err := pglogrepl.ParseLSN(s.lsn)
		if err != nil || lsn >= wit.end[id] {
			badMsgs = append(badMsgs, fmt.Sprintf("%s: %s %q, transaction ends at %s", id, headerCommitLSN, s.lsn, wit.end[id]))
		}
		if prev, ok := txLSN[wit.xid[id]]; ok && prev != s.lsn {
			badMsgs = append(badMsgs, fmt.Sprintf("%s: %s %s differs from %s of another row of xid %d", id, headerCommitLSN, s.lsn, prev, wit.xid[id]))
		}
		txLSN[wit.xid[id]] = s.lsn
	}

	// G3: at every kill, every transaction that ended at or before the
	// confirmed LSN was already in the stream and marked in the table.
	var g3 []string
	var maxLag uint64
	coveredAny := false
	for _, rec := range records {
		covered, replay := 0, 0
		for id, end := range wit.end {
			if _, ok := want[id]; !ok {
				continue
			}
			s := byID[id]
			inStream := s != nil && slicesMin(s.seqs) <= rec.lastSeq
			if end > rec.confirmed {
				if inStream {
					replay++
				}
				continue
			}
			covered++
			if !inStream {
				g3 = append(g3, fmt.Sprintf("kill %d: %s (txn end %s) is covered by confirmed_flush_lsn %s but was not in the stream (last seq %d)", rec.index, id, end, rec.confirmed, rec.lastSeq))
			}
			if rec.unpublished[id] && policy == "mark" {
				g3 = append(g3, fmt.Sprintf("kill %d: %s (txn end %s) is covered by confirmed_flush_lsn %s but its row was not marked published", rec.index, id, end, rec.confirmed))
			}
		}
		// G17: what the table says was published (marked, or covered by
		// the watermark) was in the stream when the relay died.
		for _, id := range rec.published {
			s := byID[id]
			if s == nil || slicesMin(s.seqs) > rec.lastSeq {
				g3 = append(g3, fmt.Sprintf("kill %d: %s counted as published (%s) but was not in the stream (last seq %d)", rec.index, id, policy, rec.lastSeq))
			}
		}
		coveredAny = coveredAny || covered > 0
		lag := uint64(0)
		if rec.walNow > rec.confirmed {
			lag = uint64(rec.walNow - rec.confirmed)
		}
		maxLag = max(maxLag, lag)
		t.Logf("kill %d (%s) at %d committed rows: confirmed_flush_lsn %s (WAL at %s, lag %d bytes), stream last seq %d, rows covered by the confirmation %d, rows in the stream beyond it (replayed after restart) %d",
			rec.index, rec.mode, rec.atRows, rec.confirmed, rec.walNow, lag, rec.lastSeq, covered, replay)
	}

	// (5) the table agrees with the stream.
	var badRows []string
	rows, err := conn.Query(context.Background(), `SELECT work_id, state, stream_seq FROM outbox`)
	if err != nil {
		t.Fatalf("read outbox: %v", err)
	}
	for rows.Next() {
		var id, state string
		var seq *int64
		if err := rows.Scan(&id, &state, &seq); err != nil {
			t.Fatalf("read outbox: %v", err)
		}
		s := byID[id]
		switch {
		case policy == "none" && state == "ready" && seq == nil && s != nil && len(s.seqs) == 1:
			// published by the CDC path, left as inserted (G17); that
			// the watermark covers it is what the drain waited for.
		case state != "published":
			badRows = append(badRows, fmt.Sprintf("%s: state %s", id, state))
		case seq == nil:
			badRows = append(badRows, fmt.Sprintf("%s: published without stream_seq", id))
		case s == nil:
			badRows = append(badRows, fmt.Sprintf("%s: stream_seq %d, not in the stream", id, *seq))
		case len(s.seqs) != 1 || uint64(*seq) != s.seqs[0]:
			badRows = append(badRows, fmt.Sprintf("%s: stream_seq %d, stream has it at %v", id, *seq, s.seqs))
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatalf("read outbox: %v", err)
	}

	t.Logf("figures: seed=%d committed_rows=%d committed_txns=%d rollback_rows=%d rollback_txns=%d kills=%d relay_starts=%d stream_msgs=%d lost=%d stored_duplicates=%d phantoms=%d unknown_msgs=%d g3_violations=%d bad_msgs=%d bad_rows=%d max_confirmed_lag_bytes=%d load=%s drained=%s",
		seed, len(committedRows), committedTx.Load(), len(rolledRows), rolledTx.Load(), len(records), r.starts, len(msgs),
		len(lost), duplicates, len(phantoms), len(unknown), len(g3), len(badMsgs), len(badRows), maxLag,
		loadDone.Round(time.Millisecond), drained.Round(time.Millisecond))

	report := func(what string, items []string) {
		t.Helper()
		if len(items) == 0 {
			return
		}
		sort.Strings(items)
		if len(items) > 20 {
			items = append(items[:20], fmt.Sprintf("... and %d more", len(items)-20))
		}
		t.Errorf("%s:\n  %s", what, strings.Join(items, "\n  "))
	}
	report("G1: committed rows missing from the stream", lost)
	if duplicates > 0 {
		var dups []string
		for id, s := range byID {
			if len(s.seqs) > 1 {
				dups = append(dups, fmt.Sprintf("%s at seqs %v", id, s.seqs))
			}
		}
		report("G5: work_ids stored more than once", dups)
	}
	report("G2: rolled-back rows in the stream", phantoms)
	report("messages with an unknown Nats-Msg-Id", unknown)
	report("G3: slot confirmed too early", g3)
	report("messages that do not match their row", badMsgs)
	report("rows whose state does not match the stream", badRows)
	if !coveredAny {
		t.Errorf("no kill found a confirmed_flush_lsn covering any row: the relay never confirmed between kills, so G3 was not exercised")
	}
}

// poll checks cond every interval until it holds (true) or timeout passes
// (false). Unlike testenv.WaitFor it does not fail the test, for waits
// whose timeout is an outcome to report rather than an error.
func poll(timeout, interval time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(interval)
	}
	return true
}

func slicesMin(s []uint64) uint64 {
	m := s[0]
	for _, v := range s[1:] {
		m = min(m, v)
	}
	return m
}

func queryStrings(conn *pgx.Conn, sql string) ([]string, error) {
	rows, err := conn.Query(context.Background(), sql)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// TestSIGTERMDrainsAndConfirms checks the graceful stop: after SIGTERM the
// relay exits 0 within 15s and leaves the slot confirmed past everything it
// acked, so a restart replays nothing.
func TestSIGTERMDrainsAndConfirms(t *testing.T) {
	// Not parallel: it compares the slot with pg_current_wal_lsn(), and WAL
	// written by concurrent tests on the shared server would move that.
	const total = 2000
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot, publication := uniqueName("e2e_relay"), "outbox_relay"
	migrate(t, dbURL, publication)
	conn := connectPG(t, dbURL)
	js := connectNATS(t, env.NATS.URL())

	r := newRelay(t, runArgs(dbURL, env.NATS.URL(), stream, prefix, slot, publication, "--status-interval", "200ms")...)
	r.start()
	waitSlot(t, conn, slot, true, 60*time.Second)

	ctx := context.Background()
	for i := 0; i < total; i += 50 {
		rows := make([]outRow, 50)
		for j := range rows {
			rows[j] = outRow{id: fmt.Sprintf("w-%d", i+j), kind: "order", n: i + j, pad: "p"}
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := insertRows(ctx, tx, rows); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	afterInsert := currentWAL(t, conn)

	testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("%d messages in the stream", total), func() (bool, error) {
		r.requireRunning()
		info, err := streamInfo(t, js, stream)
		return err == nil && info.State.Msgs >= total, err
	})
	stopAt := time.Now()
	state, err := r.terminate(15 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	stopTook := time.Since(stopAt)
	if code := state.ExitCode(); code != 0 {
		t.Fatalf("relay exited with %v after SIGTERM, want exit code 0", state)
	}
	st := waitSlot(t, conn, slot, false, 30*time.Second)

	var published int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE state = 'published' AND stream_seq IS NOT NULL`).Scan(&published); err != nil {
		t.Fatal(err)
	}
	msgs := readStream(t, js, stream)
	ids := map[string]bool{}
	// The last transaction's commit record starts at the highest
	// Outbox-Commit-LSN; pg_current_wal_lsn() after the inserts is no bound,
	// since the relay's marks and other databases of the shared server
	// write WAL after it.
	var lastCommit pglogrepl.LSN
	for _, m := range msgs {
		ids[m.header.Get(jetstream.MsgIDHeader)] = true
		if lsn, err := pglogrepl.ParseLSN(m.header.Get(headerCommitLSN)); err == nil && lsn > lastCommit {
			lastCommit = lsn
		}
	}
	t.Logf("figures: rows=%d stream_msgs=%d distinct_ids=%d published_rows=%d exit=%d stop_took=%s wal_after_insert=%s last_commit=%s confirmed_after_stop=%s",
		total, len(msgs), len(ids), published, state.ExitCode(), stopTook.Round(time.Millisecond), afterInsert, lastCommit, st.confirmed)
	if lastCommit == 0 || st.confirmed <= lastCommit {
		t.Errorf("after the graceful stop the slot is confirmed at %s, not past the last transaction's commit at %s: a restart would replay acked rows",
			st.confirmed, lastCommit)
	}
	if published != total {
		t.Errorf("%d of %d rows are published with a stream_seq after the graceful stop", published, total)
	}
	if len(msgs) != total || len(ids) != total {
		t.Errorf("stream holds %d messages with %d distinct ids, want %d of each", len(msgs), len(ids), total)
	}
}

// TestBadInputFailsClearly runs `outbox-relay run` with inputs it must refuse
// (G11): it has to exit non-zero with a message that says what is wrong,
// and never print a password.
func TestBadInputFailsClearly(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	natsURL := env.NATS.URL()
	okDB := env.PG.URL("postgres")
	base := func(dbURL, nats string, extra ...string) []string {
		return append([]string{"run"}, runArgs(dbURL, nats, stream, prefix, uniqueName("e2e_bad"), "outbox_relay", extra...)...)
	}
	// withoutDatabaseURL leaves the URL to OUTBOX_RELAY_DATABASE_URL.
	withoutDatabaseURL := func(args []string) []string {
		var out []string
		for i := 0; i < len(args); i++ {
			if args[i] == "--database-url" {
				i++
				continue
			}
			out = append(out, args[i])
		}
		return out
	}
	const password = "s3cretPassw0rd"

	closedPort := func(t *testing.T) int {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		return port
	}

	cases := []struct {
		name     string
		args     func(t *testing.T) []string
		env      []string
		contains []string // each must appear in stderr
	}{
		{
			name:     "table missing",
			args:     func(t *testing.T) []string { return base(env.PG.CreateDatabase(t), natsURL) },
			contains: []string{"run `outbox-relay migrate`", "outbox"},
		},
		{
			name:     "bad flag value",
			args:     func(*testing.T) []string { return base(okDB, natsURL, "--on-publish=maybe") },
			contains: []string{"--on-publish", "maybe", "mark, delete or none"},
		},
		{
			name:     "bad environment value",
			args:     func(*testing.T) []string { return base(okDB, natsURL) },
			env:      []string{"OUTBOX_RELAY_ACK_TIMEOUT=soon"},
			contains: []string{"OUTBOX_RELAY_ACK_TIMEOUT", "--ack-timeout", "soon"},
		},
		{
			name: "unknown role with password in URL",
			args: func(*testing.T) []string {
				return base(fmt.Sprintf("postgres://nobody:%s@127.0.0.1:%d/db", password, env.PG.Port()), natsURL)
			},
			contains: []string{"PostgreSQL", "nobody"},
		},
		{
			name: "unknown role with password in key=value string",
			args: func(*testing.T) []string {
				return base(fmt.Sprintf("host=127.0.0.1 port=%d user=nobody password=%s dbname=db", env.PG.Port(), password), natsURL)
			},
			contains: []string{"PostgreSQL", "nobody"},
		},
		{
			name:     "unknown role with password in environment",
			args:     func(*testing.T) []string { return withoutDatabaseURL(base("", natsURL)) },
			env:      []string{fmt.Sprintf("OUTBOX_RELAY_DATABASE_URL=postgres://nobody:%s@127.0.0.1:%d/db", password, env.PG.Port())},
			contains: []string{"PostgreSQL", "nobody"},
		},
		{
			name: "malformed URL with password",
			args: func(*testing.T) []string {
				return base(fmt.Sprintf("postgres://nobody:%s@127.0.0.1:notaport/db", password), natsURL)
			},
			contains: []string{"--database-url", "invalid port"},
		},
		{
			// The stream cases run on a migrated database: the database's
			// checks come first, so a start refused for the table leaves
			// nothing on the broker.
			name: "no stream and --create-stream=false",
			args: func(t *testing.T) []string {
				stream, prefix := env.StreamName(t)
				return append([]string{"run"}, runArgs(env.PG.CreateOutboxDatabase(t), natsURL, stream, prefix, uniqueName("e2e_bad"), "outbox_relay", "--create-stream=false")...)
			},
			contains: []string{"does not exist and --create-stream=false"},
		},
		{
			name: "stream bound to other subjects",
			args: func(t *testing.T) []string {
				stream, prefix := env.StreamName(t)
				js := connectNATS(t, natsURL)
				if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: stream, Subjects: []string{"elsewhere." + stream + ".>"}}); err != nil {
					t.Fatal(err)
				}
				return append([]string{"run"}, runArgs(env.PG.CreateOutboxDatabase(t), natsURL, stream, prefix, uniqueName("e2e_bad"), "outbox_relay")...)
			},
			contains: []string{"does not bind", "--subject-prefix"},
		},
		{
			name: "subjects overlap another stream",
			args: func(t *testing.T) []string {
				stream, prefix := env.StreamName(t)
				js := connectNATS(t, natsURL)
				if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: stream + "_OTHER", Subjects: []string{prefix + ">"}}); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream+"_OTHER") })
				return append([]string{"run"}, runArgs(env.PG.CreateOutboxDatabase(t), natsURL, stream, prefix, uniqueName("e2e_bad"), "outbox_relay")...)
			},
			contains: []string{"another stream already binds", "--stream"},
		},
		{
			name: "wrong NATS credentials",
			args: func(t *testing.T) []string {
				srv, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, Username: "relay", Password: "right-one", NoLog: true, NoSigs: true})
				if err != nil {
					t.Fatal(err)
				}
				go srv.Start()
				t.Cleanup(srv.Shutdown)
				if !srv.ReadyForConnections(10 * time.Second) {
					t.Fatal("in-process nats-server not ready")
				}
				return base(okDB, fmt.Sprintf("nats://relay:%s@%s", password, srv.Addr()))
			},
			contains: []string{"NATS", "uthorization"},
		},
		{
			name: "NATS unreachable",
			args: func(t *testing.T) []string {
				return base(okDB, fmt.Sprintf("nats://relay:%s@127.0.0.1:%d", password, closedPort(t)))
			},
			contains: []string{"NATS", "127.0.0.1"},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			args := tc.args(t)
			code, stdout, stderr := runCmd(t, tc.env, args...)
			t.Logf("exit %d; stderr:\n%s", code, strings.TrimSpace(stderr))
			if code <= 0 {
				t.Errorf("exit code %d, want a non-zero exit", code)
			}
			for _, s := range tc.contains {
				if !strings.Contains(stderr, s) {
					t.Errorf("stderr does not mention %q", s)
				}
			}
			if strings.Contains(stderr, password) || strings.Contains(stdout, password) {
				t.Errorf("the output shows the password %q", password)
			}
		})
	}
}
