package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/outbox-relay/outbox-relay/internal/replay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/replication"
)

// Count is one labelled number of the overview.
type Count struct {
	Name string `json:"name"`
	N    int64  `json:"n"`
	// Bound says how exact N is where it is not: "estimate" (published on
	// a large table) or "at least" (ready beyond the rows looked at); see
	// store.Counts.
	Bound string `json:"bound,omitempty"`
}

// Sample is one point of the lag chart.
type Sample struct {
	At         time.Time `json:"at"`
	LagBytes   int64     `json:"lag_bytes"`
	LagSeconds float64   `json:"lag_seconds"`
}

// Health is the overview, also served as JSON for its refresh.
type Health struct {
	Role       string  `json:"role"`
	Slot       string  `json:"slot"`
	SlotExists bool    `json:"slot_exists"`
	SlotActive bool    `json:"slot_active"`
	SlotPID    int32   `json:"slot_pid"`
	WALStatus  string  `json:"wal_status"`
	LagBytes   int64   `json:"lag_bytes"`
	LagSeconds float64 `json:"lag_seconds"`
	LagSource  string  `json:"lag_source"`

	OldestEligibleSeconds float64 `json:"oldest_eligible_seconds"`
	ByState               []Count `json:"by_state"`
	// PublishedByWatermark counts the published rows that are ready rows
	// the watermark covers (--on-publish none, G17); Watermark is nil when
	// none was ever recorded. See store.Counts.
	PublishedByWatermark Count                  `json:"published_by_watermark"`
	Watermark            *store.WatermarkStatus `json:"watermark,omitempty"`
	FailedByReason       []Count                `json:"failed_by_reason"`
	RecentFailures       []Count                `json:"recent_failures"`
	BlockedAggregates    int64                  `json:"blocked_aggregates"`
	// BlockedAtLeast: BlockedAggregates is a lower bound, of the first
	// BlockedLookedAt held aggregates; Blocked are the oldest of those
	// (store.Counts).
	BlockedAtLeast  bool            `json:"blocked_aggregates_at_least"`
	BlockedLookedAt int             `json:"blocked_aggregates_looked_at"`
	Blocked         []store.Blocked `json:"blocked"`
	Standbys        []Standby       `json:"standbys"`
	Samples         []Sample        `json:"samples"`
	ChartPoints     string          `json:"chart_points"`
	ChartMaxBytes   int64           `json:"chart_max_bytes"`
	ReadAt          time.Time       `json:"read_at"`
	Problems        []string        `json:"problems"`
}

// cachedHealth is the overview as read at most one refresh interval ago.
// Every open tab and browser polls it every interval, and each read runs
// the table's counts: reading once per interval, and making requests that
// arrive while a read is under way wait for it, keeps the console's load on
// the database one overview per interval however many are watching (G16).
func (c *Console) cachedHealth(ctx context.Context) Health {
	c.hmu.Lock()
	for {
		if !c.healthAt.IsZero() && time.Since(c.healthAt) < c.o.Refresh {
			h := c.health
			c.hmu.Unlock()
			return h
		}
		if c.reading == nil {
			break
		}
		wait := c.reading
		c.hmu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
			return Health{Role: RoleConsoleOnly, Slot: c.src.Slot, ReadAt: time.Now().UTC(), Problems: []string{"read the overview: " + safeError(ctx.Err())}}
		}
		c.hmu.Lock()
	}
	done := make(chan struct{})
	c.reading = done
	c.hmu.Unlock()
	// Not the asker's context: others wait for this read, and a tab closed
	// mid-read must not fail it for them. readHealth bounds it.
	h := c.readHealth(context.WithoutCancel(ctx))
	c.hmu.Lock()
	c.health, c.healthAt, c.reading = h, time.Now(), nil
	c.hmu.Unlock()
	close(done)
	return h
}

// forgetHealth makes the next look at the overview read it afresh.
func (c *Console) forgetHealth() {
	c.hmu.Lock()
	c.healthAt = time.Time{}
	c.hmu.Unlock()
}

