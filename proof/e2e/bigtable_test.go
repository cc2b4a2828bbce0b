package e2e

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/proof/bigtable"
)

// G16 as a whole: a table of a million published rows (a fifth of them in
// 1,000 aggregates, one dead letter holding its aggregate), the relay run on
// it with --ordering aggregate and its console, the overview and the dead
// letters fetched every 2 s and /metrics every 5 s, and 20 new rows a second
// committed for a minute. In that minute the outbox table must see no
// sequential scan (pg_stat_user_tables.seq_scan), every new row must be in
// the stream once, and the p99 from a row's commit to its message stored
// in JetStream must be at most 250 ms. On failure the log lists each
// statement the database ran in the window (pg_stat_statements) and whether
// its plan scanned the table (auto_explain).
//
// OUTBOX_RELAY_TEST_G16_ROWS and OUTBOX_RELAY_TEST_G16_SECONDS change the
// table's size and the window's length (defaults 1,000,000 and 60).
// OUTBOX_RELAY_TEST_G16_CONTROL=1 is the control run (bigtable.Config's
// Control: no dead letter, no console or metrics): it passes on main,
// which shows the harness counts no scan of its own.
func TestNoTableScansAtAMillionRows(t *testing.T) {
	rows := envInt(t, "OUTBOX_RELAY_TEST_G16_ROWS", 1_000_000)
	control := os.Getenv("OUTBOX_RELAY_TEST_G16_CONTROL") != ""
	window := time.Duration(envInt(t, "OUTBOX_RELAY_TEST_G16_SECONDS", 60)) * time.Second
	// Its own PostgreSQL: pg_stat_statements and auto_explain must be
	// preloaded, and the shared server's other databases stay out of the
	// numbers.
	logDir, err := bigtable.LogDir()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("PostgreSQL's log, with the window's plans: %s", bigtable.LogPath(logDir))
			return
		}
		os.RemoveAll(logDir)
	})
	pg, err := testenv.StartPostgres(testenv.PostgresOptions{Conf: bigtable.ServerConf(logDir)})
	if err != nil {
		t.Fatalf("start postgres: %v", err)
	}
	t.Cleanup(pg.Close)
	env := testenv.Shared(t)
	dbURL := pg.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	res, err := bigtable.Run(ctx, bigtable.Config{
		DBURL: dbURL, PGLog: bigtable.LogPath(logDir), NATSURL: env.NATS.URL(),
		RelayBin: mustRelayBinary(t), Dir: t.TempDir(),
		Rows: rows, Window: window, Control: control,
		Stream: stream, SubjectPrefix: prefix, Slot: uniqueName("e2e_bigtable"),
		Logf: t.Logf,
	})
	if err != nil {
		t.Fatalf("run: %v", err)
	}
	t.Logf("\n%s", res.Table())
	if res.SeqScans != 0 {
		t.Errorf("the outbox table was scanned sequentially %d times in %.0f s (%d rows read): G16 wants none; the statements marked YES above did it",
			res.SeqScans, res.WindowSeconds, res.SeqTupRead)
	}
	for _, s := range res.Statements {
		if s.Wide(res.HeapBlocks) {
			t.Errorf("a statement touched %.0f blocks per call (%.1f calls a minute), more than a twentieth of the table's %d: %s",
				s.BlocksPerCall, s.PerMinute, res.HeapBlocks, bigtable.Oneline(s.Query, 200))
		}
	}
	for _, c := range res.Cancelled {
		t.Errorf("a statement was cancelled %d times (a statement_timeout, or its caller gave up): %s", c.N, c.Query)
	}
	if res.StatementsNote != "" {
		t.Logf("no statement figures: %s", res.StatementsNote)
	}
	if res.Trickle < int(window.Seconds()*20*0.9) {
		t.Errorf("the producer committed %d rows in %v, want about %d: the test did not load the relay", res.Trickle, window, int(window.Seconds()*20))
	}
	if len(res.Missing) > 0 || len(res.Duplicates) > 0 {
		t.Errorf("of %d rows committed, %d are not in the stream (first: %v) and %d are in it twice", res.Trickle, len(res.Missing),
			res.Missing[:min(5, len(res.Missing))], len(res.Duplicates))
	}
	if res.P99MS > 250 {
		t.Errorf("p99 from commit to stored is %.0f ms (p50 %.0f ms, max %.0f ms), want at most 250 ms", res.P99MS, res.P50MS, res.MaxMS)
	}
	if len(res.FetchErrors) > 0 {
		t.Errorf("%d console or /metrics fetches failed, first: %s", len(res.FetchErrors), res.FetchErrors[0])
	}
	if control {
		return
	}
	for name, f := range res.Fetches {
		if f.N < int(window.Seconds()/5)-1 {
			t.Errorf("%s fetched %d times in %v: the test did not poll it", name, f.N, window)
		}
	}
	if !res.DeadLetterShown || !res.MetricsShown {
		t.Errorf("the dead letter %s was shown on the dead letters page: %v; /metrics counted one failed row: %v (the reads must find what they look for, not only run)",
			res.DeadLetter, res.DeadLetterShown, res.MetricsShown)
	}
}

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}
