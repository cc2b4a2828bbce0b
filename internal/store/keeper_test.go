package store_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// While the DEFAULT partition holds rows (here 200,000), making the
// partitions ahead does not stop producers for a scan of it per partition,
// as CREATE TABLE ... PARTITION OF did under the table's ACCESS EXCLUSIVE
// lock: a producer enqueueing through package outbox's statement (its
// repeat check reads every partition) all along waits less than two scans
// of it. Two keepers at once both succeed, each partition made once.
func TestPartitionKeeperDoesNotBlockProducers(t *testing.T) {
	ctx := context.Background()
	tbl, pool, _ := newHourlyTable(t)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, published_at)
		SELECT 'old-' || i, 'k', '{}', 'published', '2001-01-01'::timestamptz + i * interval '1 second', '2001-01-02' FROM generate_series(1, 200000) i`)
	exec(t, pool, `ANALYZE outbox`)
	all := partitions(t, pool, "outbox")
	var names []string
	for n := range all {
		if n != "outbox_default" {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	dropped := names[len(names)-4:]
	for _, n := range dropped {
		exec(t, pool, `DROP TABLE `+pgx.Identifier{n}.Sanitize())
	}
	start := time.Now()
	var scanned int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM ONLY outbox_default WHERE created_at::text <> ''`).Scan(&scanned); err != nil {
		t.Fatal(err)
	}
	scan := time.Since(start)

	stop := make(chan struct{})
	var worst time.Duration
	var produced int
	var prodErr error
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			t0 := time.Now()
			if _, err := store.EnqueueOne(ctx, pool, tbl, store.EnqueueRow{WorkID: fmt.Sprintf("p-%d", i), Kind: "k", Payload: `{}`}); err != nil {
				prodErr = err
				return
			}
			worst = max(worst, time.Since(t0))
			produced++
		}
	}()
	made := make([]store.PartitionsMade, 2)
	errs := make([]error, 2)
	var kw sync.WaitGroup
	took := time.Now()
	for i := range 2 {
		kw.Add(1)
		go func() {
			defer kw.Done()
			made[i], errs[i] = store.AddPartitions(ctx, pool, tbl, 3*time.Second)
		}()
	}
	kw.Wait()
	took2 := time.Since(took)
	// And once more, for what the two left to a next round.
	again, err := store.AddPartitions(ctx, pool, tbl, 3*time.Second)
	close(stop)
	wg.Wait()
	if prodErr != nil {
		t.Fatal(prodErr)
	}
	t.Logf("DEFAULT partition: %d rows, a scan of it %s; two keepers took %s and made %v and %v, a third %v; %d enqueues, the slowest %s",
		scanned, scan, took2, made[0].Created, made[1].Created, again.Created, produced, worst)
	for i, err := range append(errs, err) {
		if err != nil {
			t.Errorf("keeper %d: %v", i+1, err)
		}
	}
	created := append(append(append([]string{}, made[0].Created...), made[1].Created...), again.Created...)
	slices.Sort(created)
	if !slices.Equal(created, dropped) {
		t.Errorf("keepers created %v, want %v once each", created, dropped)
	}
	if now := partitions(t, pool, "outbox"); len(now) != len(all) {
		t.Errorf("%d partitions after the keepers, want %d", len(now), len(all))
	}
	// The old keeper held producers for a scan of the DEFAULT partition per
	// partition (4 here: 1.39 s against a 311 ms scan). Not yet down to a
	// catalog change (issue 30, item 8: a wait of 0.2-0.4 s is left, its
	// holder add_partitions(); see the report).
	if bound := 2*scan + 50*time.Millisecond; worst > bound {
		t.Errorf("a producer's enqueue waited %s while the keepers made %d partitions (a scan of the DEFAULT partition takes %s), want under %s", worst, len(dropped), scan, bound)
	}
	var guards int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_constraint WHERE conrelid = 'outbox_default'::regclass AND conname = 'outbox_default_guard'`).Scan(&guards); err != nil || guards != 0 {
		t.Errorf("%d constraints left on the DEFAULT partition (%v), want 0", guards, err)
	}
}
