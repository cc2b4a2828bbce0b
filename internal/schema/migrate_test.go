package schema_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// producers insert single rows into tbl from a few goroutines until stop,
// each its own transaction like an application's, and record the slowest.
type producers struct {
	stop    chan struct{}
	wg      sync.WaitGroup
	mu      sync.Mutex
	max     time.Duration
	maxAt   time.Time
	since   time.Time // inserts that started before are not counted in max
	count   atomic.Int64
	errs    atomic.Int64
	lastErr atomic.Value
}

func startProducers(t *testing.T, pool *pgxpool.Pool, tbl store.Table, n int, prefix string) *producers {
	t.Helper()
	p := &producers{stop: make(chan struct{})}
	insert := `INSERT INTO ` + tbl.String() + ` (work_id, kind, payload) VALUES ($1, 'k', '{"p": 1}')`
	for g := range n {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			for i := 0; ; i++ {
				select {
				case <-p.stop:
					return
				default:
				}
				start := time.Now()
				_, err := pool.Exec(context.Background(), insert, fmt.Sprintf("%s-%d-%d", prefix, g, i))
				took := time.Since(start)
				if err != nil {
					p.errs.Add(1)
					p.lastErr.Store(err.Error())
				} else {
					p.count.Add(1)
				}
				p.mu.Lock()
				if took > p.max && !start.Before(p.since) {
					p.max, p.maxAt = took, start
				}
				p.mu.Unlock()
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	t.Cleanup(p.halt)
	return p
}

// reset forgets the slowest insert so far and ignores the ones in flight:
// the first ones also open their connections.
func (p *producers) reset() {
	p.mu.Lock()
	p.max, p.maxAt, p.since = 0, time.Time{}, time.Now()
	p.mu.Unlock()
}

func (p *producers) halt() {
	select {
	case <-p.stop:
	default:
		close(p.stop)
	}
	p.wg.Wait()
}

// migrateRows is the populated table's size: enough that a seq scan or an
// index build under the table's lock takes seconds here (OUTBOX_RELAY_MIGRATE_ROWS
// to try others).
func migrateRows(t *testing.T) int {
	if v := os.Getenv("OUTBOX_RELAY_MIGRATE_ROWS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil {
			t.Fatalf("OUTBOX_RELAY_MIGRATE_ROWS=%q: %v", v, err)
		}
		return n
	}
	return 600_000
}

// An install adopting a populated table runs every migration on it while
// producers insert (issue 21). No INSERT waits longer than the lock
// timeout (plus a margin for this shared 2-core machine); before, all
// migrations ran in one transaction that held 0001's index build's SHARE
// lock and, from 0005 to its commit, the table's ACCESS EXCLUSIVE lock,
// through 0006's validation and index build, and every INSERT waited all
// that time. Afterwards every migration is recorded, every
// index is valid and the state check validated.
func TestMigratePopulatedTableBesideProducers(t *testing.T) {
	const lockTimeout = 500 * time.Millisecond
	const margin = time.Second
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	all, err := schema.Migrations(tbl)
	if err != nil {
		t.Fatal(err)
	}
	// The table as 0001 creates it but without its index, like one made by
	// hand from the design before adopting the relay; migrate then runs
	// every migration, 0001 too.
	createTable, _, ok := strings.Cut(all[0].SQL, "\nCREATE INDEX")
	if !ok {
		t.Fatalf("0001 has no CREATE INDEX to leave out: %s", all[0].SQL)
	}
	if _, err := conn.Exec(ctx, createTable); err != nil {
		t.Fatal(err)
	}
	rows := migrateRows(t)
	load := time.Now()
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state, published_at, stream_seq)
		SELECT 'old-' || g, 'order.created', jsonb_build_object('order', g, 'note', repeat('x', 150)), 'published', now(), g
		FROM generate_series(1, $1::int) g`, rows); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `VACUUM ANALYZE outbox`); err != nil {
		t.Fatal(err)
	}
	t.Logf("loaded %d rows in %s", rows, time.Since(load).Round(time.Millisecond))

	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	prod := startProducers(t, pool, tbl, 4, "new")
	time.Sleep(300 * time.Millisecond) // producers at work before migrate starts
	prod.reset()
	before := prod.count.Load()
	var steps []string
	start := time.Now()
	applied, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{
		LockTimeout: lockTimeout,
		Progress:    func(m string) { steps = append(steps, time.Since(start).Round(time.Millisecond).String()+" "+m) },
	})
	took := time.Since(start)
	during := prod.count.Load() - before
	time.Sleep(300 * time.Millisecond)
	prod.halt()
	if err != nil {
		t.Fatalf("migrate: %v", err)
	}
	t.Logf("migrate applied %d migrations in %s; %d inserts meanwhile; slowest insert %s at +%s of migrate; steps:\n%s",
		len(applied), took.Round(time.Millisecond), during, prod.max.Round(time.Millisecond),
		prod.maxAt.Sub(start).Round(time.Millisecond), strings.Join(steps, "\n"))
	if n := prod.errs.Load(); n > 0 {
		t.Errorf("%d inserts failed, last: %v", n, prod.lastErr.Load())
	}
	if during == 0 {
		t.Fatalf("no insert completed while migrate ran: the producers did not run beside it")
	}
	if prod.max > lockTimeout+margin {
		t.Errorf("an INSERT waited %s (at +%s of migrate); want at most the lock timeout %s + %s",
			prod.max.Round(time.Millisecond), prod.maxAt.Sub(start).Round(time.Millisecond), lockTimeout, margin)
	}
	if len(applied) != len(all) {
		t.Errorf("applied %d migrations, want all %d", len(applied), len(all))
	}
	checkMigrated(t, conn, tbl, len(all))
	var total int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox`).Scan(&total); err != nil {
		t.Fatal(err)
	}
	if want := int64(rows) + prod.count.Load(); total != want {
		t.Errorf("table holds %d rows, want %d loaded + %d inserted", total, rows, prod.count.Load())
	}
}

