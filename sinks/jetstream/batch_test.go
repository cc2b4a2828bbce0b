package jetstream_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// newAtomicFixture is a fixture whose stream allows atomic batch publish
// (or not).
func newAtomicFixture(t *testing.T, allow bool) *fixture {
	t.Helper()
	f := newFixture(t)
	ctx := context.Background()
	st, err := f.js.Stream(ctx, f.stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := st.CachedInfo().Config
	cfg.AllowAtomicPublish = allow
	if _, err := f.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return f
}

func batchMsgs(f *fixture, prefix string, n int) []*wire.Message {
	ms := make([]*wire.Message, n)
	for i := range ms {
		id := fmt.Sprintf("%s-%d", prefix, i)
		ms[i] = &wire.Message{ID: id, Subject: f.prefix + "thing", Data: []byte(`{"i":` + fmt.Sprint(i) + `}`),
			Header: map[string][]string{wire.HeaderMsgID: {id}}}
	}
	return ms
}

func waitAll(t *testing.T, futs []sinks.Future) ([]sinks.Ack, []error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	acks, errs := make([]sinks.Ack, len(futs)), make([]error, len(futs))
	for i, fut := range futs {
		acks[i], errs[i] = fut.Wait(ctx)
	}
	return acks, errs
}

// A batch is stored whole, consecutively, each message acknowledged with
// its own sequence; stored again (a replay: every ID known) it is refused
// whole with ErrBatchRefused and stored nothing; its messages published
// again alone end as duplicates that name the sequences already stored.
// A batch of which the stream holds some IDs (an earlier publish row by
// row) is refused the same way, and republished alone the rest is stored
// once.
func TestAtomicBatchStoredWholeAndRefusedWhole(t *testing.T) {
	f := newAtomicFixture(t, true)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	ctx := context.Background()

	ms := batchMsgs(f, "tx1", 5)
	futs, errs, err := sink.PublishBatch(ctx, ms)
	if err != nil {
		t.Fatal(err)
	}
	for i, e := range errs {
		if e != nil {
			t.Fatalf("message %d refused alone: %v", i, e)
		}
	}
	acks, werrs := waitAll(t, futs)
	for i := range acks {
		if werrs[i] != nil {
			t.Fatalf("message %d: %v", i, werrs[i])
		}
		if acks[i].Sequence != uint64(i+1) || acks[i].Stream != f.stream || acks[i].Duplicate {
			t.Fatalf("message %d acked %+v, want sequence %d in %s", i, acks[i], i+1, f.stream)
		}
	}
	for i := range ms {
		raw, err := mustStream(t, f.js, f.stream).GetMsg(ctx, uint64(i+1))
		if err != nil {
			t.Fatal(err)
		}
		if raw.Header.Get(jetstream.MsgIDHeader) != ms[i].ID || raw.Header.Get(natssink.HeaderBatchSeq) != fmt.Sprint(i+1) {
			t.Fatalf("sequence %d holds %v, want %s as batch message %d", i+1, raw.Header, ms[i].ID, i+1)
		}
	}

	// The replay: refused whole, nothing stored.
	replay := batchMsgs(f, "tx1", 5)
	futs, _, err = sink.PublishBatch(ctx, replay)
	if err != nil {
		t.Fatal(err)
	}
	_, werrs = waitAll(t, futs)
	var apiErr *jetstream.APIError
	for i, e := range werrs {
		if !errors.Is(e, sinks.ErrBatchRefused) || !errors.As(e, &apiErr) || apiErr.ErrorCode != 10201 {
			t.Fatalf("replayed message %d: %v, want the batch refused whole (10201)", i, e)
		}
	}
	if n := streamMsgs(t, f); n != 5 {
		t.Fatalf("stream holds %d messages after the refused replay, want 5", n)
	}
	for i, m := range replay {
		fut, err := sink.Republish(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := fut.Wait(ctx)
		if err != nil || !ack.Duplicate || ack.Sequence != uint64(i+1) {
			t.Fatalf("republished %s: %+v, %v; want a duplicate of sequence %d", m.ID, ack, err, i+1)
		}
	}

	// Partly stored: two of four rows published one by one before.
	part := batchMsgs(f, "tx2", 4)
	for _, m := range []*wire.Message{batchMsgs(f, "tx2", 4)[1], batchMsgs(f, "tx2", 4)[3]} {
		fut, err := sink.Publish(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := fut.Wait(ctx); err != nil {
			t.Fatal(err)
		}
	}
	futs, _, err = sink.PublishBatch(ctx, part)
	if err != nil {
		t.Fatal(err)
	}
	_, werrs = waitAll(t, futs)
	for i, e := range werrs {
		if !errors.Is(e, sinks.ErrBatchRefused) {
			t.Fatalf("partly stored batch, message %d: %v, want refused whole", i, e)
		}
	}
	dups := 0
	for _, m := range part {
		fut, err := sink.Republish(ctx, m)
		if err != nil {
			t.Fatal(err)
		}
		ack, err := fut.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if ack.Duplicate {
			dups++
		}
	}
	if n := streamMsgs(t, f); dups != 2 || n != 9 {
		t.Fatalf("after republishing: %d duplicates, stream holds %d; want 2 and 9 (5 + 4, each once)", dups, n)
	}
}

// On a stream without atomic publish the batch fails as an outage (the
// session's contract check says the fix), not as a batch to republish row
// by row: that would lose the promise without a word.
func TestAtomicBatchOnAStreamWithoutIt(t *testing.T) {
	f := newAtomicFixture(t, false)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	futs, _, err := sink.PublishBatch(context.Background(), batchMsgs(f, "tx", 3))
	if err != nil {
		t.Fatal(err)
	}
	_, werrs := waitAll(t, futs)
	var apiErr *jetstream.APIError
	for i, e := range werrs {
		if e == nil || errors.Is(e, sinks.ErrBatchRefused) || !errors.As(e, &apiErr) || apiErr.ErrorCode != 10174 {
			t.Fatalf("message %d: %v, want the outage 10174 (atomic publish disabled)", i, e)
		}
		if _, rejected := wire.IsRejected(e); rejected {
			t.Fatalf("message %d: rejected (%v), want an outage", i, e)
		}
	}
	if n := streamMsgs(t, f); n != 0 {
		t.Fatalf("stream holds %d messages, want 0", n)
	}
}

func streamMsgs(t *testing.T, f *fixture) uint64 {
	t.Helper()
	info, err := mustStream(t, f.js, f.stream).Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Msgs
}
