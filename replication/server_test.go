package replication_test

import (
	"context"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/devenv"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/replication"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// The package against a real server, on whichever PostgreSQL the run asks
// for (make test-pg-versions runs it on 16, 17 and 18): a slot and its
// publication are created, committed rows come out decoded exactly as
// written, rolled-back and non-ready rows do not, and the slot resumes after
// the position the caller confirmed and not a byte later.
// outboxDatabase is a new database with the outbox table, and a
// connection to it closed at the test's end.
func outboxDatabase(ctx context.Context, t *testing.T) (string, *pgx.Conn) {
	t.Helper()
	url := testenv.Shared(t).PG.CreateOutboxDatabase(t)
	db, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close(context.Background()) })
	return url, db
}

func TestStreamAgainstServer(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url, db := outboxDatabase(ctx, t)

	var versionNum int
	if err := db.QueryRow(ctx, `SELECT current_setting('server_version_num')::int`).Scan(&versionNum); err != nil {
		t.Fatal(err)
	}
	if want := os.Getenv(devenv.EnvPGVersion); want != "" {
		if w, _ := strconv.Atoi(want); versionNum/10000 != w {
			t.Fatalf("asked for PostgreSQL %s, the server is %d", want, versionNum)
		}
	}
	t.Logf("PostgreSQL %d", versionNum)
	if err := replication.CheckServer(ctx, db); err != nil {
		t.Fatalf("check server: %v", err)
	}
	pub, err := replication.EnsurePublication(ctx, db, "repl_test", "public", "outbox")
	if err != nil {
		t.Fatal(err)
	}
	if !pub.Filtered {
		t.Fatal("a new publication has no row filter: scheduled rows would be streamed")
	}

	conn, err := replication.Connect(ctx, url, "repl-test")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	created, err := replication.CreateSlot(ctx, conn, "repl_test", false)
	if err != nil {
		t.Fatal(err)
	}
	if created.ConsistentPoint == 0 || created.Snapshot == "" {
		t.Fatalf("created slot = %+v, want a consistent point and a snapshot", created)
	}

	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := db.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// Committed: two rows, one with every optional column.
	exec(`BEGIN`)
	exec(`INSERT INTO outbox (work_id, kind, subject, payload, headers, aggregate_type, aggregate_id, aggregate_seq, expires_at)
		VALUES ('r1', 'order.created', 'app.orders', '{"s": "x", "a": 1}', '{"traceparent": "00-1-2-01"}', 'order', '42', 1, '2030-01-02 03:04:05.123456+00')`)
	exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('r2', 'order.paid', '[1, 2]')`)
	exec(`COMMIT`)
	// Rolled back: never streamed (G2).
	exec(`BEGIN`)
	exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('rolled-back', 'k', '{}')`)
	exec(`ROLLBACK`)
	// A scheduled row belongs to the poller; the publication's filter keeps
	// it off the stream.
	exec(`BEGIN`)
	exec(`INSERT INTO outbox (work_id, kind, payload, state) VALUES ('sched', 'k', '{}', 'scheduled')`)
	exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('r3', 'k', '"three"')`)
	exec(`COMMIT`)
	var r1Available time.Time
	if err := db.QueryRow(ctx, `SELECT available_at FROM outbox WHERE work_id = 'r1'`).Scan(&r1Available); err != nil {
		t.Fatal(err)
	}

	txs := streamTransactions(ctx, t, conn, created.ConsistentPoint, 2, 0)
	if got := workIDs(txs[0]); got != "r1,r2" {
		t.Fatalf("first transaction's rows = %s, want r1,r2", got)
	}
	if got := workIDs(txs[1]); got != "r3" {
		t.Fatalf("second transaction's rows = %s, want r3 (not the rolled-back or scheduled ones)", got)
	}
	r1 := txs[0].rows[0]
	if r1.Kind != "order.created" || r1.Subject != "app.orders" || string(r1.Payload) != `{"a": 1, "s": "x"}` ||
		string(r1.Headers) != `{"traceparent": "00-1-2-01"}` || r1.State != "ready" {
		t.Errorf("r1 decoded as %+v", r1)
	}
	if r1.Aggregate == nil || *r1.Aggregate != (replication.Aggregate{Type: "order", ID: "42", Seq: 1}) {
		t.Errorf("r1's aggregate = %+v, want order/42/1", r1.Aggregate)
	}
	if want := time.Date(2030, 1, 2, 3, 4, 5, 123456000, time.UTC); !r1.ExpiresAt.Equal(want) {
		t.Errorf("r1's deadline = %s, want %s", r1.ExpiresAt, want)
	}
	if !r1.AvailableAt.Equal(r1Available) {
		t.Errorf("r1's available_at = %s, the table holds %s", r1.AvailableAt, r1Available)
	}
	if r2 := txs[0].rows[1]; r2.Subject != "" || r2.Headers != nil || r2.Aggregate != nil || !r2.ExpiresAt.IsZero() {
		t.Errorf("r2's optional columns decoded as set: %+v", r2)
	}
	if !(created.ConsistentPoint <= txs[0].commit && txs[0].commit < txs[0].end && txs[0].end <= txs[1].commit && txs[1].commit < txs[1].end) {
		t.Errorf("LSNs out of order: consistent %s, first %s-%s, second %s-%s",
			created.ConsistentPoint, txs[0].commit, txs[0].end, txs[1].commit, txs[1].end)
	}

	// The slot holds exactly what the caller confirmed: the first
	// transaction, not the second.
	waitSlotIdle(ctx, t, db, "repl_test")
	slot, err := replication.LookupSlot(ctx, db, "repl_test")
	if err != nil {
		t.Fatal(err)
	}
	if slot.ConfirmedFlush != txs[0].end {
		t.Fatalf("slot confirmed %s after the first transaction (ending %s) was confirmed", slot.ConfirmedFlush, txs[0].end)
	}
	// A new session resumes there: the second transaction again, only it.
	conn2, err := replication.Connect(ctx, url, "repl-test-2")
	if err != nil {
		t.Fatal(err)
	}
	defer conn2.Close(context.Background())
	again := streamTransactions(ctx, t, conn2, slot.ConfirmedFlush, 1, 1)
	if got := workIDs(again[0]); got != "r3" || again[0].end != txs[1].end {
		t.Fatalf("after a restart the slot sent %s ending %s, want r3 ending %s", got, again[0].end, txs[1].end)
	}
	waitSlotIdle(ctx, t, db, "repl_test")
	if slot, err = replication.LookupSlot(ctx, db, "repl_test"); err != nil {
		t.Fatal(err)
	}
	if slot.ConfirmedFlush < txs[1].end {
		t.Fatalf("slot confirmed %s after everything (ending %s) was confirmed", slot.ConfirmedFlush, txs[1].end)
	}
	if err := replication.DropSlot(ctx, db, "repl_test"); err != nil {
		t.Fatal(err)
	}
}

type streamedTx struct {
	rows        []*replication.Row
	commit, end pglogrepl.LSN
}

func workIDs(tx streamedTx) string {
	s := ""
	for i, r := range tx.rows {
		if i > 0 {
			s += ","
		}
		s += r.WorkID
	}
	return s
}

// streamTransactions streams from the slot until n transactions with rows
// have come, confirms the first `confirm` of them (at least one), stops the
// stream and returns them.
func streamTransactions(ctx context.Context, t *testing.T, conn replication.PgConn, from pglogrepl.LSN, n, confirm int) []streamedTx {
	t.Helper()
	if confirm == 0 {
		confirm = 1
	}
	s, err := replication.Start(ctx, conn, replication.StreamConfig{
		Slot: "repl_test", Publication: "repl_test",
		Table:          replication.Table{Schema: "public", Name: "outbox"},
		StatusInterval: time.Second, Logger: zerolog.Nop(),
	}, from, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan []replication.Event)
	confirms := make(chan pglogrepl.LSN, n)
	stop := make(chan struct{})
	runErr := make(chan error, 1)
	go func() { runErr <- s.Run(ctx, out, confirms, stop) }()

	var txs []streamedTx
	var cur streamedTx
	timeout := time.After(30 * time.Second)
	for len(txs) < n {
		select {
		case batch := <-out:
			for _, ev := range batch {
				switch ev.Type {
				case replication.EventBegin:
					cur = streamedTx{commit: ev.CommitLSN}
				case replication.EventRow:
					r := *ev.Row
					cur.rows = append(cur.rows, &r)
				case replication.EventCommit:
					cur.end = ev.EndLSN
					if len(cur.rows) > 0 {
						txs = append(txs, cur)
					}
				}
			}
		case err := <-runErr:
			t.Fatalf("stream ended early: %v", err)
		case <-timeout:
			t.Fatalf("after 30s the stream had sent %d of %d transactions", len(txs), n)
		}
	}
	for _, tx := range txs[:min(confirm, len(txs))] {
		confirms <- tx.end
	}
	close(stop)
	close(confirms)
	go func() {
		for range out { // the stream may still be handing over a batch
		}
	}()
	if err := <-runErr; err != nil {
		t.Fatalf("stream stop: %v", err)
	}
	close(out)
	conn.Close(ctx)
	return txs
}

// waitSlotIdle waits until no walsender streams the slot, so its
// confirmed position is final.
func waitSlotIdle(ctx context.Context, t *testing.T, db *pgx.Conn, slot string) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, "slot "+slot+" released", func() (bool, error) {
		si, err := replication.LookupSlot(ctx, db, slot)
		return err == nil && si.Exists && !si.Active, err
	})
}