// checkMigrated asserts every migration recorded, every index of the table
// valid (and the ones the migrations build present), and the state check
// validated.
func checkMigrated(t *testing.T, conn *pgx.Conn, tbl store.Table, migrations int) {
	t.Helper()
	ctx := context.Background()
	var recorded int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox_relay_migrations WHERE target = $1`, tbl.Qualified()).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded != migrations {
		t.Errorf("%d migrations recorded, want %d", recorded, migrations)
	}
	rows, err := conn.Query(ctx, `SELECT c.relname, i.indisvalid AND i.indisready FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
		WHERE i.indrelid = to_regclass($1) ORDER BY 1`, tbl.String())
	if err != nil {
		t.Fatal(err)
	}
	valid := map[string]bool{}
	for rows.Next() {
		var name string
		var ok bool
		if err := rows.Scan(&name, &ok); err != nil {
			t.Fatal(err)
		}
		valid[name] = ok
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	for name, ok := range valid {
		if !ok {
			t.Errorf("index %s is INVALID", name)
		}
	}
	for _, want := range []string{tbl.Name + "_pkey", tbl.Name + "_poll_idx", tbl.Name + "_aggregate_idx"} {
		if _, ok := valid[want]; !ok {
			t.Errorf("index %s missing; indexes: %v", want, valid)
		}
	}
	var validated bool
	if err := conn.QueryRow(ctx, `SELECT convalidated FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2`,
		tbl.String(), tbl.Name+"_state_check").Scan(&validated); err != nil {
		t.Fatalf("state check: %v", err)
	}
	if !validated {
		t.Errorf("%s_state_check is NOT VALID, want validated", tbl.Name)
	}
}

// A transaction holding the table (here a report's open transaction that
// read it) makes migrate give up within about the lock timeout, naming the
// holder and what to do, instead of queueing the producers behind it for
// as long as it lasts; nothing of the migration it waited in is applied,
// and a retry after the holder ends applies the rest.
func TestMigrateGivesUpOnALockAndResumes(t *testing.T) {
	const lockTimeout = time.Second
	const margin = 1500 * time.Millisecond
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := store.Table{Schema: "public", Name: "outbox"}
	all, err := schema.Migrations(tbl)
	if err != nil {
		t.Fatal(err)
	}
	// Everything before 0010, whose ADD COLUMN needs the table's ACCESS
	// EXCLUSIVE lock.
	var first []schema.Migration
	for _, m := range all {
		if m.Version < 10 {
			first = append(first, m)
		}
	}
	if _, err := schema.MigrateOnly(ctx, conn, tbl, schema.MigrateOptions{}, first); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	holder := connect(t, url)
	var holderPID int32
	if err := holder.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&holderPID); err != nil {
		t.Fatal(err)
	}
	htx, err := holder.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := htx.Exec(ctx, `SELECT count(*) FROM outbox`); err != nil {
		t.Fatal(err)
	}
	// The holder ends on its own after a while, so that a migrate that
	// waits for it (no lock timeout) ends too, late.
	const holdFor = 6 * time.Second
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(holdFor)
		_ = htx.Commit(context.Background())
	}()
	time.Sleep(lockTimeout + 200*time.Millisecond) // the holder's transaction is older than the timeout

	prod := startProducers(t, pool, tbl, 2, "p")
	time.Sleep(200 * time.Millisecond)
	prod.reset()
	start := time.Now()
	applied, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{LockTimeout: lockTimeout})
	took := time.Since(start)
	time.Sleep(200 * time.Millisecond)
	prod.halt()
	t.Logf("migrate returned after %s: %v; slowest insert %s", took.Round(time.Millisecond), err, prod.max.Round(time.Millisecond))
	if err == nil {
		t.Fatalf("migrate succeeded after %s (applied %d) while a transaction held the table; want it to give up after the lock timeout %s",
			took.Round(time.Millisecond), len(applied), lockTimeout)
	}
	if took > lockTimeout+margin {
		t.Errorf("migrate gave up after %s, want within the lock timeout %s + %s", took.Round(time.Millisecond), lockTimeout, margin)
	}
	for _, want := range []string{
		"apply 0010_stream_name (rolled back: nothing of it is applied)",
		"lock_timeout 1s (--lock-timeout)",
		fmt.Sprintf("pid %d holds AccessShareLock on outbox", holderPID),
		"idle in transaction",
		"run migrate again; it resumes here",
		"lock timeout (SQLSTATE 55P03)",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q\nlacks %q", err, want)
		}
	}
	if len(applied) != 0 {
		t.Errorf("applied %d migrations before giving up, want none", len(applied))
	}
	if prod.max > lockTimeout+margin {
		t.Errorf("an INSERT waited %s; want at most the lock timeout %s + %s", prod.max.Round(time.Millisecond), lockTimeout, margin)
	}
	if prod.count.Load() == 0 || prod.errs.Load() > 0 {
		t.Errorf("producers: %d inserts, %d failed (%v); want inserts and no failure", prod.count.Load(), prod.errs.Load(), prod.lastErr.Load())
	}
	var hasColumn bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM information_schema.columns WHERE table_name = 'outbox' AND column_name = 'stream_name')`).Scan(&hasColumn); err != nil {
		t.Fatal(err)
	}
	if hasColumn {
		t.Errorf("stream_name exists after 0010 gave up; want it rolled back")
	}

	<-released
	applied, err = schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{LockTimeout: lockTimeout})
	if err != nil {
		t.Fatalf("migrate after the holder ended: %v", err)
	}
	if len(applied) != len(all)-len(first) || applied[0].Version != 10 {
		t.Errorf("retry applied %d migrations starting at %d, want the %d from 0010", len(applied), applied[0].Version, len(all)-len(first))
	}
	checkMigrated(t, conn, tbl, len(all))
}

