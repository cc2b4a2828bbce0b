package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// storedSequences returns the Outbox-Sequence of aggregate order/agg's
// messages in the order the stream stored them.
func storedSequences(t *testing.T, h *harness, agg string) []string {
	t.Helper()
	byID, _ := h.streamMsgs()
	type msg struct {
		stored uint64
		seq    string
	}
	var ms []msg
	for _, m := range byID {
		if m.Header.Get(wire.HeaderAggregateID) == agg {
			ms = append(ms, msg{m.Sequence, m.Header.Get(wire.HeaderSequence)})
		}
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].stored < ms[j].stored })
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.seq
	}
	return out
}

// G12 says what it holds, exactly (docs/guarantees.md): the relay
// publishes an aggregate's rows in the order their transactions commit,
// one at a time, and the poller in sequence order among the rows it has;
// it does not wait for a sequence that has not been committed. Three ways
// the stream carries a lower sequence after a higher one, each visible to
// the receiver in Outbox-Sequence:
//
//   - explicit sequences committed out of order (2 commits before 1);
//   - a lower sequence committed after a gap was already passed (1, 3,
//     then 2);
//   - a redrive of a cancelled earlier row after the later ones were
//     published: refused unless the operator says --out-of-order, and then
//     published after them.
func TestOutOfSequencePublication(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	s := sharedSetup(t)
	h := newHarness(t, s)
	h.opts.Ordering = app.OrderingAggregate
	ctx := context.Background()
	insert := `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ($1 || '-' || $2::bigint, 'k', '{}', 'order', $1, $2)`
	// c1 is dead-lettered before the relay starts: aggregate c is held.
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, aggregate_type, aggregate_id, aggregate_seq)
		VALUES ('c-1', 'k', '{}', 'failed', 10, 'rejected: max_msg_size: too big', 'order', 'c', 1)`)
	h.start()

	// Explicit sequences committed out of order.
	txA, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	txB, err := h.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := txA.Exec(ctx, insert, "a", 2); err != nil {
		t.Fatal(err)
	}
	if _, err := txB.Exec(ctx, insert, "a", 1); err != nil {
		t.Fatal(err)
	}
	if err := txA.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitPublished(1, 30*time.Second)
	if err := txB.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	// A lower sequence after a gap.
	h.exec(insert, "b", 1)
	h.exec(insert, "b", 3)
	h.waitPublished(4, 30*time.Second)
	h.exec(insert, "b", 2)

	// c2 and c3 wait behind c1; the operator cancels c1 and they are
	// published.
	h.exec(insert, "c", 2)
	h.exec(insert, "c", 3)
	testenv.WaitFor(t, 30*time.Second, "c-2 and c-3 held", func() (bool, error) {
		n := h.countState("scheduled")
		return n == 2, fmt.Errorf("%d scheduled", n)
	})
	st := store.New(h.pool, h.opts.Table, store.PolicyMark)
	if _, err := st.Cancel(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{"c-1"}}, By: "test", Reason: "drop"}); err != nil {
		t.Fatal(err)
	}
	h.waitPublished(7, 30*time.Second)

	// A redrive of c1 now would publish it after c3: refused, nothing
	// changed, unless the operator says so.
	redrive := store.OpRequest{Selection: store.Selection{WorkIDs: []string{"c-1"}}, By: "test", Reason: "bring it back"}
	_, err = st.Redrive(ctx, redrive)
	var ooo *store.OutOfOrderError
	if !errors.As(err, &ooo) || len(ooo.Rows) != 1 || ooo.Rows[0].WorkID != "c-1" || ooo.Rows[0].Seq != 1 || ooo.Rows[0].Latest != 3 {
		t.Fatalf("redrive of c-1 after c-3 was published: %v, want an OutOfOrderError naming c-1 (sequence 1, 3 published)", err)
	}
	t.Logf("refused: %v", err)
	var state string
	if err := h.pool.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'c-1'`).Scan(&state); err != nil || state != "cancelled" {
		t.Fatalf("c-1 after the refused redrive: %s, %v; want cancelled", state, err)
	}
	redrive.DryRun = true
	res, err := st.Redrive(ctx, redrive)
	if err != nil || len(res.OutOfOrder) != 1 || len(res.Changed) != 1 {
		t.Fatalf("dry run: %+v, %v; want c-1 listed as out of order", res, err)
	}
	redrive.DryRun, redrive.OutOfOrder = false, true
	if res, err = st.Redrive(ctx, redrive); err != nil || len(res.Changed) != 1 || len(res.OutOfOrder) != 1 {
		t.Fatalf("redrive --out-of-order: %+v, %v", res, err)
	}
	h.waitPublished(8, 30*time.Second)

	for agg, want := range map[string][]string{"a": {"2", "1"}, "b": {"1", "3", "2"}, "c": {"2", "3", "1"}} {
		if got := storedSequences(t, h, agg); !slices.Equal(got, want) {
			t.Errorf("aggregate %s: the stream holds sequences %v in that order, want %v", agg, got, want)
		}
	}
}
