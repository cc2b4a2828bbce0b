package store_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// <table>_dead_letters lists exactly the rows in state 'failed' (migration
// 0011), whatever moves them: an insert, an update into and out of
// 'failed', a delete, a truncate. The held set reads it instead of the
// table, so a missing entry would let the CDC path publish past a dead
// letter (G12); an entry the row no longer confirms is ignored.
func TestDeadLettersFollowTheRows(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyMark)
	listed := func(want ...string) {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT work_id FROM outbox_dead_letters ORDER BY work_id`)
		if err != nil {
			t.Fatal(err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) && !(len(got) == 0 && len(want) == 0) {
			t.Fatalf("dead letters %v, want %v", got, want)
		}
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`INSERT INTO outbox (work_id, kind, payload, state, last_error, aggregate_type, aggregate_id, aggregate_seq) VALUES
		('a1', 'k', '{}', 'failed', 'rejected: x', 'a', '1', 1),
		('a2', 'k', '{}', 'scheduled', 'held: waiting for a1', 'a', '1', 2),
		('b1', 'k', '{}', 'ready', NULL, 'b', '1', 1),
		('u', 'k', '{}', 'failed', 'rejected: y', NULL, NULL, NULL)`)
	listed("a1", "u")
	// A mark, a new error on a dead letter: nothing changes.
	exec(`UPDATE outbox SET state = 'published', published_at = clock_timestamp() WHERE work_id = 'b1'`)
	exec(`UPDATE outbox SET last_error = 'rejected: z' WHERE work_id = 'a1'`)
	listed("a1", "u")
	// Redriven: off the list, and on it again when it fails again.
	exec(`UPDATE outbox SET state = 'scheduled' WHERE work_id = 'a1'`)
	listed("u")
	exec(`UPDATE outbox SET state = 'failed' WHERE work_id = 'a1'`)
	listed("a1", "u")
	exec(`DELETE FROM outbox WHERE work_id = 'u'`)
	listed("a1")
	held, err := s.HeldAggregates(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(held) != 1 || held[store.AggregateKey{Type: "a", ID: "1"}] != "a1" {
		t.Fatalf("held %v, want a/1 behind a1", held)
	}
	// An entry the row does not confirm (as a backfill racing a redrive
	// could leave) holds nothing.
	exec(`INSERT INTO outbox_dead_letters VALUES ('b1', 'b', '1', 1)`)
	for _, k := range []store.AggregateKey{{Type: "b", ID: "1"}} {
		if with, err := s.WithPoller(ctx, k); err != nil || with {
			t.Fatalf("WithPoller(%v) = %v, %v on a stale entry", k, with, err)
		}
	}
	if held, err := s.HeldAggregates(ctx); err != nil || len(held) != 1 {
		t.Fatalf("held %v (%v) with a stale entry, want only a/1", held, err)
	}
	exec(`TRUNCATE outbox`)
	listed()
}
