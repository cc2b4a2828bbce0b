package store_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// partitions lists the partitions of tbl attached now: name -> DEFAULT or
// "FROM ... TO ..." bound.
func partitions(t *testing.T, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, tbl string) map[string]string {
	t.Helper()
	rows, err := q.Query(context.Background(), `SELECT c.relname::text, pg_get_expr(c.relpartbound, c.oid)
		FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass`, tbl)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for rows.Next() {
		var n, b string
		if err := rows.Scan(&n, &b); err != nil {
			t.Fatal(err)
		}
		out[n] = b
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func partName(tbl string, start time.Time) string {
	return tbl + "_p" + start.UTC().Format("2006010215")
}

// migrate --partition-interval 1h makes a table partitioned by created_at,
// with the current hour's partition and PartitionsAhead(1h) more, each
// with fillfactor 50, a DEFAULT partition, every index of a plain table
// (aggregate_idx not unique) and the triggers working in the partitions.
// Run again it changes nothing; with another interval it is refused, and on
// a plain table --partition-interval is refused naming the procedure.
func TestMigratePartitioned(t *testing.T) {
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	before := time.Now().UTC().Truncate(time.Hour)
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatalf("migrate --partition-interval 1h: %v", err)
	}
	var kind string
	if err := conn.QueryRow(ctx, `SELECT relkind::text FROM pg_class WHERE oid = 'outbox'::regclass`).Scan(&kind); err != nil || kind != "p" {
		t.Fatalf("relkind %q (%v), want p", kind, err)
	}
	ahead := schema.PartitionsAhead(time.Hour)
	if ahead < 25 {
		t.Fatalf("PartitionsAhead(1h) = %d: a relay stopped for a day would leave producers without a partition", ahead)
	}
	parts := partitions(t, conn, "outbox")
	if len(parts) != ahead+2 {
		t.Errorf("%d partitions, want %d (this hour, %d ahead, DEFAULT): %v", len(parts), ahead+2, ahead, parts)
	}
	if parts["outbox_default"] != "DEFAULT" {
		t.Errorf("no DEFAULT partition: %v", parts)
	}
	// The hour may have turned during migrate: the first partition is this
	// hour's or the next one's.
	for _, start := range []time.Time{before.Add(time.Hour), before.Add(time.Duration(ahead) * time.Hour)} {
		if _, ok := parts[partName("outbox", start)]; !ok {
			t.Errorf("no partition %s: %v", partName("outbox", start), parts)
		}
	}
	var noFill int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = 'outbox'::regclass AND NOT coalesce('fillfactor=50' = ANY (c.reloptions), false)`).Scan(&noFill); err != nil || noFill != 0 {
		t.Errorf("%d partitions without fillfactor 50 (%v)", noFill, err)
	}
	rows, err := conn.Query(ctx, `SELECT c.relname::text || CASE WHEN i.indisunique THEN ' unique' ELSE '' END
		FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'outbox'::regclass ORDER BY 1`)
	idx, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"outbox_aggregate_held_idx", "outbox_aggregate_idx", "outbox_created_idx", "outbox_dead_letter_idx", "outbox_expires_idx", "outbox_parked_idx", "outbox_pkey unique", "outbox_poll_idx"}
	if !slices.Equal(idx, want) {
		t.Errorf("indexes %v, want %v", idx, want)
	}
	// Triggers are cloned into the partitions: parked is kept, bad times
	// refused.
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('f', 'k', '{}', 'failed')`); err != nil {
		t.Fatal(err)
	}
	var parked *string
	if err := conn.QueryRow(ctx, `SELECT parked FROM outbox WHERE work_id = 'f'`).Scan(&parked); err != nil || parked == nil || *parked != "failed" {
		t.Errorf("parked of a failed row: %v (%v), want failed", parked, err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, available_at) VALUES ('inf', 'k', '{}', 'infinity')`); err == nil {
		t.Errorf("a row with available_at infinity was accepted")
	}

	if migs, err := schema.Migrate(ctx, conn, tbl); err != nil || len(migs) != 0 {
		t.Errorf("migrate again: applied %d, %v; want nothing", len(migs), err)
	}
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Errorf("migrate again with the same interval: %v", err)
	}
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: 24 * time.Hour}); err == nil || !strings.Contains(err.Error(), "partitioned by 1h0m0s") {
		t.Errorf("migrate with another interval: %v, want refused", err)
	}
	l, err := schema.ReadLayout(ctx, conn, tbl)
	if err != nil || !l.Exists || l.PartitionInterval != time.Hour {
		t.Errorf("layout %+v, %v; want partitioned by 1h", l, err)
	}

	plain := store.Table{Schema: "public", Name: "plain"}
	if _, err := schema.Migrate(ctx, conn, plain); err != nil {
		t.Fatal(err)
	}
	_, err = schema.MigrateWith(ctx, conn, plain, schema.MigrateOptions{PartitionInterval: time.Hour})
	if !errors.Is(err, schema.ErrConvertPlain) || !strings.Contains(err.Error(), "docs/partitions.md") {
		t.Errorf("--partition-interval on a plain table: %v, want ErrConvertPlain naming the procedure", err)
	}

	// The grants script gives the relay the partition maker and producers
	// the repeat check; run as the owner it succeeds.
	roles := schema.Roles{Relay: "part_relay", Producer: "part_producer", Operator: "part_operator"}
	script, err := schema.Grants(tbl, roles)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, script); err != nil {
		t.Fatalf("grants: %v", err)
	}
	t.Cleanup(func() {
		// Roles are cluster-wide: drop them once the database is gone.
		c, err := pgx.Connect(context.Background(), testenv.Shared(t).PG.URL("postgres"))
		if err != nil {
			return
		}
		defer c.Close(context.Background())
		for _, r := range []string{roles.Relay, roles.Producer, roles.Operator} {
			_, _ = c.Exec(context.Background(), `DROP OWNED BY `+pgx.Identifier{r}.Sanitize()+`; DROP ROLE IF EXISTS `+pgx.Identifier{r}.Sanitize())
		}
	})
	asRole := func(role string) *pgx.Conn {
		return connect(t, strings.Replace(url, "postgres://postgres@", "postgres://"+role+"@", 1))
	}
	// The producer enqueues, and a repeat is found, with its grants alone.
	producer := asRole(roles.Producer)
	row := enqueue.Row{WorkID: "granted", Kind: "k", Payload: `{}`}
	for i, want := range []bool{true, false} {
		if ok, err := enqueue.One(ctx, producer, tbl, row); err != nil || ok != want {
			t.Errorf("producer's enqueue %d: inserted %v, %v; want %v", i+1, ok, err, want)
		}
	}
	// The relay reads the layout and makes partitions with its grants alone.
	relayConn := asRole(roles.Relay)
	if l, err := schema.ReadLayout(ctx, relayConn, tbl); err != nil || l.PartitionInterval != time.Hour {
		t.Errorf("relay reads the layout: %+v, %v", l, err)
	}
	if _, err := store.AddPartitions(ctx, relayConn, tbl, time.Second); err != nil {
		t.Errorf("relay makes partitions: %v", err)
	}
}

// migrate --partition-interval 5m (the floor) names partitions to the
// minute and makes 25 ahead, not a day's 289: below an hour the cover is
// 24 intervals, so the probes per lookup stay in the tens. A table made
// when the floor was an hour (0014's CHECK of 3600 seconds) is relaxed by
// 0015: its interval may then be set to 5 minutes.
func TestShortPartitionInterval(t *testing.T) {
	ctx := context.Background()
	conn := connect(t, testenv.Shared(t).PG.CreateDatabase(t))
	if got := schema.PartitionsAhead(5 * time.Minute); got != 25 {
		t.Fatalf("PartitionsAhead(5m) = %d, want 25 (24 intervals and one more)", got)
	}
	if _, err := schema.ParsePartitionInterval("4m"); err == nil || !strings.Contains(err.Error(), "at least 5m0s") {
		t.Errorf("--partition-interval 4m: %v, want refused", err)
	}
	tbl := store.Table{Schema: "public", Name: "short"}
	before := time.Now().UTC().Truncate(5 * time.Minute)
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: 5 * time.Minute}); err != nil {
		t.Fatalf("migrate --partition-interval 5m: %v", err)
	}
	parts := partitions(t, conn, "short")
	if len(parts) != 27 {
		t.Errorf("%d partitions, want 27 (this interval, 25 ahead, DEFAULT): %v", len(parts), parts)
	}
	// The interval may have turned during migrate.
	name := func(at time.Time) string { return "short_p" + at.Format("200601021504") }
	if _, ok := parts[name(before.Add(5*time.Minute))]; !ok {
		t.Errorf("no partition %s: %v", name(before.Add(5*time.Minute)), parts)
	}
	if _, ok := parts[name(before.Add(26*5*time.Minute))]; ok {
		t.Errorf("partition %s is past the 25 ahead: %v", name(before.Add(26*5*time.Minute)), parts)
	}

	// A table from before 0015: restore 0014's CHECK and forget 0015.
	old := store.Table{Schema: "public", Name: "hourly"}
	if _, err := schema.MigrateWith(ctx, conn, old, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`ALTER TABLE hourly_partitioning DROP CONSTRAINT hourly_partitioning_interval_seconds_check`,
		`ALTER TABLE hourly_partitioning ADD CONSTRAINT hourly_partitioning_interval_seconds_check CHECK (interval_seconds >= 3600 AND interval_seconds % 60 = 0)`,
		`DELETE FROM outbox_relay_migrations WHERE target = 'public.hourly' AND version = 15`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := conn.Exec(ctx, `UPDATE hourly_partitioning SET interval_seconds = 300`); err == nil {
		t.Fatal("the old CHECK took an interval of 300 s: the test does not restore it")
	}
	if migs, err := schema.Migrate(ctx, conn, old); err != nil || len(migs) != 1 || migs[0].Version != 15 {
		t.Fatalf("migrate the old table: %v, %v; want 0015 alone", migs, err)
	}
	if _, err := conn.Exec(ctx, `UPDATE hourly_partitioning SET interval_seconds = 300`); err != nil {
		t.Errorf("after 0015, an interval of 300 s: %v", err)
	}
	if _, err := conn.Exec(ctx, `UPDATE hourly_partitioning SET interval_seconds = 240`); err == nil {
		t.Errorf("after 0015, an interval of 240 s was accepted")
	}
}

// The partitions ahead are kept by the running relay: PartitionKeeper
// creates the ones missing (here, the three furthest ahead, dropped), and an
// interval whose rows already sit in the DEFAULT partition gets no
// partition of its own (creating it would fail) while the keeper reports
// the rows the DEFAULT partition holds.
func TestPartitionsCreatedAhead(t *testing.T) {
	ctx := context.Background()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	conn := connect(t, url)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.MigrateWith(ctx, conn, tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	full := partitions(t, conn, "outbox")
	var names []string
	for n := range full {
		if n != "outbox_default" {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	dropped := names[len(names)-3:]
	for _, n := range dropped {
		if _, err := conn.Exec(ctx, `DROP TABLE `+pgx.Identifier{n}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	// A row for the middle dropped hour lands in the DEFAULT partition.
	start, err := time.Parse("2006010215", strings.TrimPrefix(dropped[1], "outbox_p"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('early', 'k', '{}', $1::timestamptz + interval '1 minute')`, start); err != nil {
		t.Fatal(err)
	}
	var in string
	if err := conn.QueryRow(ctx, `SELECT tableoid::regclass::text FROM outbox WHERE work_id = 'early'`).Scan(&in); err != nil || in != "outbox_default" {
		t.Fatalf("row for a missing hour in %s (%v), want outbox_default", in, err)
	}

	var mu sync.Mutex
	var reports []store.PartitionsMade
	var failures []error
	kctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		store.New(pool, tbl, store.PolicyMark).PartitionKeeper(kctx, 50*time.Millisecond, func(m store.PartitionsMade, err error) {
			mu.Lock()
			defer mu.Unlock()
			reports = append(reports, m)
			if err != nil {
				failures = append(failures, err)
			}
		})
	}()
	testenv.WaitFor(t, 10*time.Second, "three keeper rounds", func() (bool, error) {
		mu.Lock()
		defer mu.Unlock()
		return len(reports) >= 3, nil
	})
	cancel()
	<-done
	if len(failures) > 0 {
		t.Fatalf("keeper failed: %v", failures)
	}
	var created []string
	for _, r := range reports {
		created = append(created, r.Created...)
		if r.DefaultRows != 1 {
			t.Errorf("keeper reported %d rows in the DEFAULT partition, want 1", r.DefaultRows)
		}
	}
	slices.Sort(created)
	if want := []string{dropped[0], dropped[2]}; !slices.Equal(created, want) {
		t.Errorf("keeper created %v, want %v (not %s, whose hour has a row in the DEFAULT partition)", created, want, dropped[1])
	}
	now := partitions(t, conn, "outbox")
	if len(now) != len(full)-1 {
		t.Errorf("%d partitions after the keeper, want %d", len(now), len(full)-1)
	}
}

