package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/enqueue"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// waitLockWait waits until a backend whose query contains marker waits for
// a lock.
func waitLockWait(t *testing.T, pool *pgxpool.Pool, marker string) {
	t.Helper()
	testenv.WaitFor(t, 10*time.Second, "a statement with "+marker+" waiting for a lock", func() (bool, error) {
		var n int
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0 AND pid <> pg_backend_pid()`, marker).Scan(&n)
		return n > 0, err
	})
}

// isAttached says whether part is a partition of outbox now, and how many
// of its rows the table reaches.
func isAttached(t *testing.T, pool *pgxpool.Pool, part string) (bool, int) {
	t.Helper()
	_, ok := partitions(t, pool, "outbox")[part]
	return ok, countLike(t, pool, part)
}

// An interrupted prune (here: its context cancelled inside the detach's
// transaction, as a signal or a CronJob deadline would) leaves the
// partition attached, with its rows, and says so. A partition left out of
// the table before (by hand, or by an earlier version's interrupted prune)
// is listed, and the next prune attaches it back when it holds rows to
// keep, or drops it when it holds none and is old enough.
func TestPruneInterruptedLeavesNoPartitionOut(t *testing.T) {
	ctx := context.Background()
	tbl, pool, _ := newHourlyTable(t)
	base := time.Now().UTC().Truncate(time.Hour)
	done := seedPartition(t, pool, base.Add(-6*time.Hour), map[string]int{"published": 4})
	s := store.New(pool, tbl, store.PolicyMark)
	olderThan := time.Since(base.Add(-2*time.Hour)) - time.Second

	pctx, cancel := context.WithCancel(ctx)
	s.SetPruneHook(func(stage, _ string) {
		if stage == store.PruneDetached {
			cancel()
		}
	})
	_, err := s.Prune(pctx, store.PruneRequest{OlderThan: olderThan, Batch: 10})
	s.SetPruneHook(nil)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted prune: %v, want context.Canceled", err)
	}
	if attached, n := isAttached(t, pool, done); !attached || n != 4 {
		t.Fatalf("after an interrupted prune %s is attached %v with %d of its 4 rows in the table (error: %v)", done, attached, n, err)
	}
	if !strings.Contains(err.Error(), "stays attached") {
		t.Errorf("the error does not say what became of the partition: %v", err)
	}

	// Left out before: one with a row still owed, one with nothing to keep.
	owed := seedPartition(t, pool, base.Add(-5*time.Hour), map[string]int{"published": 2, "scheduled": 1})
	old := seedPartition(t, pool, base.Add(-4*time.Hour), map[string]int{"published": 3})
	exec(t, pool, `ALTER TABLE outbox DETACH PARTITION `+pgx.Identifier{owed}.Sanitize())
	exec(t, pool, `ALTER TABLE outbox DETACH PARTITION `+pgx.Identifier{old}.Sanitize())
	parts, err := s.Partitions(ctx)
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]store.Partition{}
	for _, p := range parts {
		listed[p.Name] = p
	}
	for _, n := range []string{owed, old} {
		if p, ok := listed[n]; !ok || !p.Detached || !p.Start.Equal(p.End.Add(-time.Hour)) {
			t.Errorf("%s, detached: listed %v as %+v, want Detached with its hour", n, ok, p)
		}
	}
	sum, err := s.PartitionSummary(ctx)
	if err != nil || len(sum.Detached) != 2 {
		t.Errorf("status: %+v (%v), want the 2 detached partitions named", sum, err)
	}
	res, err := s.Prune(ctx, store.PruneRequest{OlderThan: olderThan, Batch: 10})
	if err != nil {
		t.Fatal(err)
	}
	kept := map[string]string{}
	for _, p := range res.Partitions {
		kept[p.Name] = p.Kept
	}
	if attached, n := isAttached(t, pool, owed); !attached || n != 3 || !strings.Contains(kept[owed], "attached back") {
		t.Errorf("%s (left detached with a scheduled row): attached %v, %d of 3 rows in the table, kept %q; want attached back", owed, attached, n, kept[owed])
	}
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, old).Scan(&exists); err != nil || exists {
		t.Errorf("%s (left detached, nothing to keep): still exists (%v), kept %q; want dropped", old, err, kept[old])
	}
	if k, ok := kept[done]; !ok || k != "" {
		t.Errorf("%s after the interrupted prune: kept %q (listed %v), want dropped by the next prune", done, k, ok)
	}
}

// A settle that changes nothing is done only when the row is known to be
// gone for a reason: moved on to another state, or not in the table while
// no partition of it is detached. A row in a partition out of the table is
// not settled (the checkpoint must not pass it); once the partition is
// back the settle changes it.
func TestSettleWhilePartitionDetached(t *testing.T) {
	ctx := context.Background()
	tbl, pool, _ := newHourlyTable(t)
	base := time.Now().UTC().Truncate(time.Hour)
	part := seedPartition(t, pool, base.Add(-5*time.Hour), map[string]int{"ready": 1})
	id := part + "-ready-0"
	var xid uint32
	if err := pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM outbox WHERE work_id = $1`, id).Scan(&xid); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state) VALUES ('moved', 'k', '{}', 'scheduled')`)
	var movedXid uint32
	if err := pool.QueryRow(ctx, `SELECT xmin::text::bigint FROM outbox WHERE work_id = 'moved'`).Scan(&movedXid); err != nil {
		t.Fatal(err)
	}
	s := store.New(pool, tbl, store.PolicyMark)
	items := []store.Settle{
		{WorkID: id, Xid: xid, Outcome: store.Delayed},
		{WorkID: "moved", Xid: movedXid, Outcome: store.Delayed},
	}
	exec(t, pool, `ALTER TABLE outbox DETACH PARTITION `+pgx.Identifier{part}.Sanitize())
	settled, err := s.SettleRows(ctx, items)
	if err != nil {
		t.Fatal(err)
	}
	if settled[0] || !settled[1] {
		t.Fatalf("settled %v with %s's partition detached, want [false true]: a row out of the table is not done with", settled, id)
	}
	if _, err := s.Prune(ctx, store.PruneRequest{OlderThan: time.Hour, Batch: 10}); err != nil {
		t.Fatal(err)
	}
	if settled, err = s.SettleRows(ctx, items[:1]); err != nil || !settled[0] {
		t.Fatalf("settle after prune attached the partition back: %v, %v; want settled", settled, err)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = $1`, id).Scan(&state); err != nil || state != "scheduled" {
		t.Errorf("%s is %q (%v), want scheduled", id, state, err)
	}
	// Gone for a reason (a replay after its row was deleted): settled.
	exec(t, pool, `DELETE FROM outbox WHERE work_id = $1`, id)
	if settled, err = s.SettleRows(ctx, items[:1]); err != nil || !settled[0] {
		t.Errorf("settle of a deleted row with no partition detached: %v, %v; want settled", settled, err)
	}
}

