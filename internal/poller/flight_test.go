package poller

import (
	"context"
	"testing"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/internal/metrics"
)

// waitRoom lets a claim through while there is room for another batch, and
// otherwise waits for one to finish; with ctx already ended, "waited" shows
// as false.
func TestFlightRoom(t *testing.T) {
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	f := flight{done: make(chan int, 2)}
	if !f.waitRoom(ended, 2) {
		t.Fatal("no room with nothing in flight")
	}
	f.batches, f.bytes = 1, 100
	if !f.waitRoom(ended, 2) {
		t.Fatal("no room with one small batch of two in flight")
	}
	f.batches, f.bytes = 2, 200
	if f.waitRoom(ended, 2) {
		t.Fatal("room with two batches of two in flight")
	}
	f.done <- 100
	if !f.waitRoom(ended, 2) || f.batches != 1 || f.bytes != 100 {
		t.Fatalf("after one batch finished: %d batches, %d bytes in flight, want room, 1, 100", f.batches, f.bytes)
	}
	// Large payloads: one batch at a time, but never none.
	f.bytes = maxInFlightBytes
	if f.waitRoom(ended, 2) {
		t.Fatal("room beside a batch of maxInFlightBytes")
	}
	f.done <- maxInFlightBytes
	if !f.waitRoom(ended, 2) || f.batches != 0 || f.bytes != 0 {
		t.Fatalf("after the large batch finished: %d batches, %d bytes, want room, 0, 0", f.batches, f.bytes)
	}
	f.batches, f.bytes = 1, 2*maxInFlightBytes
	f.done <- 2 * maxInFlightBytes
	f.waitAll()
	if f.batches != 0 || f.bytes != 0 {
		t.Fatalf("after waitAll: %d batches, %d bytes", f.batches, f.bytes)
	}
}

// New keeps Pipeline × Batch within MaxInFlightRows, and at least one batch.
func TestPipelineBound(t *testing.T) {
	for _, c := range []struct{ pipeline, batch, want int }{
		{0, 100, DefaultPipeline},
		{4, 500, 4},
		{4, 1000, 2},
		{3, 5000, 1},
	} {
		p := New(Config{Pipeline: c.pipeline, Batch: c.batch}, nil, nil, zerolog.Nop(), metrics.New())
		if p.cfg.Pipeline != c.want {
			t.Errorf("Pipeline %d, Batch %d: %d batches in flight, want %d", c.pipeline, c.batch, p.cfg.Pipeline, c.want)
		}
	}
}