// seedPartition creates the partition of tbl for the hour starting at
// start and inserts rows into it: state -> how many.
func seedPartition(t *testing.T, pool *pgxpool.Pool, start time.Time, rows map[string]int) string {
	t.Helper()
	name := partName("outbox", start)
	exec(t, pool, fmt.Sprintf(`CREATE TABLE %s PARTITION OF outbox FOR VALUES FROM ('%s') TO ('%s') WITH (fillfactor = 50)`,
		pgx.Identifier{name}.Sanitize(), start.Format(time.RFC3339), start.Add(time.Hour).Format(time.RFC3339)))
	for state, n := range rows {
		for i := range n {
			id := fmt.Sprintf("%s-%s-%d", name, state, i)
			at := start.Add(time.Duration(i+1) * time.Minute)
			switch state {
			case "published":
				exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at, stream_seq) VALUES ($1, 'k', '{}', 'published', $2, $2, 1)`, id, at)
			case "cancelled":
				exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, redriven_at) VALUES ($1, 'k', '{}', 'cancelled', $2, $2)`, id, at)
			default:
				exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at) VALUES ($1, 'k', '{}', $3, $2)`, id, at, state)
			}
		}
	}
	return name
}

func countLike(t *testing.T, pool *pgxpool.Pool, prefix string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox WHERE starts_with(work_id, $1)`, prefix).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// newHourlyTable migrates a fresh database's outbox table partitioned by the
// hour and returns it with a pool on that database, and the database's URL.
func newHourlyTable(t *testing.T) (store.Table, *pgxpool.Pool, string) {
	t.Helper()
	url := testenv.Shared(t).PG.CreateDatabase(t)
	tbl := store.Table{Schema: "public", Name: "outbox"}
	if _, err := schema.MigrateWith(context.Background(), connect(t, url), tbl, schema.MigrateOptions{PartitionInterval: time.Hour}); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return tbl, pool, url
}