// An index build that fails (here a unique index over duplicates) leaves
// an INVALID index and the migration unrecorded; once the cause is gone the
// next migrate drops that index and builds it again. A validation that
// rows fail names them and leaves the constraint NOT VALID and the
// migration unrecorded; after the rows are corrected the next migrate
// validates it.
func TestMigrateRetriesIndexAndValidation(t *testing.T) {
	url := testenv.Shared(t).PG.CreateOutboxDatabase(t)
	conn := connect(t, url)
	ctx := context.Background()
	tbl := testenv.OutboxTable
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('a', 'k', '{}'), ('b', 'k', '{}'), ('bad-1', 'bad', '{}')`); err != nil {
		t.Fatal(err)
	}
	index, err := schema.NewMigration(9001, "test_unique_kind", `-- outbox-relay: no-transaction
CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS outbox_test_kind_idx ON "public"."outbox" (kind);
`)
	if err != nil {
		t.Fatal(err)
	}
	check, err := schema.NewMigration(9002, "test_kind_check", `-- outbox-relay: no-transaction
ALTER TABLE "public"."outbox" DROP CONSTRAINT IF EXISTS outbox_test_kind_check,
    ADD CONSTRAINT outbox_test_kind_check CHECK (kind <> 'bad') NOT VALID;
ALTER TABLE "public"."outbox" VALIDATE CONSTRAINT outbox_test_kind_check;
`)
	if err != nil {
		t.Fatal(err)
	}
	recorded := func(v int) bool {
		var ok bool
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM outbox_relay_migrations WHERE target = 'public.outbox' AND version = $1)`, v).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		return ok
	}
	indexValid := func() (exists, valid bool) {
		err := conn.QueryRow(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass('outbox_test_kind_idx')`).Scan(&valid)
		if err == pgx.ErrNoRows {
			return false, false
		}
		if err != nil {
			t.Fatal(err)
		}
		return true, valid
	}
	var steps []string
	opts := schema.MigrateOptions{Progress: func(m string) { steps = append(steps, m) }}

	_, err = schema.MigrateOnly(ctx, conn, tbl, opts, []schema.Migration{index})
	if err == nil || !strings.Contains(err.Error(), "apply 9001_test_unique_kind (statement 1 of 1") || !strings.Contains(err.Error(), "23505") {
		t.Fatalf("unique index over duplicates: %v; want the build's unique violation", err)
	}
	if exists, valid := indexValid(); !exists || valid || recorded(9001) {
		t.Fatalf("after the failed build: index exists %v, valid %v, recorded %v; want an INVALID index, unrecorded", exists, valid, recorded(9001))
	}
	if _, err := conn.Exec(ctx, `DELETE FROM outbox WHERE work_id IN ('b')`); err != nil {
		t.Fatal(err)
	}
	steps = nil
	if _, err := schema.MigrateOnly(ctx, conn, tbl, opts, []schema.Migration{index}); err != nil {
		t.Fatalf("retry: %v", err)
	}
	if exists, valid := indexValid(); !exists || !valid || !recorded(9001) {
		t.Errorf("after the retry: index exists %v, valid %v, recorded %v; want valid and recorded", exists, valid, recorded(9001))
	}
	if len(steps) != 2 || !strings.Contains(steps[0], "dropping the invalid index outbox_test_kind_idx") || !strings.Contains(steps[1], "building index outbox_test_kind_idx") {
		t.Errorf("retry steps %q; want the invalid index dropped, then built", steps)
	}

	_, err = schema.MigrateOnly(ctx, conn, tbl, opts, []schema.Migration{check})
	for _, want := range []string{"validate constraint outbox_test_kind_check", `work_id ["bad-1"]`, "stays NOT VALID", "run migrate again", "23514"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("validation over a bad row: %v\nwant it to say %q", err, want)
		}
	}
	var validated bool
	if err := conn.QueryRow(ctx, `SELECT convalidated FROM pg_constraint WHERE conname = 'outbox_test_kind_check'`).Scan(&validated); err != nil {
		t.Fatalf("the constraint is gone after the failed validation: %v", err)
	}
	if validated || recorded(9002) {
		t.Errorf("after the failed validation: validated %v, recorded %v; want NOT VALID, unrecorded", validated, recorded(9002))
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('bad-2', 'bad', '{}')`); err == nil {
		t.Errorf("a new row violating the NOT VALID constraint was accepted")
	}
	if _, err := conn.Exec(ctx, `UPDATE outbox SET kind = 'fixed' WHERE work_id = 'bad-1'`); err != nil {
		t.Fatal(err)
	}
	if _, err := schema.MigrateOnly(ctx, conn, tbl, opts, []schema.Migration{check}); err != nil {
		t.Fatalf("retry after fixing the row: %v", err)
	}
	if err := conn.QueryRow(ctx, `SELECT convalidated FROM pg_constraint WHERE conname = 'outbox_test_kind_check'`).Scan(&validated); err != nil || !validated || !recorded(9002) {
		t.Errorf("after the retry: validated %v (%v), recorded %v; want validated and recorded", validated, err, recorded(9002))
	}
}
