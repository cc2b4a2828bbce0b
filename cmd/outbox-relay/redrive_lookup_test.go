package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// G18, issue 31 item 2: an uncertain dead letter whose message the stream
// does hold, redriven after the stream's duplicate window (1 s) passed, is
// found in the stream and settled as published with the sequence found:
// after the poller ran, the stream holds it once (before the lookup, twice).
// The one the stream does not hold is redriven and published, once.
func TestRedriveCommandResolvesUncertainFromStream(t *testing.T) {
	url, pool := migrated(t)
	env := testenv.Shared(t)
	stream, prefix := env.StreamName(t)
	js := createStream(t, env.NATS.URL(), stream, prefix, time.Second)
	ctx := context.Background()
	m := nats.NewMsg(prefix + "k")
	m.Header.Set(jetstream.MsgIDHeader, "u-in")
	m.Data = []byte(`{}`)
	ack, err := js.PublishMsg(ctx, m) // the attempt whose ack never came
	if err != nil {
		t.Fatal(err)
	}
	mustExec(t, pool, `INSERT INTO outbox (work_id, kind, payload, state, attempts, last_error, available_at) VALUES
		('u-in', 'k', '{}', 'failed', 10, 'uncertain: no ack in time', clock_timestamp() - interval '1 second'),
		('u-out', 'k', '{}', 'failed', 10, 'uncertain: no ack in time', clock_timestamp() - interval '1 second')`)
	time.Sleep(1500 * time.Millisecond) // past the duplicate window

	code, out, errOut := run(t, "redrive", "--database-url", url, "--reason", "r", "--work-id", "u-in", "--work-id", "u-out", "--stagger", "0s",
		"--nats-url", env.NATS.URL(), "--stream", stream, "--subject-prefix", prefix)
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	if want := "found u-in: stream " + stream + " sequence " + strconv.FormatUint(ack.Sequence, 10) + ": settled as published, not sent again"; !strings.Contains(out, want) {
		t.Errorf("stdout %q, want %q", out, want)
	}
	if !strings.Contains(out, "1 found, 1 not found, 0 inconclusive") || strings.Contains(errOut, "WARNING") {
		t.Errorf("stdout %q, stderr %q: want one found, one ruled out, no warning", out, errOut)
	}

	// The poller publishes what is due.
	sjs, err := jetstream.New(js.Conn())
	if err != nil {
		t.Fatal(err)
	}
	p := poller.New(poller.Config{WorkerID: "w", SubjectPrefix: prefix}.WithDefaults(), store.New(pool, store.Table{Schema: "public", Name: "outbox"}, store.PolicyMark),
		natssink.New(sjs, natssink.Options{Stream: stream, SubjectPrefix: prefix}), zerolog.New(zerolog.NewTestWriter(t)), metrics.New())
	if _, err := p.Poll(ctx); err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	c, err := js.OrderedConsumer(ctx, stream, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	for {
		msg, err := c.Next(jetstream.FetchMaxWait(300 * time.Millisecond))
		if err != nil {
			break
		}
		counts[msg.Headers().Get(jetstream.MsgIDHeader)]++
	}
	if counts["u-in"] != 1 || counts["u-out"] != 1 {
		t.Errorf("stream holds %v, want u-in and u-out once each", counts)
	}
	var state string
	var seq *int64
	if err := pool.QueryRow(ctx, `SELECT state, stream_seq FROM outbox WHERE work_id = 'u-in'`).Scan(&state, &seq); err != nil {
		t.Fatal(err)
	}
	if state != "published" || seq == nil || uint64(*seq) != ack.Sequence {
		t.Errorf("u-in: %s at %d, want published at the found sequence %d", state, derefSeq(seq), ack.Sequence)
	}
}

func derefSeq(p *int64) int64 {
	if p == nil {
		return 0
	}
	return *p
}
