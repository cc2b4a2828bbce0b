package relay_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// scrape reads the sum of a counter's series (any labels) from /metrics.
func scrape(t *testing.T, base, name string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, m := range regexp.MustCompile(`(?m)^`+regexp.QuoteMeta(name)+`(?:\{[^}]*\})? (\S+)$`).FindAllStringSubmatch(string(b), -1) {
		v, err := strconv.ParseFloat(m[1], 64)
		if err != nil {
			t.Fatalf("%s: %v", m[0], err)
		}
		sum += v
	}
	return sum
}

// Every deadline PostgreSQL can hold means the same on both paths (issue
// 20, items 1 and 2). Rows a producer could write before migration 0008
// (its insert guard off for them): '-infinity', and the instant that is
// time.Time's zero, have always passed: neither path publishes them, both
// end expired with the evidence. 'infinity' and a year past 9999 have no
// RFC 3339 form: both paths reject them (invalid_deadline) rather than
// publish a header a receiver must call malformed. And expired_total
// counts each expired row once (the CDC path's hand-off of a row at its
// deadline was counted, then the sweep's expiry of the same row).
func TestDeadlineEdgesOnBothPaths(t *testing.T) {
	t.Parallel() // a database, stream and slot of its own
	h := newHarness(t, sharedSetup(t))
	h.opts.MaxAttempts = 1
	h.opts.HTTPAddr = "127.0.0.1:0"
	addr := make(chan string, 1)
	h.opts.Listening = func(a string) { addr <- a }
	h.start()
	base := "http://" + <-addr
	ctx := context.Background()

	h.exec(`ALTER TABLE outbox DISABLE TRIGGER outbox_times_check`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES
		('cdc-neg', 'k', '{}', '-infinity'),
		('cdc-zero', 'k', '{}', '0001-01-01 00:00:00+00'),
		('cdc-inf', 'k', '{}', 'infinity'),
		('cdc-far', 'k', '{}', '12026-11-30 05:04:42+00')`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, state, expires_at) VALUES
		('poll-neg', 'k', '{}', 'scheduled', '-infinity'),
		('poll-inf', 'k', '{}', 'scheduled', 'infinity'),
		('poll-far', 'k', '{}', 'scheduled', '12026-11-30 05:04:42+00')`)
	h.exec(`ALTER TABLE outbox ENABLE TRIGGER outbox_times_check`)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES
		('late', 'k', '{}', clock_timestamp() - interval '1 second'),
		('edge', 'k', '{}', '9999-12-31 23:59:59.999999+00')`)

	testenv.WaitFor(t, 60*time.Second, "every row settled", func() (bool, error) {
		return h.countState("expired") == 4 && h.countState("failed") == 4 && h.countState("published") == 1,
			fmt.Errorf("expired %d, failed %d, published %d, scheduled %d, ready %d", h.countState("expired"), h.countState("failed"),
				h.countState("published"), h.countState("scheduled"), h.countState("ready"))
	})
	byID, _ := h.streamMsgs()
	if len(byID) != 1 || byID["edge"] == nil {
		t.Errorf("stream holds %d messages, want edge alone", len(byID))
	}
	if got := byID["edge"].Header.Get(wire.HeaderExpiresAt); got != "9999-12-31T23:59:59.999999Z" {
		t.Errorf("edge: %s %q, want 9999-12-31T23:59:59.999999Z", wire.HeaderExpiresAt, got)
	}
	for id, want := range map[string]string{
		"cdc-neg":  "expired: deadline -infinity passed; never attempted",
		"cdc-zero": "expired: deadline 0001-01-01T00:00:00.000000Z passed; never attempted",
		"poll-neg": "expired: deadline -infinity passed; never attempted",
		"late":     "passed; never attempted",
		"cdc-inf":  "rejected: invalid_deadline: row cdc-inf: expires_at infinity is out of range",
		"cdc-far":  "rejected: invalid_deadline: row cdc-far: expires_at 12026-11-30T05:04:42Z is out of range",
		"poll-inf": "rejected: invalid_deadline: row poll-inf: expires_at infinity is out of range",
		"poll-far": "rejected: invalid_deadline: row poll-far: expires_at 12026-11-30T05:04:42Z is out of range",
	} {
		var state, le string
		if err := h.pool.QueryRow(ctx, `SELECT state, coalesce(last_error, '') FROM outbox WHERE work_id = $1`, id).Scan(&state, &le); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(le, want) {
			t.Errorf("%s: %s, last_error %q; want %q", id, state, le, want)
		}
	}
	// Scraped after the last sweep that found a row: 4 rows, 4 counts.
	testenv.WaitFor(t, 10*time.Second, "expired_total settled", func() (bool, error) {
		got := scrape(t, base, "outbox_relay_expired_total")
		return got == 4, fmt.Errorf("outbox_relay_expired_total (all paths) = %v, want 4, one per expired row", got)
	})
	time.Sleep(time.Second) // a late double count would show now
	if got := scrape(t, base, "outbox_relay_expired_total"); got != 4 {
		t.Errorf("outbox_relay_expired_total (all paths) = %v, want 4, one per expired row", got)
	}
}
