package console_test

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// 20,000 blocked aggregates (G12) timed the overview out: its counts and
// its list of blocked aggregates each ran the statement that joined every
// held aggregate back to the table, minutes here, and the page showed
// "timed out" where the operator needed the figures (G16). The overview
// reads within its own limit (10 s) now, without a problem line: at least
// store.BlockedLookAt blocked aggregates, the oldest five with their
// blocking rows, and the page says the count is a lower bound.
func TestOverviewWithManyBlockedAggregates(t *testing.T) {
	f := setup(t, console.Options{Token: token})
	oldest := testenv.InsertBlockedAggregates(t, f.Pool, f.Table, 20000)
	c := f.client(t, bearer())
	const limit = 10 * time.Second
	start := time.Now()
	_, j := c.get("/ui/api/health")
	took := time.Since(start)
	var h console.Health
	var bound struct {
		AtLeast bool `json:"blocked_aggregates_at_least"`
	}
	if err := json.Unmarshal([]byte(j), &h); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(j), &bound); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int64{}
	for _, s := range h.ByState {
		counts[s.Name] = s.N
	}
	if took > limit || len(h.Problems) > 0 {
		t.Fatalf("overview read in %s (limit %s), problems %q", took, limit, h.Problems)
	}
	if h.BlockedAggregates != store.BlockedLookAt || !bound.AtLeast || len(h.Blocked) != 5 ||
		h.Blocked[0].WorkID != oldest || h.Blocked[0].Waiting != 1 {
		t.Errorf("blocked aggregates %d (at least %v), oldest %+v; want at least %d, the oldest %s with 1 waiting",
			h.BlockedAggregates, bound.AtLeast, h.Blocked, store.BlockedLookAt, oldest)
	}
	if counts["failed"] != 6666 || counts["running"] != 6667 || counts["scheduled"] != 6667+20000 {
		t.Errorf("counts by state %v", counts)
	}
	code, page := c.get("/ui/")
	if want := "10000+"; code != 200 || !strings.Contains(page, want) {
		t.Errorf("overview page: %d, without %q", code, want)
	}
	t.Logf("figures: the overview of 20,000 blocked aggregates read in %s (limit %s)", took.Round(time.Millisecond), limit)
}
