package main

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// 20,000 blocked aggregates (G12) made `status` and `status --json` fail
// with a statement timeout after 10 s (app.ObserverStatementTimeout): the
// blocked-aggregates statement joined every held aggregate back to the
// table (G16). Now both answer well within it: the count stops at the
// first store.BlockedLookAt held aggregates and says it is a lower bound,
// as status prints its other lower bounds, and the oldest blocked
// aggregate of those is named with its blocking row.
func TestStatusWithManyBlockedAggregates(t *testing.T) {
	url, pool := migrated(t)
	oldest := testenv.InsertBlockedAggregates(t, pool, testenv.OutboxTable, 20000)
	limit := app.ObserverStatementTimeout
	timed := func(args ...string) (string, time.Duration) {
		t.Helper()
		start := time.Now()
		code, out, stderr := run(t, args...)
		took := time.Since(start)
		if code != 0 || took > limit {
			t.Fatalf("%s: exit %d after %s (limit %s): %s", strings.Join(args, " "), code, took, limit, stderr)
		}
		return out, took
	}
	out, tookJSON := timed("status", "--json", "--database-url", url)
	var rep struct {
		ByState  map[string]int64 `json:"by_state"`
		Blocked  int64            `json:"blocked_aggregates"`
		AtLeast  bool             `json:"blocked_aggregates_at_least"`
		LookedAt int              `json:"blocked_aggregates_looked_at"`
		Oldest   *store.Blocked   `json:"oldest_blocked"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Blocked != store.BlockedLookAt || !rep.AtLeast || rep.LookedAt != store.BlockedLookAt ||
		rep.Oldest == nil || rep.Oldest.WorkID != oldest || rep.Oldest.Waiting != 1 || rep.Oldest.State != store.StateScheduled {
		t.Errorf("status --json: blocked %d, at least %v, looked at %d, oldest %+v; want at least %d, the oldest %s (scheduled) with 1 waiting",
			rep.Blocked, rep.AtLeast, rep.LookedAt, rep.Oldest, store.BlockedLookAt, oldest)
	}
	if rep.ByState["failed"] != 6666 || rep.ByState["running"] != 6667 || rep.ByState["scheduled"] != 6667+20000 {
		t.Errorf("status --json: by state %v", rep.ByState)
	}
	text, tookText := timed("status", "--database-url", url)
	if want := `blocked aggregates: 10000 or more (only the first 10000 held aggregates are looked at); oldest of those "order"/"blk-000001": 1 rows wait behind ` + oldest; !strings.Contains(text, want) {
		t.Errorf("status lacks %q", want)
	}
	t.Logf("figures: status of 20,000 blocked aggregates in %s, --json in %s (limit %s)", tookText.Round(time.Millisecond), tookJSON.Round(time.Millisecond), limit)
}
