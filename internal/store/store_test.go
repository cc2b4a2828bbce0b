package store_test

import (
	"context"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func connect(t *testing.T, url string) *pgx.Conn { return testenv.Connect(t, url) }

// Two processes migrating at once both succeed, and the second run applies
// nothing; an odd schema and table name are quoted everywhere.
func TestMigrateConcurrentAndQuoted(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	tbl, err := store.ParseTable(`Sales-Ops.Order "Events"`)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	applied := make([]int, 4)
	errs := make([]error, 4)
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := pgx.Connect(context.Background(), url)
			if err != nil {
				errs[i] = err
				return
			}
			defer conn.Close(context.Background())
			migs, err := schema.Migrate(context.Background(), conn, tbl)
			applied[i], errs[i] = len(migs), err
		}()
	}
	wg.Wait()
	total := 0
	for i := range 4 {
		if errs[i] != nil {
			t.Fatalf("migrate %d: %v", i, errs[i])
		}
		total += applied[i]
	}
	all, _ := schema.Migrations(tbl)
	if total != len(all) {
		t.Errorf("migrations applied %d times in all, want each once (%d)", total, len(all))
	}
	conn := connect(t, url)
	var cols int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2`,
		"Sales-Ops", `Order "Events"`).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	if cols < len(store.RequiredColumns) {
		t.Errorf("table has %d columns, want at least %d", cols, len(store.RequiredColumns))
	}
	if migs, err := schema.Migrate(context.Background(), conn, tbl); err != nil || len(migs) != 0 {
		t.Errorf("second migrate applied %d, err %v; want 0, nil", len(migs), err)
	}
}

func TestTableConstraints(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	if _, err := schema.Migrate(ctx, conn, store.Table{Schema: "public", Name: "outbox"}); err != nil {
		t.Fatal(err)
	}
	bad := map[string]string{
		"unknown state":           `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('a', 'k', '{}', 'done')`,
		"running without a lease": `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('b', 'k', '{}', 'running')`,
		"headers not an object":   `INSERT INTO outbox (work_id, kind, payload, headers) VALUES ('c', 'k', '{}', '[1]')`,
		"empty work_id":           `INSERT INTO outbox (work_id, kind, payload) VALUES ('', 'k', '{}')`,
	}
	for what, sql := range bad {
		if _, err := conn.Exec(ctx, sql); err == nil {
			t.Errorf("%s: insert succeeded, want a CHECK violation", what)
		}
	}
	// poll_at follows state: NULL for ready rows, available_at for scheduled.
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('r', 'k', '{}'), ('s', 'k', '{}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `UPDATE outbox SET state = 'scheduled' WHERE work_id = 's'`); err != nil {
		t.Fatal(err)
	}
	var rNull, sSet bool
	if err := conn.QueryRow(ctx, `SELECT (SELECT poll_at IS NULL FROM outbox WHERE work_id = 'r'), (SELECT poll_at = available_at FROM outbox WHERE work_id = 's')`).Scan(&rNull, &sSet); err != nil {
		t.Fatal(err)
	}
	if !rNull || !sSet {
		t.Errorf("poll_at: ready row NULL=%v, scheduled row = available_at=%v; want both true", rNull, sSet)
	}
}

// The settle statement must use the primary key however large the table:
// a sequential scan per batch would make the CDC path crawl.
func TestSettleUsesPrimaryKey(t *testing.T) {
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.Migrate(ctx, conn, tbl); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq)
		SELECT 'w' || g, 'k', '{}', 'published', now(), g FROM generate_series(1, 50000) g; ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('new-1', 'k', '{}'), ('new-2', 'k', '{}')`); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var xid uint32
	if err := pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM outbox WHERE work_id = 'new-1'`).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	for _, policy := range []store.Policy{store.PolicyMark, store.PolicyDelete} {
		plan := store.ExplainSettle(ctx, t, pool, tbl, policy)
		if seqScanOnOutbox.MatchString(plan) {
			t.Errorf("%s: settle plan scans the table:\n%s", policy, plan)
		}
	}
	s := store.New(pool, tbl, store.PolicyMark)
	settled, err := s.SettleRows(ctx, []store.Settle{
		{WorkID: "new-1", Xid: xid, Outcome: store.Published, Seq: 7},
		{WorkID: "w1", Xid: xid, Outcome: store.Published, Seq: 8}, // already published: settled, unchanged
		{WorkID: "new-2", Xid: xid, Outcome: store.Delayed},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !settled[0] || !settled[1] || !settled[2] {
		t.Fatalf("settled = %v, want all true", settled)
	}
	var st1, st2 string
	var seq1, seqW1 int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT state FROM outbox WHERE work_id='new-1'), (SELECT stream_seq FROM outbox WHERE work_id='new-1'),
		(SELECT state FROM outbox WHERE work_id='new-2'), (SELECT stream_seq FROM outbox WHERE work_id='w1')`).Scan(&st1, &seq1, &st2, &seqW1); err != nil {
		t.Fatal(err)
	}
	if st1 != "published" || seq1 != 7 || st2 != "scheduled" || seqW1 != 1 {
		t.Errorf("new-1 %s/%d, new-2 %s, w1 seq %d; want published/7, scheduled, 1", st1, seq1, st2, seqW1)
	}
}

// An aggregate prints with both parts quoted: a slash in either part, or a
// quote, cannot make two aggregates read the same, and control and bidi
// characters from the row are escaped.
func TestAggregateKeyString(t *testing.T) {
	for _, c := range []struct {
		k    store.AggregateKey
		want string
	}{
		{store.AggregateKey{Type: "a/b", ID: "c"}, `"a/b"/"c"`},
		{store.AggregateKey{Type: "a", ID: "b/c"}, `"a"/"b/c"`},
		{store.AggregateKey{Type: `a"/"b`, ID: "c"}, `"a\"/\"b"/"c"`},
		{store.AggregateKey{Type: "a", ID: `b"/"c`}, `"a"/"b\"/\"c"`},
		{store.AggregateKey{Type: "order", ID: "7\u202e1"}, `"order"/"7\u202e1"`},
	} {
		if got := c.k.String(); got != c.want {
			t.Errorf("%#v: %s, want %s", c.k, got, c.want)
		}
	}
}
