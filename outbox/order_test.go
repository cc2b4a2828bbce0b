package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/table"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// Enqueue takes each aggregate's next sequence in the caller's transaction:
// concurrent producers of one aggregate get 1..n with no gap and no repeat,
// a rolled-back enqueue gives its number back with the rest of the
// transaction, a repeat of an enqueued work ID takes none, and an explicit
// Sequence is kept.
func TestEnqueueAssignsAggregateSequences(t *testing.T) {
	pool, _ := newDB(t, table.Table{})
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 10 {
				errs <- enqueueIn(ctx, pool, outbox.Message{WorkID: "o1-" + string(rune('a'+w)) + string(rune('a'+i)), Kind: "order_event",
					Payload: []byte(`{}`), Aggregate: outbox.Aggregate{Type: "order", ID: "1"}}, i == 3)
			}
		}()
	}
	wg.Wait()
	close(errs)
	rolledBack := 0
	for err := range errs {
		if errors.Is(err, errRolledBack) {
			rolledBack++
		} else if err != nil {
			t.Fatal(err)
		}
	}
	// A repeat of an enqueued work ID takes no number.
	if err := outbox.Enqueue(ctx, pool, outbox.Message{WorkID: "o1-aa", Kind: "order_event", Payload: []byte(`{}`),
		Aggregate: outbox.Aggregate{Type: "order", ID: "1"}}); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
		t.Fatalf("repeat: %v, want ErrAlreadyEnqueued", err)
	}
	if err := outbox.Enqueue(ctx, pool, outbox.Message{WorkID: "o1-last", Kind: "order_event", Payload: []byte(`{}`),
		Aggregate: outbox.Aggregate{Type: "order", ID: "1"}, ExpiresAt: time.Now().Add(time.Hour)}); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, `SELECT aggregate_seq FROM outbox WHERE aggregate_id = '1' ORDER BY aggregate_seq`)
	if err != nil {
		t.Fatal(err)
	}
	var seqs []int64
	for rows.Next() {
		var s int64
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, s)
	}
	if want := 40 - rolledBack + 1; len(seqs) != want {
		t.Fatalf("%d rows, want %d", len(seqs), want)
	}
	for i, s := range seqs {
		if s != int64(i+1) {
			t.Fatalf("sequences %v: want 1..%d without gaps", seqs, len(seqs))
		}
	}
	// An explicit sequence is kept.
	if err := outbox.Enqueue(ctx, pool, outbox.Message{WorkID: "o2-v7", Kind: "order_event", Payload: []byte(`{}`),
		Aggregate: outbox.Aggregate{Type: "order", ID: "2"}, Sequence: 7}); err != nil {
		t.Fatal(err)
	}
	var s int64
	if err := pool.QueryRow(ctx, `SELECT aggregate_seq FROM outbox WHERE work_id = 'o2-v7'`).Scan(&s); err != nil || s != 7 {
		t.Fatalf("explicit sequence: %d, %v", s, err)
	}
	if err := (outbox.Message{WorkID: "x", Kind: "k", Payload: []byte(`{}`), Aggregate: outbox.Aggregate{Type: "order"}}).Validate(); !errors.Is(err, outbox.ErrInvalid) {
		t.Fatalf("aggregate without an ID: %v, want ErrInvalid", err)
	}
}

var errRolledBack = errors.New("rolled back on purpose")

func enqueueIn(ctx context.Context, pool *pgxpool.Pool, m outbox.Message, rollback bool) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck
	if err := outbox.Enqueue(ctx, tx, m); err != nil {
		return err
	}
	if rollback {
		return errRolledBack
	}
	return tx.Commit(ctx)
}

