package chaos

import (
	"context"
	"time"
)

// relayPausedRead is how long relay-paused gives the continued relay to
// read what reached it late before its own writes reach PostgreSQL again
// (its status updates to a walsender that is gone, the question of who
// holds the slot that the fence asks).
const relayPausedRead = time.Second

// relayPausedQuiet is the pause in the load before the stop: the relay
// publishes, and the broker acks, within milliseconds in normal flow.
const relayPausedQuiet = 300 * time.Millisecond

// relayPaused is relay-paused: SIGSTOP of the streaming relay for longer
// than wal_sender_timeout while a standby instance waits to take over, under
// load. The stopped relay's walsender times out, the standby streams the
// slot and publishes what the stopped one had not confirmed, and the
// stopped one is continued once the standby's copies are older than the
// duplicate window. What it then reads from its socket (WAL the walsender
// sent before it gave up) or still held must not be published: the
// standby stored it already, and past the window a second copy is stored
// (docs/guarantees-broker.md, "G7, G13, G21 and the fence under time
// faults (issue 42)", the fence at publish; the partitions of takeover-partition close their
// connections at the heal and never reach this). It bites when the standby
// took over while the relay was stopped and the relay was continued after
// more than wal_sender_timeout; the checker counts what was stored twice,
// and the log says how the continued session ended (fenced off, an ack
// timeout, ...).
func (r *runner) relayPaused(ctx context.Context, kind, label string) error {
	act, pid, err := r.streamingRelay(ctx, 10*time.Second)
	if err != nil {
		return err
	}
	if pid == 0 || !act.running() {
		r.skip(kind, "no relay streams the slot")
		return nil
	}
	other, otherIdx := r.relays[0], 0
	if other == act {
		other, otherIdx = r.relays[1], 1
	}
	if err := other.start(); err != nil {
		return err
	}
	// Long enough for the standby to be past its start-up checks and
	// retrying START_REPLICATION.
	r.pause(ctx, r.between(2*time.Second, 3*time.Second))
	offset := logSize(act.logPath)
	// A quiet moment first, for the CDC path to have nothing in flight
	// at the stop: a publish in flight then outlives the --ack-timeout
	// (5 s) during the stop, and its timeout ends the session at once
	// when the relay continues, before it reads anything late, which
	// hides what this fault is after. The commits resume with the stop,
	// and the walsender sends them to the stopped relay until it gives up.
	resumeLoad := r.load.hush()
	r.pause(ctx, relayPausedQuiet)
	err = act.pause()
	resumeLoad()
	if err != nil {
		return err
	}
	// Its path to PostgreSQL keeps what the walsender sends from now on,
	// and the end of the connection when the walsender gives up, as a
	// suspended VM's peer retransmits until it runs again: the stopped
	// relay gets it only after it continues.
	act.pgProxy.Set(Hold, 0)
	r.count(kind)
	t0 := time.Now()
	r.logf("fault %s: SIGSTOP relay %s (walsender %d); relay %s waits to take over", label, act.name, pid, other.name)
	limit := time.Minute + r.cfg.WalSenderTimeout
	took := false
	for time.Since(t0) < limit && ctx.Err() == nil {
		s, err := r.readSlot(ctx)
		if err != nil {
			_ = act.resume()
			act.pgProxy.Set(Pass, 0)
			return err
		}
		if s.pid != 0 && s.app == other.appName {
			took = true
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	takeover := time.Since(t0)
	// The standby replays and publishes what the stopped relay had not
	// confirmed; past the duplicate window the broker no longer drops a
	// repeat of it.
	r.pause(ctx, r.cfg.DuplicateWindow+time.Second)
	stopped := time.Since(t0)
	// What the walsender sent reaches the relay now, before it runs again;
	// what the relay then writes waits a moment longer, so that a write
	// to the server that is gone does not end the connection before the
	// relay read what arrived on it.
	act.pgProxy.Set(HoldRequests, 0)
	if err := act.resume(); err != nil {
		act.pgProxy.Set(Pass, 0)
		return err
	}
	r.pause(ctx, relayPausedRead)
	act.pgProxy.Set(Pass, 0)
	r.mu.Lock()
	r.takeover = append(r.takeover, Takeover{Cause: "pause", Seconds: takeover.Seconds(), OK: took})
	r.mu.Unlock()
	bit := took && stopped > r.cfg.WalSenderTimeout
	if bit {
		r.bit(kind)
	}
	// Let the continued relay do whatever it does with what it read late
	// and what it held.
	r.pause(ctx, 1500*time.Millisecond)
	r.logf("fault %s: relay %s -> %s took over after %.2fs (ok %v); relay %s continued after %.2fs stopped: its log since says fenced off %d, no ack in time %d, session ended %d (bit: %v)",
		label, act.name, other.name, takeover.Seconds(), took, act.name, stopped.Seconds(),
		countLogLines(act.logPath, offset, "fenced off"), countLogLines(act.logPath, offset, "no ack in time"),
		countLogLines(act.logPath, offset, "replication session ended"), bit)
	if err := act.stop(15 * time.Second); err != nil {
		r.logf("%v", err)
	}
	if took {
		r.primary = otherIdx
	} else if err := act.start(); err != nil {
		return err
	}
	return nil
}
