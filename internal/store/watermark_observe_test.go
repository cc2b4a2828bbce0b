package store_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// recordWatermark records a watermark for slot as the relay does under
// --on-publish none, without a relay: a snapshot taken now, and the insert
// position read after it. Every transaction committed before this
// statement is covered; one still running is not.
func recordWatermark(t *testing.T, pool *pgxpool.Pool, slot string) {
	t.Helper()
	exec(t, pool, `INSERT INTO outbox_slots (slot_name) VALUES ($1) ON CONFLICT DO NOTHING`, slot)
	exec(t, pool, `UPDATE outbox_slots SET watermark_snapshot = pg_current_snapshot(), watermark_lsn = pg_current_wal_insert_lsn(),
		watermark_at = clock_timestamp(), watermark_system_identifier = (SELECT system_identifier FROM pg_control_system()),
		watermark_timeline = (SELECT timeline_id FROM pg_control_checkpoint()) WHERE slot_name = $1`, slot)
}

// seedWatermarked inserts, under --on-publish none: two ready rows a
// watermark covers (cov-old three days old, cov-new a minute old), a row the
// poller published, a scheduled and a failed row; a ready row inserted by a
// transaction still open when the watermark was recorded (long-1) and two
// inserted after it (inflight-old two days old, inflight new); and a ready
// row from before migration 0013 (legacy: no xact_id, three days old).
// Every ready row is due since it was created.
func seedWatermarked(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, created_at, available_at, published_at, stream_seq, stream_name) VALUES
		('cov-old', 'k', '{}', 'ready',     clock_timestamp() - interval '3 days',   clock_timestamp() - interval '3 days',   NULL, NULL, NULL),
		('cov-new', 'k', '{}', 'ready',     clock_timestamp() - interval '1 minute', clock_timestamp() - interval '1 minute', NULL, NULL, NULL),
		('pub-1',   'k', '{}', 'published', clock_timestamp() - interval '3 days',   clock_timestamp() - interval '3 days',   clock_timestamp() - interval '2 days', 7, 'OUTBOX'),
		('sched-1', 'k', '{}', 'scheduled', clock_timestamp() - interval '1 hour',   clock_timestamp() + interval '1 hour',   NULL, NULL, NULL),
		('legacy',  'k', '{}', 'ready',     clock_timestamp() - interval '3 days',   clock_timestamp() - interval '3 days',   NULL, NULL, NULL)`)
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, last_error) VALUES ('failed-1', 'k', '{}', 'failed', 'rejected: max_payload: x')`)
	exec(t, pool, `UPDATE outbox SET xact_id = NULL WHERE work_id = 'legacy'`)
	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := long.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ('long-1', 'k', '{}')`); err != nil {
		t.Fatal(err)
	}
	recordWatermark(t, pool, "s1")
	if err := long.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `INSERT INTO outbox (work_id, kind, payload, created_at, available_at) VALUES
		('inflight-old', 'k', '{}', clock_timestamp() - interval '2 days', clock_timestamp() - interval '2 days'),
		('inflight',     'k', '{}', clock_timestamp(), clock_timestamp())`)
}

// Under --on-publish none a ready row the watermark covers counts and
// shows as published (without a stream sequence), and one it does not
// (inserted after it, by a transaction open while it was recorded, or
// before migration 0013) as in flight: Counts, the oldest ready and
// eligible ages, the console's lists, filters and row.
func TestObserversReadTheWatermark(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyNone)
	seedWatermarked(t, pool)

	c, err := s.Counts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{"ready": 4, "published": 3, "scheduled": 1, "failed": 1}
	for st, n := range want {
		if c.ByState[st] != n {
			t.Errorf("%s: %d, want %d (counts %v)", st, c.ByState[st], n, c.ByState)
		}
	}
	if c.PublishedEstimated || c.PublishedByWatermark != 2 || c.PublishedByWatermarkAtLeast || c.ReadyAtLeast {
		t.Errorf("counts %+v: want published exact, 2 of them by the watermark, exactly", c)
	}
	if c.Watermark == nil || c.Watermark.Slot != "s1" || c.Watermark.LSN == "" || c.Watermark.AgeSeconds < 0 || c.Watermark.AgeSeconds > 60 {
		t.Errorf("watermark %+v", c.Watermark)
	}
	// The oldest due row in flight is inflight-old (two days) or legacy
	// (three days); cov-old, covered, is as old as legacy: the age is
	// legacy's. Without legacy it would be two days: checked below.
	day := 24 * time.Hour.Seconds()
	if c.OldestEligibleSeconds < 3*day-60 || c.OldestEligibleSeconds > 3*day+600 {
		t.Errorf("oldest eligible %.0fs, want about 3 days (legacy)", c.OldestEligibleSeconds)
	}
	exec(t, pool, `UPDATE outbox SET state = 'published', published_at = clock_timestamp(), stream_seq = 8 WHERE work_id = 'legacy'`)
	if c, err = s.Counts(ctx); err != nil {
		t.Fatal(err)
	}
	if c.OldestEligibleSeconds < 2*day-60 || c.OldestEligibleSeconds > 2*day+600 {
		t.Errorf("oldest eligible %.0fs, want about 2 days (inflight-old), not 3 (cov-old, covered)", c.OldestEligibleSeconds)
	}
	age, err := s.OldestReadySeconds(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if age < 2*day-60 || age > 2*day+600 {
		t.Errorf("oldest ready %.0fs, want about 2 days (inflight-old), not 3 (cov-old, covered)", age)
	}

	list := func(state string) (ids []string, rows map[string]store.ListedRow) {
		t.Helper()
		got, err := s.ListRows(ctx, store.ListFilter{State: state, Limit: 100})
		if err != nil {
			t.Fatal(err)
		}
		rows = map[string]store.ListedRow{}
		for _, r := range got {
			ids = append(ids, r.WorkID)
			rows[r.WorkID] = r
		}
		slices.Sort(ids)
		return ids, rows
	}
	if ids, rows := list("published"); !slices.Equal(ids, []string{"cov-new", "cov-old", "legacy", "pub-1"}) ||
		!rows["cov-old"].Covered || rows["cov-old"].ShownState() != "published" || rows["cov-old"].StreamSeq != nil ||
		rows["pub-1"].Covered || rows["pub-1"].ShownState() != "published" {
		t.Errorf("published filter: %v %+v", ids, rows)
	}
	if ids, rows := list("ready"); !slices.Equal(ids, []string{"inflight", "inflight-old", "long-1"}) || rows["long-1"].Covered {
		t.Errorf("ready filter: %v, want the rows in flight only", ids)
	}
	if _, rows := list(""); rows["cov-new"].ShownState() != "published" || rows["inflight"].ShownState() != "ready" || rows["long-1"].ShownState() != "ready" {
		t.Errorf("all rows: cov-new %s, inflight %s, long-1 %s", rows["cov-new"].ShownState(), rows["inflight"].ShownState(), rows["long-1"].ShownState())
	}
	for id, covered := range map[string]bool{"cov-old": true, "cov-new": true, "long-1": false, "inflight": false} {
		r, ok, err := s.Row(ctx, id)
		if err != nil || !ok || r.Covered != covered || r.State != "ready" {
			t.Errorf("row %s: covered %v, state %s (%v %v); want covered %v", id, r.Covered, r.State, ok, err, covered)
		}
	}
	ids, more, err := s.ListWorkIDs(ctx, store.ListFilter{State: "ready"}, 10)
	if err != nil || more || len(ids) != 3 || slices.Contains(ids, "cov-new") {
		t.Errorf("ready work IDs %v (more %v, %v)", ids, more, err)
	}

	// A newer watermark covers what an older one did and more: the rows
	// inserted since are published now.
	recordWatermark(t, pool, "s2")
	if c, err = s.Counts(ctx); err != nil {
		t.Fatal(err)
	}
	if c.ByState["ready"] != 0 || c.ByState["published"] != 7 || c.PublishedByWatermark != 5 || c.OldestEligibleSeconds != 0 || c.Watermark.Slot != "s2" {
		t.Errorf("after a newer watermark of another slot: %+v %+v", c, c.Watermark)
	}
}

// cancel and redrive refuse a ready row the watermark covers as published,
// saying so; one in flight as ready. Neither changes.
func TestOpsRefuseCoveredAsPublished(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyNone)
	seedWatermarked(t, pool)
	for _, a := range []store.Action{store.ActionCancel, store.ActionRedrive} {
		req := store.OpRequest{Selection: store.Selection{WorkIDs: []string{"cov-old", "inflight"}}, By: "op", Reason: "test"}
		var res store.OpResult
		var err error
		if a == store.ActionCancel {
			res, err = s.Cancel(ctx, req)
		} else {
			res, err = s.Redrive(ctx, req)
		}
		if err != nil || len(res.Changed) != 0 || len(res.Refused) != 2 {
			t.Fatalf("%s: %+v, %v", a, res, err)
		}
		why := map[string]store.Refusal{}
		for _, r := range res.Refused {
			why[r.WorkID] = r
		}
		cov, fl := why["cov-old"], why["inflight"]
		if cov.State != "published" || !cov.Covered || !strings.HasPrefix(cov.Why(a), "published (covered by the watermark") ||
			!strings.Contains(cov.Why(a), "the broker has it (terminal)") {
			t.Errorf("%s cov-old: %+v: %s", a, cov, cov.Why(a))
		}
		if fl.State != "ready" || fl.Covered || !strings.Contains(fl.Why(a), "already on its way through the CDC path") {
			t.Errorf("%s inflight: %+v: %s", a, fl, fl.Why(a))
		}
	}
	for _, id := range []string{"cov-old", "inflight"} {
		if r, _ := readRow(t, pool, "outbox", id); r.State != "ready" || r.RedrivenAt != nil {
			t.Errorf("%s = %+v", id, r)
		}
	}
}

// prune deletes the ready rows the watermark covers that were created
// before the cutoff, with the published ones, and says how many; never a
// ready row in flight, however old (inflight-old, legacy).
func TestPruneCoveredReady(t *testing.T) {
	ctx := context.Background()
	s, pool := newPollerStore(t, store.PolicyNone)
	seedWatermarked(t, pool)
	dry, err := s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 2, DryRun: true})
	if err != nil || dry.Published != 2 || dry.Covered != 1 {
		t.Fatalf("dry run: %+v, %v; want 2 published, 1 of them covered", dry, err)
	}
	res, err := s.Prune(ctx, store.PruneRequest{OlderThan: 24 * time.Hour, Batch: 2})
	if err != nil || res.Published != 2 || res.Covered != 1 {
		t.Fatalf("prune: %+v, %v; want 2 published, 1 of them covered", res, err)
	}
	for id, want := range map[string]bool{"cov-old": false, "pub-1": false, "cov-new": true, "legacy": true, "inflight-old": true,
		"inflight": true, "long-1": true, "sched-1": true, "failed-1": true} {
		if _, ok := readRow(t, pool, "outbox", id); ok != want {
			t.Errorf("%s exists = %v, want %v", id, ok, want)
		}
	}
}
