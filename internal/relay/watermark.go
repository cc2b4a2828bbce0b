package relay

import (
	"context"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
)

// DefaultWatermarkEvery is how often a streaming relay with --on-publish
// none records its watermark (G17): one small UPDATE of <table>_slots,
// instead of one write per published row. A published row shows as
// published in status and the console, and is no longer handed over after
// a slot loss, once a watermark covers it: a second or two after its ack,
// plus the stream's status interval (the server learns the relay's
// confirmed position only from its status updates).
const DefaultWatermarkEvery = time.Second

// recordWatermarks keeps the table's watermark moving while this session
// streams. A candidate (snapshot, position) is kept until the slot has
// confirmed past its position, not replaced by a newer one: under steady
// load the confirmed position always trails the newest position, and a
// candidate replaced every tick would never be recorded.
//
// With no ack since the last two recorded candidates were taken, the
// recorder rests and runs no statement: an idle relay queries nothing
// (docs/benchmarks.md, idle). Two, because a row acked just before a
// candidate was taken may not be visible in its snapshot yet (a commit is
// streamed before it is visible, design.md): the next candidate, a tick
// later, sees it.
func (l *loop) recordWatermarks(ctx context.Context) {
	r := l.r
	t := time.NewTicker(r.cfg.WatermarkEvery)
	defer t.Stop()
	var cand store.WatermarkCandidate
	var lastWarn time.Time
	candAcks := int64(-1)        // acks when cand was taken
	recorded := [2]int64{-1, -2} // acks when the last two recorded candidates were taken
	for first := true; ; first = false {
		if !first {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
		}
		acks := l.acks.Load()
		if acks == recorded[0] && acks == recorded[1] {
			continue
		}
		taking := cand.Snapshot == ""
		rec, next, err := r.store.AdvanceWatermark(ctx, r.cfg.Slot, l.slotLSN, cand)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			if time.Since(lastWarn) > time.Minute {
				lastWarn = time.Now()
				r.log.Warn().Err(err).Msg("recording the watermark failed; published rows keep showing as in flight, and would be handed over again after a slot loss, until it succeeds")
			}
		case rec:
			r.metrics.WatermarkLSN.Set(float64(cand.LSN))
			recorded = [2]int64{candAcks, recorded[0]}
			cand, candAcks = next, acks
		case taking:
			cand, candAcks = next, acks
		}
	}
}
