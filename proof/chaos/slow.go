package chaos

import (
	"bufio"
	"context"
	"os"
	"strings"
	"time"
)

// brokerSlowDelay is how late broker-slow delivers what the broker sends
// the relay: more than a second, so that every answer (publish acks, the
// read-back's fetches and stream infos, the connect handshake) arrives
// after waits sized for a healthy broker on a LAN, and well under the
// relays' --ack-timeout (5 s), so that it costs session restarts at most,
// never a row.
const brokerSlowDelay = 1300 * time.Millisecond

// brokerSlowStart is how long broker-slow keeps the answers late after it
// started the killed relay again: nats.go's connect handshake (INFO, then
// PONG: two answers) must fit in its 2 s timeout, which one attempt shows.
const brokerSlowStart = 2500 * time.Millisecond

// brokerSlowRead is how long broker-slow answers late from the restarted
// relay's first fetch from the stream on.
const brokerSlowRead = 3 * time.Second

func clockOf(t time.Time) string {
	if t.IsZero() {
		return "(none seen)"
	}
	return t.UTC().Format("15:04:05.000")
}

// fetchTrigger is what a client sends to fetch from a consumer of the
// chaos stream: the relay reads the stream (its read-back, the poller's
// lookups) through such fetches, and its start-up check of the stream
// creates a consumer without fetching.
const fetchTrigger = "$JS.API.CONSUMER.MSG.NEXT." + streamName + "."

// streamingRelay waits up to timeout for a relay to stream the slot and
// returns it with its walsender's pid (0: none did).
func (r *runner) streamingRelay(ctx context.Context, timeout time.Duration) (*relayInst, int32, error) {
	deadline := time.Now().Add(timeout)
	for {
		ri, pid, err := r.activeRelay(ctx)
		if err != nil || pid != 0 || time.Now().After(deadline) || ctx.Err() != nil {
			return ri, pid, err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// brokerSlow is broker-slow: the broker answers the streaming relay late
// (brokerSlowDelay), across a kill -9 and a restart. The relay's proxy to
// NATS delays only what the server sends (acks, API answers, pushed
// messages); its publishes arrive and are stored at once. Under load with
// its acks late (rows stored, not yet acked, so not confirmed), the relay
// is SIGKILLed and started again while the answers stay late for
// brokerSlowStart: its connect handshake meets the slow broker. Then the
// proxy passes everything again until the restarted relay fetches from the
// stream (fetchTrigger: its read-back, G18) and answers late from that
// fetch on, so that the read-back that must find those stored rows is
// answered late without the start-up's dozen round trips before it taking
// a dozen times the delay. It bites when the restarted relay's read-back
// completed after the proxy began answering its read late; a start that
// could not connect while slow is counted from the relay's log ("connect
// to NATS") and reported, not taken for a bite.
func (r *runner) brokerSlow(ctx context.Context, kind, label string) error {
	ri, pid, err := r.streamingRelay(ctx, 10*time.Second)
	if err != nil {
		return err
	}
	if pid == 0 || !ri.running() {
		r.skip(kind, "no relay streams the slot")
		return nil
	}
	delayed := ri.nsProxy.Delayed()
	heal := func() { ri.nsProxy.Set(Pass, 0) }
	ri.nsProxy.Set(SlowReplies, brokerSlowDelay)
	r.count(kind)
	// Under load for a while first: the acks come late, the in-flight
	// window fills with stored, unanswered publishes.
	r.pause(ctx, r.between(time.Second, 2*time.Second))
	if err := ri.kill(); err != nil {
		heal()
		return err
	}
	offset := logSize(ri.logPath)
	if err := ri.start(); err != nil {
		heal()
		return err
	}
	r.pause(ctx, brokerSlowStart)
	failedStarts := countLogLines(ri.logPath, offset, "connect to NATS")
	ri.nsProxy.Arm(fetchTrigger, brokerSlowDelay)
	var fired time.Time
	for t0 := time.Now(); time.Since(t0) < 15*time.Second && ctx.Err() == nil; time.Sleep(20 * time.Millisecond) {
		if fired = ri.nsProxy.Fired(); !fired.IsZero() {
			break
		}
	}
	if !fired.IsZero() {
		// The read-back fetches, and asks the broker when it gets nothing
		// (late, here): its first answers all come late. Its end is
		// answered on time again, which keeps the fault short: at 1.3 s an
		// answer a read-back of a dozen requests takes about 9 s.
		r.pause(ctx, brokerSlowRead)
	}
	heal()
	healed := time.Now()
	rb, ok := waitReadBack(ctx, ri.logPath, offset, 30*time.Second)
	delayed = ri.nsProxy.Delayed() - delayed
	late := ok && !fired.IsZero() && rb.started().Before(healed) && rb.Time.After(fired)
	bit := late && delayed > 0
	if bit {
		r.bit(kind)
	}
	r.logf("fault %s: SIGKILL relay %s (walsender %d) with its answers from NATS %v late, started it again: %d starts could not connect to NATS within %v of late answers; a read of the stream at %s, its answers late from then for %v; the read-back (seen: %v, %s, took %.2fs, answered late: %v) read %d, found %d replayed rows stored; %d chunks delayed in all (bit: %v)",
		label, ri.name, pid, brokerSlowDelay, failedStarts, brokerSlowStart, clockOf(fired), brokerSlowRead, ok, rb.from(), rb.Took/1000, late, rb.Read, rb.Stored, delayed, bit)
	// What the relay confirmed with its answers late must be in the
	// stream all the same.
	return r.g3Check(ctx, label, 0)
}

// countLogLines counts the lines of the log after offset that contain s.
func countLogLines(path string, offset int64, s string) int {
	f, err := os.Open(path)
	if err != nil {
		return 0
	}
	defer f.Close()
	if _, err := f.Seek(offset, 0); err != nil {
		return 0
	}
	n := 0
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		if strings.Contains(sc.Text(), s) {
			n++
		}
	}
	return n
}