// readHealth gathers the overview. A part that cannot be read becomes a
// problem line rather than a failed page: the console is most needed when
// something is broken.
func (c *Console) readHealth(ctx context.Context) Health {
	c.reads.Add(1)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	h := Health{Role: RoleConsoleOnly, Slot: c.src.Slot, ReadAt: time.Now().UTC()}
	if c.src.Role != nil {
		h.Role = c.src.Role()
	}
	problem := func(what string, err error) {
		h.Problems = append(h.Problems, what+": "+safeError(err))
	}
	st := c.src.Store
	if c.src.Catalog != nil && c.src.Slot != "" {
		if ev, err := replay.Read(ctx, c.src.Catalog, st, c.src.Slot); err != nil {
			problem("read the slot", err)
		} else {
			hz := replay.Estimate(ev)
			h.SlotExists, h.SlotActive, h.SlotPID, h.WALStatus = ev.Slot.Exists, ev.Slot.Active, ev.Slot.ActivePID, ev.Slot.WALStatus
			h.LagBytes, h.LagSeconds, h.LagSource = ev.LagBytes, hz.Seconds, hz.Source
		}
	}
	if counts, err := st.Counts(ctx); err != nil {
		problem("count rows", err)
	} else {
		h.OldestEligibleSeconds = counts.OldestEligibleSeconds
		for _, s := range store.States {
			c := Count{Name: s, N: counts.ByState[s]}
			switch {
			case s == store.StatePublished && counts.PublishedEstimated:
				c.Bound = "estimate"
			case s == store.StateReady && counts.ReadyAtLeast:
				c.Bound = "at least"
			}
			h.ByState = append(h.ByState, c)
		}
		h.FailedByReason = sortedCounts(counts.FailedByReason)
		h.PublishedByWatermark = Count{Name: "published by the watermark", N: counts.PublishedByWatermark}
		if counts.PublishedByWatermarkAtLeast {
			h.PublishedByWatermark.Bound = "at least"
		}
		h.Watermark = counts.Watermark
		// Read with the counts, once: the statement costs a bounded amount
		// (store.BlockedLookAt), but it need not run twice.
		h.BlockedAggregates, h.BlockedAtLeast, h.BlockedLookedAt, h.Blocked = counts.BlockedAggregates, counts.BlockedAggregatesAtLeast, counts.BlockedAggregatesLookedAt, counts.Blocked
	}
	if recent, err := st.RecentFailures(ctx, RecentWindow); err != nil {
		problem("read recent failures", err)
	} else {
		h.RecentFailures = sortedCounts(recent)
	}
	if c.src.Standbys != nil {
		if sb, err := c.src.Standbys(ctx); err != nil {
			problem("read standbys", err)
		} else {
			h.Standbys = sb
		}
	}
	h.Samples = c.sample(h)
	h.ChartPoints, h.ChartMaxBytes = chart(h.Samples, chartWidth, chartHeight)
	return h
}

// sample adds h to the chart when the last sample is a refresh old. The
// chart fills while someone watches: sampling needs no goroutine of its own
// and costs nothing when nobody looks.
func (c *Console) sample(h Health) []Sample {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := h.ReadAt
	if n := len(c.samples); n == 0 || now.Sub(c.samples[n-1].At) >= c.o.Refresh*9/10 {
		c.samples = append(c.samples, Sample{At: now, LagBytes: h.LagBytes, LagSeconds: h.LagSeconds})
	}
	// Drop samples older than the chart's span, and any before a gap: a
	// line across an hour nobody watched would draw a lag nobody measured.
	first := 0
	for i := len(c.samples) - 1; i > 0; i-- {
		if c.samples[i].At.Sub(c.samples[i-1].At) > 3*c.o.Refresh {
			first = i
			break
		}
	}
	span := time.Duration(c.o.ChartSamples) * c.o.Refresh
	for first < len(c.samples)-1 && now.Sub(c.samples[first].At) > span {
		first++
	}
	c.samples = append([]Sample(nil), c.samples[first:]...)
	return append([]Sample(nil), c.samples...)
}

const chartWidth, chartHeight = 300, 60

