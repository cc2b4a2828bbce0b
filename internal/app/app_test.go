package app_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func get(t *testing.T, u string) (int, string) {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatalf("GET %s: %v", u, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

// metric reads one sample from a Prometheus text exposition: name with
// exactly these labels (in exposition order), -1 when absent.
func metric(body, name, labels string) float64 {
	series := name
	if labels != "" {
		series += "{" + labels + "}"
	}
	re := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`)
	m := re.FindStringSubmatch(body)
	if m == nil {
		return -1
	}
	v, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return -1
	}
	return v
}

// After a known load the metrics say what happened: 40 rows published on the
// CDC path, one rejected row handed to the poller and failed there, the rows
// by state read from the table, the slot owned and caught up. The database
// password given in the URL appears in no log line and no metric. With
// --on-publish none (G17) the same: the 40 rows stay 'ready' in the table,
// and the gauges count them published once the watermark covers them.
func TestMetricsAfterKnownLoad(t *testing.T) {
	for _, policy := range []store.Policy{store.PolicyMark, store.PolicyNone} {
		t.Run(string(policy), func(t *testing.T) { metricsAfterKnownLoad(t, policy) })
	}
}

func metricsAfterKnownLoad(t *testing.T, policy store.Policy) {
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	const password = "pw-never-logged-7731"
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.UserPassword(u.User.Username(), password) // trust auth ignores it; the relay must still hide it
	ctx := context.Background()
	tbl := testenv.OutboxTable
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	logs := &testenv.LogBuffer{}
	addr := make(chan string, 1)
	o := app.Options{
		DatabaseURL: u.String(), NATSURL: env.NATS.URL(), Table: tbl, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: stream, SubjectPrefix: prefix, Policy: policy, DuplicateWindow: 2 * time.Minute,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20,
		HTTPAddr: "127.0.0.1:0", StatsInterval: 200 * time.Millisecond,
		Lease: 5 * time.Second, MaxAttempts: 1, BackoffMin: 10 * time.Millisecond, BackoffMax: 10 * time.Millisecond,
		PollInterval: 50 * time.Millisecond,
		Listening:    func(a string) { addr <- a },
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx, o, zerolog.New(logs).Level(zerolog.DebugLevel)) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
		if strings.Contains(logs.String(), password) {
			t.Errorf("the database password appears in the logs:\n%s", logs.String())
		}
	}()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		done <- err
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	testenv.WaitFor(t, 30*time.Second, "/readyz 200 active", func() (bool, error) {
		code, body := get(t, base+"/readyz")
		return code == 200 && strings.TrimSpace(body) == "active", fmt.Errorf("%d %q", code, body)
	})

	for i := range 40 {
		if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'load', '{}')`, fmt.Sprintf("m-%d", i)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, subject, payload) VALUES ('bad', 'load', 'not a subject', '{}')`); err != nil {
		t.Fatal(err)
	}
	var body string
	testenv.WaitFor(t, 30*time.Second, "metrics after the load", func() (bool, error) {
		_, body = get(t, base+"/metrics")
		ok := metric(body, "outbox_relay_rows", `state="published"`) == 40 &&
			metric(body, "outbox_relay_rows", `state="failed"`) == 1 &&
			metric(body, "outbox_relay_slot_lag_seconds", "") == 0
		return ok, nil
	})
	checks := []struct {
		name, labels string
		want         float64
	}{
		{"outbox_relay_messages_published_total", `path="cdc",result="ok"`, 40},
		{"outbox_relay_commit_to_ack_seconds_count", "", 40},
		{"outbox_relay_handoffs_total", `reason="rejected"`, 1},
		{"outbox_relay_failures_total", `class="rejected",reason="invalid_subject"`, 2}, // the CDC rejection and the poller's one attempt
		{"outbox_relay_poller_claims_total", "", 1},
		{"outbox_relay_rows", `state="ready"`, 0},
		{"outbox_relay_rows", `state="scheduled"`, 0},
		{"outbox_relay_slot_owner", "", 1},
		{"outbox_relay_in_flight_messages", "", 0},
		{"outbox_relay_backfilled_rows_total", "", 0},
		{"outbox_relay_slots_created_total", "", 1},
		{"outbox_relay_role", `role="active"`, 1},
		{"outbox_relay_role", `role="standby"`, 0},
		{"outbox_relay_dead_letters_total", `class="rejected"`, 1},
	}
	for _, c := range checks {
		if got := metric(body, c.name, c.labels); got != c.want {
			t.Errorf("%s{%s} = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	wantState := "published"
	if policy == store.PolicyNone {
		wantState = "ready" // left as inserted
	}
	var asInserted int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id LIKE 'm-%' AND state = $1`, wantState).Scan(&asInserted); err != nil || asInserted != 40 {
		t.Errorf("%d of the 40 rows are %s in the table (%v)", asInserted, wantState, err)
	}
	if code, _ := get(t, base+"/healthz"); code != 200 {
		t.Errorf("/healthz answered %d", code)
	}
	if strings.Contains(body, password) {
		t.Error("the database password appears in /metrics")
	}
}
