package chaos

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// consumerReceivers are the durable consumers consumer-limit adds for the
// time of the fault, standing for the receivers of a real stream.
const consumerReceivers = 2

// consumerLimit is consumer-limit: the stream gets a max_consumers limit with
// other consumers present, leaving room for one read of the stream at a time
// per relay instance (what the relay's own error message asks an operator
// to allow: it creates one ephemeral consumer per read and deletes it at the
// end). Under the limit the streaming relay is SIGKILLed and started again,
// so that its start-up check of the stream (which refuses a stream at its
// limit), its read-back and its poller's lookups run against it; then the
// limit is lifted and the receivers deleted. The stream's consumer count is
// sampled all along. It bites when the restarted relay's read-back completed
// under the limit. An injection after which the relay did not read the
// stream back within 30 s, or delivered nothing in the hold after its
// read-back, counts as a stall (Report.ConsumerLimitStalls, must be 0).
func (r *runner) consumerLimit(ctx context.Context, kind, label string) error {
	ri, pid, err := r.streamingRelay(ctx, 10*time.Second)
	if err != nil {
		return err
	}
	if pid == 0 || !ri.running() {
		r.skip(kind, "no relay streams the slot")
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := r.js.Stream(cctx, streamName)
	if err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	var receivers []string
	for i := range consumerReceivers {
		name := fmt.Sprintf("chaos-receiver-%d", i+1)
		if _, err := st.CreateOrUpdateConsumer(cctx, jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
			return fmt.Errorf("%s: create consumer %s: %w", label, name, err)
		}
		receivers = append(receivers, name)
	}
	info, err := st.Info(cctx)
	if err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	before := info.Config.MaxConsumers
	present := info.State.Consumers
	limit := present + len(r.relays)
	cfg := info.Config
	cfg.MaxConsumers = limit
	if _, err := r.js.UpdateStream(cctx, cfg); err != nil {
		return fmt.Errorf("%s: set max_consumers %d: %w", label, limit, err)
	}
	r.count(kind)
	lift := func() error {
		lctx, lcancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer lcancel()
		var errs []error
		for _, name := range receivers {
			if err := st.DeleteConsumer(lctx, name); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				errs = append(errs, fmt.Errorf("delete consumer %s: %w", name, err))
			}
		}
		info, err := st.Info(lctx)
		if err == nil {
			cfg := info.Config
			cfg.MaxConsumers = before
			_, err = r.js.UpdateStream(lctx, cfg)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("lift max_consumers: %w", err))
		}
		return errors.Join(errs...)
	}
	// The count seen while the limit holds: the relay's reads come and go.
	sctx, stopSampling := context.WithCancel(ctx)
	var wg sync.WaitGroup
	maxSeen := present
	wg.Add(1)
	go func() {
		defer wg.Done()
		for sctx.Err() == nil {
			ictx, icancel := context.WithTimeout(sctx, 2*time.Second)
			if info, err := st.Info(ictx); err == nil {
				maxSeen = max(maxSeen, info.State.Consumers)
			}
			icancel()
			select {
			case <-sctx.Done():
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	r.logf("fault %s: stream %s max_consumers %d (%d consumers present, %d of them receivers added now): room for one read per relay instance", label, streamName, limit, present, consumerReceivers)
	if err := ri.kill(); err != nil {
		stopSampling()
		wg.Wait()
		return errors.Join(err, lift())
	}
	offset := logSize(ri.logPath)
	if err := ri.start(); err != nil {
		stopSampling()
		wg.Wait()
		return errors.Join(err, lift())
	}
	rb, ok := waitReadBack(ctx, ri.logPath, offset, 30*time.Second)
	last0, err := r.streamLastSeq(ctx)
	if err != nil {
		stopSampling()
		wg.Wait()
		return errors.Join(err, lift())
	}
	// Delivery goes on under the limit: the poller's lookups among it.
	r.pause(ctx, r.between(time.Second, 2*time.Second))
	last1, err := r.streamLastSeq(ctx)
	stopSampling()
	wg.Wait()
	if lerr := lift(); lerr != nil {
		return errors.Join(err, lerr)
	}
	if err != nil {
		return err
	}
	refused := countLogLines(ri.logPath, offset, "max_consumers") + countLogLines(ri.logPath, offset, "maximum consumers")
	bit := ok
	if bit {
		r.bit(kind)
	}
	// With room left for its reads, a relay that could not read the stream
	// back, or delivered nothing after it, stalled on the limit: a read
	// that did not give its consumer back, or one more than it needs.
	if !ok || last1 == last0 {
		r.mu.Lock()
		r.report.ConsumerLimitStalls++
		r.mu.Unlock()
	}
	r.logf("fault %s: SIGKILL relay %s (walsender %d), started again under the limit: read-back (seen: %v, %s) read %d, found %d stored; stream last seq %d -> %d in the hold after it; at most %d consumers seen of %d allowed; %d log lines about the limit; limit lifted (bit: %v)",
		label, ri.name, pid, ok, rb.from(), rb.Read, rb.Stored, last0, last1, maxSeen, limit, refused, bit)
	return r.g3Check(ctx, label, 0)
}