// chart turns samples into an SVG polyline's points, scaled to the largest
// lag in bytes (at least 1 KiB, so an idle relay draws a flat line at the
// bottom rather than noise across the whole height).
func chart(samples []Sample, w, h int) (string, int64) {
	if len(samples) == 0 {
		return "", 0
	}
	top := int64(1 << 10)
	for _, s := range samples {
		top = max(top, s.LagBytes)
	}
	t0, t1 := samples[0].At, samples[len(samples)-1].At
	span := t1.Sub(t0).Seconds()
	var b strings.Builder
	for i, s := range samples {
		x := float64(w)
		if span > 0 {
			x = s.At.Sub(t0).Seconds() / span * float64(w)
		}
		y := float64(h) - float64(s.LagBytes)/float64(top)*float64(h-2) - 1
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(strconv.FormatFloat(x, 'f', 1, 64) + "," + strconv.FormatFloat(y, 'f', 1, 64))
	}
	return b.String(), top
}

func sortedCounts(m map[string]int64) []Count {
	out := make([]Count, 0, len(m))
	for k, v := range m {
		out = append(out, Count{Name: k, N: v})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].N != out[j].N {
			return out[i].N > out[j].N
		}
		return out[i].Name < out[j].Name
	})
	return out
}

var (
	urlCreds = regexp.MustCompile(`://[^@/\s]*@`)
	kvSecret = regexp.MustCompile(`(?i)(password|passwd|pwd|sslpassword|token)\s*=\s*('[^']*'|\S+)`)
)

// safeError is an error as a page may show it: PostgreSQL's own message
// for a server error, else the text with anything that looks like a
// credential removed. A connection string never reaches a page.
func safeError(err error) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return "timed out"
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Severity + ": " + pg.Message + " (SQLSTATE " + pg.Code + ")"
	}
	s := urlCreds.ReplaceAllString(err.Error(), "://xxxxx@")
	return kvSecret.ReplaceAllString(s, "$1=xxxxx")
}

func (c *Console) healthJSON(w http.ResponseWriter, r *http.Request) {
	h := c.cachedHealth(r.Context())
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	// The default escapes <, > and & as \u003c...: JSON that holds a
	// hostile reason stays inert even if something renders it as HTML.
	if err := enc.Encode(h); err != nil {
		return // the client went away
	}
}

// StandbysFromRegistry reads the standbys delivery waits for from the
// relay's metrics (outbox_relay_standby_lag_bytes and
// outbox_relay_standby_slot_missing), which its standby gate keeps.
func StandbysFromRegistry(g prometheus.Gatherer) func(context.Context) ([]Standby, error) {
	return func(context.Context) ([]Standby, error) {
		mfs, err := g.Gather()
		if err != nil {
			return nil, fmt.Errorf("gather metrics: %w", err)
		}
		by := map[string]*Standby{}
		get := func(slot string) *Standby {
			if by[slot] == nil {
				by[slot] = &Standby{Slot: slot}
			}
			return by[slot]
		}
		for _, mf := range mfs {
			name := mf.GetName()
			if name != "outbox_relay_standby_lag_bytes" && name != "outbox_relay_standby_slot_missing" {
				continue
			}
			for _, m := range mf.GetMetric() {
				slot := ""
				for _, l := range m.GetLabel() {
					if l.GetName() == "slot" {
						slot = l.GetValue()
					}
				}
				v := m.GetGauge().GetValue()
				if name == "outbox_relay_standby_lag_bytes" {
					get(slot).LagBytes = int64(v)
				} else if v > 0 {
					get(slot).Missing = true
				}
			}
		}
		out := make([]Standby, 0, len(by))
		for _, s := range by {
			out = append(out, *s)
		}
		sort.Slice(out, func(i, j int) bool { return out[i].Slot < out[j].Slot })
		return out, nil
	}
}

// StandbysFromCatalog reads the named standbys' positions from the
// server, for the console command, which has no relay's metrics.
func StandbysFromCatalog(q replication.Querier, slots []string) func(context.Context) ([]Standby, error) {
	return func(ctx context.Context) ([]Standby, error) {
		ps, err := replication.StandbyPositions(ctx, q, slots)
		if err != nil {
			return nil, err
		}
		out := make([]Standby, len(ps))
		for i, p := range ps {
			out[i] = Standby{Slot: p.Slot, LagBytes: p.Lag, Missing: !p.Exists}
		}
		return out, nil
	}
}
