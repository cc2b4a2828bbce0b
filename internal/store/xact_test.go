package store_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// xact_id (migration 0013) is what the watermark of --on-publish none
// judges a row by (G17), so it must be the inserting transaction's
// top-level id however the row was written:
//   - inside a savepoint the row's xmin is the subtransaction's id, which a
//     snapshot does not list: a watermark taken while the transaction was
//     still open would see xmin as finished and claim the row before it
//     was even committed. xact_id is the top-level id, which the snapshot
//     lists as running, so the row is not covered;
//   - a producer that writes xact_id itself (a copy of rows, or a hostile
//     value that would claim coverage) gets it replaced;
//   - COPY, whose batched inserts a BEFORE trigger would turn off, gets it
//     too.
func TestXactIDIsTheTopLevelTransaction(t *testing.T) {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.Shared(t).PG.CreateOutboxDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	exec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('s')`)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // rollback after commit is a no-op
	var top string
	if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&top); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SAVEPOINT a`,
		`INSERT INTO outbox (work_id, kind, payload) VALUES ('in-savepoint', 'k', '{}')`,
		`RELEASE a`,
		`INSERT INTO outbox (work_id, kind, payload, xact_id) VALUES ('forged', 'k', '{}', '3')`,
	} {
		if _, err := tx.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := tx.Conn().CopyFrom(ctx, pgx.Identifier{"outbox"}, []string{"work_id", "kind", "payload", "xact_id"},
		pgx.CopyFromRows([][]any{{"copied", "k", "{}", "5"}, {"copied-2", "k", "{}", nil}})); err != nil {
		t.Fatalf("copy: %v", err)
	}
	// A watermark recorded while the transaction is open (another session).
	exec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint())`)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	rows, err := pool.Query(ctx, `SELECT work_id, xact_id::text, xmin::text,
		pg_visible_in_snapshot(xact_id, (SELECT watermark_snapshot FROM outbox_slots)) FROM outbox ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	type got struct {
		id, xact, xmin string
		covered        bool
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (g got, err error) {
		err = r.Scan(&g.id, &g.xact, &g.xmin, &g.covered)
		return g, err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 4 {
		t.Fatalf("%d rows, want 4", len(all))
	}
	sawSub := false
	for _, g := range all {
		if g.xact != top || g.covered {
			t.Errorf("%s: xact_id %s (transaction %s), covered by a watermark taken before its commit: %v; want %s and not covered",
				g.id, g.xact, top, g.covered, top)
		}
		sawSub = sawSub || (g.id == "in-savepoint" && g.xmin != top)
	}
	if !sawSub {
		t.Errorf("the savepoint's row has the top-level id as xmin: the test does not exercise a subtransaction (%+v)", all)
	}

	// Once a watermark is taken after the commit, every row is covered.
	exec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint())`)
	var covered int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE pg_visible_in_snapshot(xact_id, (SELECT watermark_snapshot FROM outbox_slots))`).
		Scan(&covered); err != nil {
		t.Fatal(err)
	}
	if covered != 4 {
		t.Errorf("%d rows covered by a watermark taken after their commit, want 4", covered)
	}
}

// The watermark's position reads and prints as PostgreSQL's pg_lsn text.
func TestLSNText(t *testing.T) {
	for _, s := range []string{"0/0", "0/16B3748", "1/0", "FFFFFFFF/FFFFFFFF", "A/B"} {
		l, err := store.ParseLSN(s)
		if err != nil || l.String() != s {
			t.Errorf("%s: read %d (%v), printed %s", s, uint64(l), err, l.String())
		}
	}
	if l, _ := store.ParseLSN("1/2"); l != 1<<32|2 {
		t.Errorf("1/2 read as %d", uint64(l))
	}
	for _, s := range []string{"", "12", "0/", "/1", "G/1", "100000000/0"} {
		if _, err := store.ParseLSN(s); err == nil {
			t.Errorf("%q read as a position", s)
		}
	}
}
