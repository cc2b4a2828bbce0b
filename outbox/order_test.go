package outbox_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// Enqueue takes each aggregate's next sequence in the caller's transaction:
// concurrent producers of one aggregate get 1..n with no gap and no repeat,
// a rolled-back enqueue gives its number back with the rest of the
// transaction, a repeat of an enqueued work ID takes none, and an explicit
// Sequence is kept.
func TestEnqueueAssignsAggregateSequences(t *testing.T) {
	pool, _ := newDB(t, store.Table{})
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
