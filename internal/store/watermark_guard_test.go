package store_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// Issue 30 item 4: a candidate a session took against one incarnation of
// the slot is never recorded against another. A frozen instance took
// candidate c1 while the first slot existed; another instance marked the
// backfill pending, dropped and re-created the slot (its confirmed position
// is past c1's). Neither while the backfill is pending nor after it is the
// old candidate recorded; a candidate of the new incarnation is.
func TestWatermarkCandidateBoundToSlot(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyNone)
	const slot = "wm_guard"
	create := func() {
		t.Helper()
		exec(t, pool, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, slot)
	}
	if err := s.MarkBackfillPending(ctx, slot); err != nil {
		t.Fatal(err)
	}
	create()
	if _, _, err := s.BackfillAllReady(ctx, slot); err != nil {
		t.Fatal(err)
	}
	first := slotIncarnation(t, s, slot)
	_, c1, err := advance(s, first, store.WatermarkCandidate{})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload) VALUES ('after-c1', 'k', '{}')`)

	// Another instance re-creates the slot: marker first, then the slot.
	if err := s.MarkBackfillPending(ctx, slot); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `SELECT pg_drop_replication_slot($1)`, slot)
	create()
	var confirmed store.LSN
	var text string
	if err := pool.QueryRow(ctx, `SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1`, slot).Scan(&text); err != nil {
		t.Fatal(err)
	}
	if confirmed, err = store.ParseLSN(text); err != nil {
		t.Fatal(err)
	}
	if confirmed < c1.LSN {
		t.Fatalf("the new slot's confirmed position %s is before the candidate's %s: the test proves nothing", confirmed, c1.LSN)
	}
	rec, _, err := advance(s, first, c1)
	if err != nil || rec {
		t.Fatalf("while the new slot's backfill is pending: recorded %v (%v); want the old candidate refused", rec, err)
	}
	n, pending, err := s.BackfillAllReady(ctx, slot)
	if err != nil || !pending || n != 1 {
		t.Fatalf("backfill of the new slot: %d rows, pending %v, %v; want 1 (after-c1), true", n, pending, err)
	}
	rec, _, err = advance(s, first, c1)
	if err != nil || rec {
		t.Fatalf("after the new slot's backfill: recorded %v (%v); want the first slot's candidate refused", rec, err)
	}
	second := slotIncarnation(t, s, slot)
	if second == first {
		t.Fatalf("both slots recorded at %s", first)
	}
	// The stalled session's bound is refused too: it may not confirm.
	if err := s.RaiseConfirmBound(ctx, slot, first, c1.LSN, nil); !errors.Is(err, store.ErrSlotReplaced) {
		t.Errorf("the first slot's session raising the bound: %v, want ErrSlotReplaced", err)
	}
	_, c2, err := advance(s, second, store.WatermarkCandidate{})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `SELECT pg_replication_slot_advance($1, pg_current_wal_lsn())`, slot)
	if rec, _, err = advance(s, second, c2); err != nil || !rec {
		t.Fatalf("the new slot's own candidate: recorded %v (%v); want it recorded", rec, err)
	}
}

// slotIncarnation is the consistent point the record names for slot.
func slotIncarnation(t *testing.T, s *store.Store, slot string) store.LSN {
	t.Helper()
	st, found, err := s.SlotState(context.Background(), slot)
	if err != nil || !found || st.SlotLSN == 0 || st.SystemIdentifier != st.System {
		t.Fatalf("record of slot %s: %+v (found %v, %v); want its identity recorded", slot, st, found, err)
	}
	return st.SlotLSN
}

func advance(s *store.Store, slotLSN store.LSN, c store.WatermarkCandidate) (bool, store.WatermarkCandidate, error) {
	return s.AdvanceWatermark(context.Background(), "wm_guard", slotLSN, c)
}

// Issue 30 item 2, as every reader sees it: a watermark whose record says
// another cluster (a copy by pg_dump), a later timeline or a position this
// server has not reached covers nothing: status counts the rows it seemed
// to cover as ready, prune keeps them, and IgnoredWatermarks says why; the
// same watermark stamped as this cluster's covers them.
func TestWatermarkOfAnotherClusterCoversNothing(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyNone)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, created_at) VALUES ('old-1', 'k', '{}', clock_timestamp() - interval '3 days'),
		('old-2', 'k', '{}', clock_timestamp() - interval '3 days')`)
	recordWatermark(t, pool, "copied")
	for _, c := range []struct{ name, set, reason string }{
		{"another cluster", `watermark_system_identifier = watermark_system_identifier + 1`, "another cluster"},
		{"a later timeline", `watermark_timeline = watermark_timeline + 1`, "timeline"},
		{"an unreached position", `watermark_lsn = 'FFFF/0'`, "past this server's WAL"},
		{"before 0016 without its slot", `watermark_system_identifier = NULL`, "before migration 0016"},
	} {
		t.Run(c.name, func(t *testing.T) {
			recordWatermark(t, pool, "copied")
			exec(t, pool, `UPDATE outbox_slots SET `+c.set+` WHERE slot_name = 'copied'`)
			counts, err := s.Counts(ctx)
			if err != nil || counts.ByState["ready"] != 2 || counts.ByState["published"] != 0 || counts.Watermark != nil {
				t.Errorf("counts %+v (%v): want 2 ready, none published, no watermark", counts, err)
			}
			if _, found, err := s.LatestWatermark(ctx); err != nil || found {
				t.Errorf("latest watermark found %v (%v), want none", found, err)
			}
			dry, err := s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 10, DryRun: true})
			if err != nil || dry.Published != 0 || dry.Covered != 0 {
				t.Errorf("prune dry run %+v (%v): want nothing to delete", dry, err)
			}
			ignored, err := s.IgnoredWatermarks(ctx)
			if err != nil || len(ignored) != 1 || ignored[0].Slot != "copied" || !strings.Contains(ignored[0].Reason, c.reason) {
				t.Errorf("ignored watermarks %+v (%v), want copied: %s", ignored, err, c.reason)
			}
		})
	}
	recordWatermark(t, pool, "copied")
	if counts, err := s.Counts(ctx); err != nil || counts.ByState["published"] != 2 {
		t.Errorf("this cluster's own watermark: counts %+v (%v), want both rows published", counts, err)
	}
}
