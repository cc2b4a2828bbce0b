package jetstream_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

var benchRun atomic.Int64

// BenchmarkPublish publishes b.N messages through the sink to the test
// nats-server and waits for every ack, the way the relay does: one
// goroutine publishes, another waits for the futures in publish order, with
// at most window messages in flight. Messages carry the CDC path's headers.
// Building them is outside the timed part (in chunks, with the pipeline
// drained at each chunk's end). Besides ns/op and allocs/op it reports
// cpu-ns/op: this process's user+system CPU per message, which is what the
// sink costs the relay (ns/op also holds the server's share of the 2 cores).
func BenchmarkPublish(b *testing.B) {
	f := newFixture(b)
	sink := natssink.New(f.js, natssink.Options{Stream: f.stream, SubjectPrefix: f.prefix})
	ctx := context.Background()
	const window, chunk = 512, 4096
	subject := f.prefix + "order.placed"
	data := []byte(`{"order_id":"0f8fad5b-d9cb-469f-a165-70867728950e","customer":"c-1042","amount":12999,"currency":"EUR"}`)
	run := benchRun.Add(1)
	lsn, commit := "16/B374D848", time.Now().UTC().Format(time.RFC3339Nano)
	msgs := make([]wire.Message, chunk)

	queue := make(chan sinks.Future, window)
	drained := make(chan struct{})
	var failed atomic.Pointer[error]
	go func() {
		for fut := range queue {
			if fut == nil {
				drained <- struct{}{}
				continue
			}
			if _, err := fut.Wait(ctx); err != nil {
				e := err
				failed.CompareAndSwap(nil, &e)
			}
		}
	}()
	defer close(queue)

	var cpu time.Duration
	b.ReportAllocs()
	b.ResetTimer()
	for done := 0; done < b.N; {
		b.StopTimer()
		n := min(chunk, b.N-done)
		for i := range n {
			msgs[i] = wire.Message{
				ID:      "bench-" + strconv.FormatInt(run, 10) + "-" + strconv.Itoa(done+i),
				Subject: subject,
				Data:    data,
				Header: map[string][]string{
					wire.HeaderKind:       {"order.placed"},
					wire.HeaderCommitLSN:  {lsn},
					wire.HeaderCommitTime: {commit},
				},
			}
		}
		c0 := cpuTime()
		b.StartTimer()
		for i := range n {
			fut, err := sink.Publish(ctx, &msgs[i])
			if err != nil {
				b.Fatal(err)
			}
			queue <- fut
		}
		queue <- nil
		<-drained
		b.StopTimer()
		cpu += cpuTime() - c0
		done += n
		b.StartTimer()
	}
	b.StopTimer()
	if err := failed.Load(); err != nil {
		b.Fatal(*err)
	}
	b.ReportMetric(float64(cpu.Nanoseconds())/float64(b.N), "cpu-ns/op")
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
