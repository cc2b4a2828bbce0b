package store_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// SettleFound (redrive's stream lookup, G18) settles a redriven row only
// while it is still scheduled under the generation it was redriven with: a
// row the poller claimed meanwhile (a newer generation, or running) is left
// to the poller, which looks it up itself.
func TestSettleFoundIsGuardedByStateAndGeneration(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, claim_generation, claimed_by, lease_until) VALUES
		('due', 'k', '{}', 'scheduled', 3, NULL, NULL),
		('reclaimed', 'k', '{}', 'scheduled', 4, NULL, NULL),
		('running', 'k', '{}', 'running', 3, 'w', clock_timestamp() + interval '1 minute')`)
	done, err := s.SettleFound(ctx, []store.Found{
		{WorkID: "due", Generation: 3, Stream: "S", Seq: 11},
		{WorkID: "reclaimed", Generation: 3, Stream: "S", Seq: 12},
		{WorkID: "running", Generation: 3, Stream: "S", Seq: 13},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(done, []string{"due"}) {
		t.Fatalf("settled %v, want [due]", done)
	}
	var state, stream, note string
	var seq int64
	if err := pool.QueryRow(ctx, `SELECT state, stream_name, stream_seq, last_error FROM outbox WHERE work_id = 'due'`).Scan(&state, &stream, &seq, &note); err != nil {
		t.Fatal(err)
	}
	if state != "published" || stream != "S" || seq != 11 || note != store.FoundNote("S", 11) {
		t.Errorf("due: %s %s %d %q", state, stream, seq, note)
	}
	for _, id := range []string{"reclaimed", "running"} {
		if r, _ := readRow(t, pool, "outbox", id); r.State == "published" {
			t.Errorf("%s settled under a stale generation", id)
		}
	}
}

// Under --on-publish delete a row found in the stream goes as an acked
// claim does (deleted), not left published until a prune: the policy is
// the same whichever way the message was found stored.
func TestSettleFoundFollowsTheDeletePolicy(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyDelete)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, claim_generation) VALUES
		('due', 'k', '{}', 'scheduled', 3),
		('reclaimed', 'k', '{}', 'scheduled', 4)`)
	done, err := s.SettleFound(ctx, []store.Found{
		{WorkID: "due", Generation: 3, Stream: "S", Seq: 11},
		{WorkID: "reclaimed", Generation: 3, Stream: "S", Seq: 12},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(done, []string{"due"}) {
		t.Fatalf("settled %v, want [due]", done)
	}
	rows, err := pool.Query(ctx, `SELECT work_id FROM outbox ORDER BY work_id`)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(left, []string{"reclaimed"}) {
		t.Errorf("rows left %v, want [reclaimed] (due deleted, the reclaimed one left to the poller)", left)
	}
}
