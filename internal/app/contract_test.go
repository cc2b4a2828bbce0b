package app_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// G21 at start, through the daemon: a stream with a 1 s duplicate window
// (shorter than --backoff-max) on an R1 file store whose server syncs every
// 2 minutes (read from --nats-monitor-url) gets both warnings, with the
// fix, and the metric; a row with a deadline 6 s ahead is published with
// Nats-TTL and the stream removes it after the deadline. A stream with
// no_ack is refused: the relay does not start.
func TestBrokerContractAtStart(t *testing.T) {
	srv, err := testenv.StartNATS(testenv.NATSOptions{Monitor: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)
	env := testenv.Shared(t)
	dbURL := env.PG.CreateOutboxDatabase(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	logs := &testenv.LogBuffer{}
	addr := make(chan string, 1)
	o := app.Options{
		DatabaseURL: dbURL, NATSURL: srv.URL(), Table: testenv.OutboxTable, Slot: "outbox_relay", Publication: "outbox_relay",
		Stream: "CONTRACT", SubjectPrefix: "contract.", Policy: store.PolicyMark, DuplicateWindow: time.Second,
		AckTimeout: 2 * time.Second, StatusInterval: 200 * time.Millisecond, DrainTimeout: 5 * time.Second,
		MaxInFlight: 256, MaxInFlightBytes: 1 << 20, HTTPAddr: "127.0.0.1:0",
		Lease: 5 * time.Second, MaxAttempts: 3, BackoffMin: 10 * time.Millisecond, BackoffMax: 5 * time.Minute,
		PollInterval: 50 * time.Millisecond, DeadlineMargin: time.Second,
		DeadlineTTL: true, NATSMonitorURL: srv.MonitorURL(),
		Listening: func(a string) { addr <- a },
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- app.Run(rctx, o, zerolog.New(logs)) }()
	var base string
	select {
	case a := <-addr:
		base = "http://" + a
	case err := <-done:
		t.Fatalf("app.Run returned before listening: %v", err)
	}
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("app.Run: %v", err)
		}
	}()
	testenv.WaitFor(t, 30*time.Second, "/readyz 200 active", func() (bool, error) {
		code, body := get(t, base+"/readyz")
		return code == 200 && strings.TrimSpace(body) == "active", fmt.Errorf("%d %q", code, body)
	})
	for _, want := range []string{
		`"check":"duplicate_window"`, `duplicate window 1s is shorter than --backoff-max 5m0s`, `--dupe-window 5m0s`,
		`"check":"unsynced_store"`, `nats-server syncs to disk every 2m0s`, `sync_interval: always`,
	} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("no %s in the start's log:\n%s", want, logs.String())
		}
	}
	if strings.Contains(logs.String(), `"check":"msg_ttl"`) {
		t.Errorf("the stream the relay created does not allow TTL:\n%s", logs.String())
	}
	_, body := get(t, base+"/metrics")
	for _, check := range []string{"duplicate_window", "unsynced_store"} {
		if got := metric(body, "outbox_relay_broker_contract", `check="`+check+`",level="warn"`); got != 1 {
			t.Errorf("outbox_relay_broker_contract{check=%q} = %v, want 1", check, got)
		}
	}

	if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES ('due', 'k', '{}', clock_timestamp() + interval '6 seconds')`); err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(srv.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, "CONTRACT")
	if err != nil {
		t.Fatal(err)
	}
	var msg *jetstream.RawStreamMsg
	testenv.WaitFor(t, 10*time.Second, "the row with a deadline in the stream", func() (bool, error) {
		msg, err = st.GetLastMsgForSubject(ctx, "contract.k")
		return err == nil, err
	})
	if ttl := msg.Header.Get(wire.HeaderTTL); ttl != "6s" && ttl != "5s" {
		t.Errorf("Nats-TTL %q, want the 5-6 s left", ttl)
	}
	testenv.WaitFor(t, 15*time.Second, "the stream removed it past the deadline", func() (bool, error) {
		_, err := st.GetMsg(ctx, msg.Sequence)
		return errors.Is(err, jetstream.ErrMsgNotFound), err
	})
	var state string
	if err := conn.QueryRow(ctx, `SELECT state FROM outbox WHERE work_id = 'due'`).Scan(&state); err != nil || state != "published" {
		t.Errorf("row state %q (%v), want published", state, err)
	}

	// no_ack: refused at start, with the fix.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "NOACK", Subjects: []string{"noack.>"}, NoAck: true}); err != nil {
		t.Fatal(err)
	}
	o2 := o
	o2.Stream, o2.SubjectPrefix, o2.Slot, o2.HTTPAddr, o2.Listening = "NOACK", "noack.", "outbox_relay_noack", "", nil
	o2.DatabaseURL = env.PG.CreateOutboxDatabase(t)
	rctx2, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	err = app.Run(rctx2, o2, zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), "no_ack") || !strings.Contains(err.Error(), "nats stream edit NOACK") {
		t.Errorf("a no_ack stream: app.Run returned %v, want a refusal naming no_ack and its fix", err)
	}
}