// A producer may give back only a number its own transaction took and did
// not use (issue 20, item 8). <table>_give_back_seq is SECURITY DEFINER and
// the producer role from `migrate --print-grants` may call it: called for a
// number another transaction took, or for one its own transaction used, it
// changes nothing, so no aggregate is wedged (every later enqueue a
// duplicate key) and no sequence is handed out twice. Enqueue's own use,
// after a concurrent repeat of its work ID won, still leaves no gap.
func TestGiveBackSeqOnlyByTheTaker(t *testing.T) {
	tbl := table.Table{Schema: "public", Name: "outbox"}
	owner, _, url := newDBURL(t, tbl)
	ctx := context.Background()
	suffix := fmt.Sprintf("_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	roles := schema.Roles{Relay: "gb_relay" + suffix, Producer: "gb_producer" + suffix, Operator: "gb_operator" + suffix}
	grants, err := schema.Grants(tbl, roles)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := owner.Exec(ctx, grants); err != nil {
		t.Fatalf("grants: %v", err)
	}
	t.Cleanup(func() {
		for _, r := range []string{roles.Relay, roles.Producer, roles.Operator} {
			id := pgx.Identifier{r}.Sanitize()
			_, _ = owner.Exec(context.Background(), `DROP OWNED BY `+id+`; DROP ROLE IF EXISTS `+id)
		}
	})
	if !strings.Contains(url, "postgres://postgres@") {
		t.Fatalf("database URL %q: want postgres://postgres@...", url)
	}
	producer, err := pgxpool.New(ctx, strings.Replace(url, "postgres://postgres@", "postgres://"+roles.Producer+"@", 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(producer.Close)

	enqueue := func(db outbox.DB, id, agg string) error {
		return outbox.Enqueue(ctx, db, outbox.Message{WorkID: id, Kind: "order_event", Payload: []byte(`{}`),
			Aggregate: outbox.Aggregate{Type: "order", ID: agg}})
	}
	giveBack := func(db outbox.DB, agg string, seq int64) {
		t.Helper()
		if _, err := db.Exec(ctx, `SELECT outbox_give_back_seq('order', $1, $2)`, agg, seq); err != nil {
			t.Fatalf("give_back_seq(order, %s, %d) as the producer: %v", agg, seq, err)
		}
	}
	seqs := func(agg string) (got []int64, last int64) {
		t.Helper()
		rows, err := owner.Query(ctx, `SELECT aggregate_seq FROM outbox WHERE aggregate_type = 'order' AND aggregate_id = $1 ORDER BY aggregate_seq`, agg)
		if err != nil {
			t.Fatal(err)
		}
		got, err = pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		if err := owner.QueryRow(ctx, `SELECT last_seq FROM outbox_aggregates WHERE aggregate_type = 'order' AND aggregate_id = $1`, agg).Scan(&last); err != nil {
			t.Fatal(err)
		}
		return got, last
	}
	want := func(agg string, n int) {
		t.Helper()
		got, last := seqs(agg)
		if len(got) != n || last != int64(n) {
			t.Fatalf("aggregate %s: sequences %v, counter %d; want 1..%d and counter %d", agg, got, last, n, n)
		}
		for i, s := range got {
			if s != int64(i+1) {
				t.Fatalf("aggregate %s: sequences %v; want 1..%d", agg, got, n)
			}
		}
	}

	// Another transaction's committed number.
	if err := enqueue(producer, "a-1", "a"); err != nil {
		t.Fatal(err)
	}
	giveBack(producer, "a", 1)
	if err := enqueue(producer, "a-2", "a"); err != nil {
		t.Fatalf("enqueue after another transaction called give_back_seq: %v", err)
	}
	want("a", 2)

	// A number its own transaction took and used.
	err = pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
		if err := enqueue(tx, "b-1", "b"); err != nil {
			return err
		}
		giveBack(tx, "b", 1)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := enqueue(producer, "b-2", "b"); err != nil {
		t.Fatalf("enqueue after a transaction gave back the number it used: %v", err)
	}
	want("b", 2)

	// Enqueue's own give-back, after a concurrent repeat of its work ID won:
	// a repeat in another aggregate (d) takes d's number, waits for the
	// first insert of the work ID, finds it committed and gives the number
	// back; a repeat in the same aggregate (c) waits on the counter row,
	// takes the number after the first one's and gives it back. The next
	// enqueue of each aggregate in the repeat's transaction takes the next
	// number, with no gap.
	for _, agg := range []string{"d", "c"} {
		func() {
			id := "r-" + agg
			first, err := producer.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer first.Rollback(ctx) //nolint:errcheck // after Commit a no-op; on a failure it frees the repeat
			if err := enqueue(first, id, "c"); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() {
				done <- pgx.BeginFunc(ctx, producer, func(tx pgx.Tx) error {
					if err := enqueue(tx, id, agg); !errors.Is(err, outbox.ErrAlreadyEnqueued) {
						return fmt.Errorf("repeat of %s in aggregate %s: %v, want ErrAlreadyEnqueued", id, agg, err)
					}
					return enqueue(tx, agg+"-next", agg)
				})
			}()
			// The repeat waits for the first insert's transaction (a
			// lock) once it has taken its number; commit only then.
			testenv.WaitFor(t, 10*time.Second, "the repeat of "+id+" waiting", func() (bool, error) {
				var n int
				err := owner.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE usename = $1 AND wait_event_type = 'Lock'`, roles.Producer).Scan(&n)
				return n == 1, err
			})
			if err := first.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}()
	}
	want("c", 3)
	want("d", 1)
}