// The detach waits (within --lock-timeout) for a producer's transaction
// open across the partition's end, and whoever queued behind it gets the
// table once that transaction ends: no statement waits on prune for the
// whole life of an unrelated transaction. Before, the ATTACH back of a
// partition that changed while detached waited without a bound, holding
// every statement on the table behind it.
func TestPruneWaitsNoLongerThanLockTimeout(t *testing.T) {
	ctx := context.Background()
	tbl, pool, _ := newHourlyTable(t)
	base := time.Now().UTC().Truncate(time.Hour)
	part := seedPartition(t, pool, base.Add(-5*time.Hour), map[string]int{"published": 2})
	s := store.New(pool, tbl, store.PolicyMark)

	producer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Rollback(ctx) //nolint:errcheck
	if _, err := producer.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('late', 'k', '{}', $1)`, base.Add(-5*time.Hour+30*time.Minute)); err != nil {
		t.Fatal(err)
	}
	type pruned struct {
		res store.PruneResult
		err error
	}
	// An unrelated reader starts once the partition is detached and holds
	// the table (ACCESS SHARE on it and its partitions) for 3 s; it waits
	// for the prune's transaction, if that holds the table, or gets it.
	readerDone, holding := make(chan error, 1), make(chan struct{})
	s.SetPruneHook(func(stage, _ string) {
		if stage != store.PruneDetached {
			return
		}
		go func() {
			readerDone <- pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `SELECT count(*) /* unrelated reader */ FROM outbox`); err != nil {
					return err
				}
				close(holding)
				time.Sleep(3 * time.Second) // the reader's own work, not a wait for a condition
				return nil
			})
		}()
		testenv.WaitFor(t, 10*time.Second, "the reader holding the table or waiting for it", func() (bool, error) {
			select {
			case <-holding:
				return true, nil
			default:
			}
			var n int
			err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, 'unrelated reader') > 0`).Scan(&n)
			return n > 0, err
		})
	})
	pr := make(chan pruned, 1)
	go func() {
		res, err := s.Prune(ctx, store.PruneRequest{OlderThan: time.Since(base.Add(-2 * time.Hour)), Batch: 10, LockTimeout: 5 * time.Second})
		pr <- pruned{res, err}
	}()
	waitLockWait(t, pool, "DETACH PARTITION")
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	<-holding
	// Once prune is done or waits for a lock again (an ATTACH back behind
	// the reader), a repeat check and a settle-like update through the
	// table, while the reader still runs.
	var p pruned
	finished := false
	testenv.WaitFor(t, 10*time.Second, "prune done or waiting for a lock again", func() (bool, error) {
		select {
		case p = <-pr:
			finished = true
			return true, nil
		default:
		}
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, 'ATTACH PARTITION') > 0`).Scan(&n)
		return n > 0, err
	})
	start := time.Now()
	if _, err := enqueue.One(ctx, pool, tbl, enqueue.Row{WorkID: "probe", Kind: "k", Payload: `{}`}); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `UPDATE outbox SET state = 'scheduled' WHERE work_id = 'probe' AND state = 'ready'`)
	waited := time.Since(start)
	if err := <-readerDone; err != nil {
		t.Fatal(err)
	}
	if !finished {
		p = <-pr
	}
	if p.err != nil {
		t.Fatal(p.err)
	}
	var kept string
	for _, v := range p.res.Partitions {
		if v.Name == part {
			kept = v.Kept
		}
	}
	t.Logf("%s: kept %q; a producer's enqueue and an update waited %s (prune finished before them: %v)", part, kept, waited, finished)
	if attached, n := isAttached(t, pool, part); !attached || n != 2 || countLike(t, pool, "late") != 1 || !strings.Contains(kept, "1 rows still owed (1 ready") {
		t.Errorf("%s: attached %v with %d of 2 rows and the late one, kept %q; want kept with the late row", part, attached, n, kept)
	}
	if waited > time.Second {
		t.Errorf("an enqueue and an update after the prune waited %s behind it, want well under 1s (the reader's 3 s must not count)", waited)
	}
}