// prune --older-than on a partitioned table drops whole partitions that
// end before the cutoff and hold nothing it must keep, keeps the others
// saying why (rows still owed, dead letters, cancelled rows without
// --include-cancelled, the DEFAULT partition), and deletes no row one by
// one: n_tup_del stays 0 in every partition.
func TestPrunePartitions(t *testing.T) {
	ctx := context.Background()
	tbl, pool, url := newHourlyTable(t)
	base := time.Now().UTC().Truncate(time.Hour)
	done := seedPartition(t, pool, base.Add(-6*time.Hour), map[string]int{"published": 10})
	owed := seedPartition(t, pool, base.Add(-5*time.Hour), map[string]int{"published": 5, "scheduled": 2, "ready": 1})
	dead := seedPartition(t, pool, base.Add(-4*time.Hour), map[string]int{"published": 3, "failed": 1})
	canc := seedPartition(t, pool, base.Add(-3*time.Hour), map[string]int{"published": 2, "cancelled": 1})
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at) VALUES ('lost', 'k', '{}', 'published', $1, $1)`, base.Add(-10*time.Hour))

	s := store.New(pool, tbl, store.PolicyMark)
	verdicts := func(res store.PruneResult) map[string]string {
		out := map[string]string{}
		for _, p := range res.Partitions {
			out[p.Name] = p.Kept
		}
		return out
	}
	// The cutoff is where the newest seeded partition ends, whatever the
	// minute: older partitions end before it.
	olderThan := func() time.Duration { return time.Since(base.Add(-2*time.Hour)) - time.Second }
	dry, err := s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := verdicts(dry); !dry.Partitioned || v[done] != "" || len(partitions(t, pool, "outbox")) == 0 || countLike(t, pool, done) != 10 {
		t.Fatalf("dry run: %+v; want %s to be dropped and nothing done", dry, done)
	}

	res, err := s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	v := verdicts(res)
	t.Logf("verdicts: %q", v)
	for name, want := range map[string]string{
		done:             "",
		owed:             "3 rows still owed (2 scheduled, 1 ready not yet published)",
		dead:             "1 failed rows (dead letters",
		canc:             "1 cancelled and 0 expired rows",
		"outbox_default": "the DEFAULT partition is never dropped",
	} {
		got, ok := v[name]
		if !ok || (want == "" && got != "") || !strings.Contains(got, want) {
			t.Errorf("%s: kept %q (listed %v), want %q", name, got, ok, want)
		}
	}
	parts := partitions(t, pool, "outbox")
	if _, ok := parts[done]; ok {
		t.Errorf("%s still attached", done)
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, done).Scan(&exists); err != nil || exists {
		t.Errorf("%s still exists (%v)", done, err)
	}
	for _, n := range []string{owed, dead, canc} {
		if _, ok := parts[n]; !ok {
			t.Errorf("%s detached", n)
		}
	}
	if got := []int{countLike(t, pool, done), countLike(t, pool, owed), countLike(t, pool, dead), countLike(t, pool, canc)}; !slices.Equal(got, []int{0, 8, 4, 3}) {
		t.Errorf("rows per partition %v, want [0 8 4 3]", got)
	}

	// A row of the partition changes between the first count and the
	// detach (as a redrive would): the second count, under the detach's
	// lock, sees it and the detach is rolled back, rows and all.
	s.SetPruneHook(func(stage, part string) {
		if stage == store.PruneCounted {
			exec(t, pool, `UPDATE `+pgx.Identifier{part}.Sanitize()+` SET state = 'scheduled', published_at = NULL, stream_seq = NULL WHERE work_id = $1`, part+"-published-0")
		}
	})
	res, err = s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10, IncludeCancelled: true})
	s.SetPruneHook(nil)
	if err != nil {
		t.Fatal(err)
	}
	if v := verdicts(res); !strings.Contains(v[canc], "1 rows still owed (1 scheduled)") || !strings.Contains(v[canc], "rolled back") {
		t.Errorf("changed before the detach: %s kept %q, want owed and the detach rolled back", canc, v[canc])
	}
	if _, ok := partitions(t, pool, "outbox")[canc]; !ok || countLike(t, pool, canc) != 3 {
		t.Errorf("%s not attached back with its 3 rows (attached %v, %d rows)", canc, ok, countLike(t, pool, canc))
	}
	exec(t, pool, `UPDATE outbox SET state = 'published', published_at = created_at, stream_seq = 1 WHERE work_id = $1`, canc+"-published-0")

	// --include-cancelled drops the partition whose only keeper was a
	// cancelled row.
	res, err = s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10, IncludeCancelled: true})
	if err != nil {
		t.Fatal(err)
	}
	if v := verdicts(res); v[canc] != "" || countLike(t, pool, canc) != 0 {
		t.Errorf("--include-cancelled: %s kept %q", canc, v[canc])
	}
	// Without a DEFAULT partition too; once its owed rows are published,
	// the partition goes.
	exec(t, pool, `DROP TABLE outbox_default`)
	exec(t, pool, `UPDATE outbox SET state = 'published', published_at = created_at, stream_seq = 1 WHERE starts_with(work_id, $1) AND state <> 'published'`, owed)
	res, err = s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	if v := verdicts(res); v[owed] != "" || countLike(t, pool, owed) != 0 {
		t.Errorf("without DEFAULT: %s kept %q, %d rows left", owed, v[owed], countLike(t, pool, owed))
	}

	// Statistics are written when a backend ends: close the pool, then
	// read them from a new connection.
	pool.Close()
	conn := connect(t, url)
	var del, upd int64
	testenv.WaitFor(t, 10*time.Second, "statistics", func() (bool, error) {
		err := conn.QueryRow(ctx, `SELECT coalesce(sum(n_tup_del), 0), coalesce(sum(n_tup_upd), 0) FROM pg_stat_user_tables
			WHERE relid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = 'outbox'::regclass)`).Scan(&del, &upd)
		return upd > 0, err
	})
	if del != 0 {
		t.Errorf("n_tup_del = %d in the partitions, want 0: prune deleted rows one by one", del)
	}
}

// With --on-publish none a published row stays 'ready' and the watermark
// says it was published (G17): prune drops a partition whose 'ready' rows
// the watermark covers, keeps one with a 'ready' row it does not cover
// (in flight), and drops that one too once a later watermark covers it.
func TestPrunePartitionsUnderNone(t *testing.T) {
	ctx := context.Background()
	tbl, pool, _ := newHourlyTable(t)
	record := func() {
		t.Helper()
		exec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ('s') ON CONFLICT DO NOTHING`)
		exec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()), watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint())`)
	}
	base := time.Now().UTC().Truncate(time.Hour)
	covered := seedPartition(t, pool, base.Add(-6*time.Hour), map[string]int{"ready": 10})
	record()
	inFlight := seedPartition(t, pool, base.Add(-5*time.Hour), map[string]int{"ready": 3})
	s := store.New(pool, tbl, store.PolicyNone)
	olderThan := func() time.Duration { return time.Since(base.Add(-4*time.Hour)) - time.Second }
	res, err := s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	kept := map[string]string{}
	for _, p := range res.Partitions {
		kept[p.Name] = p.Kept
	}
	if k, ok := kept[covered]; !ok || k != "" || countLike(t, pool, covered) != 0 {
		t.Errorf("%s (every row covered): kept %q (listed %v), %d rows left; want dropped", covered, k, ok, countLike(t, pool, covered))
	}
	if k := kept[inFlight]; !strings.Contains(k, "3 rows still owed") || !strings.Contains(k, "3 ready not yet published") || countLike(t, pool, inFlight) != 3 {
		t.Errorf("%s (rows in flight): kept %q, %d rows; want kept with its 3 ready rows in flight", inFlight, k, countLike(t, pool, inFlight))
	}
	record()
	res, err = s.Prune(ctx, store.PruneRequest{OlderThan: olderThan(), Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range res.Partitions {
		if p.Name == inFlight && p.Kept != "" {
			t.Errorf("%s after a watermark covers it: kept %q, want dropped", inFlight, p.Kept)
		}
	}
	if n := countLike(t, pool, inFlight); n != 0 {
		t.Errorf("%s: %d rows left after a watermark covers them, want its partition dropped", inFlight, n)
	}
	var del int64
	exec(t, pool, `SELECT pg_stat_force_next_flush()`)
	if err := pool.QueryRow(ctx, `SELECT coalesce(sum(n_tup_del), 0)::bigint FROM pg_stat_user_tables WHERE relname LIKE 'outbox%'`).Scan(&del); err != nil || del != 0 {
		t.Errorf("rows deleted one by one: %d (%v), want 0", del, err)
	}
}
