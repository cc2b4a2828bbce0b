// Package dbclock measures PostgreSQL's clock against this process's, so
// that a business deadline is decided on the database's clock (G13) on the
// relay's own paths too: the CDC path's decision to publish a row or hand
// it to the poller, and the Nats-TTL a message carries (G21). The poller
// decides in SQL (clock_timestamp()) and needs none of this.
//
// A probe reads clock_timestamp() and this process's clock before and
// after; the database's time was read somewhere in between, so the offset
// is known to within half the round trip. The probe with the shortest round
// trip of a measurement is kept, and its half round trip is the
// uncertainty a decision allows for.
package dbclock

import (
	"context"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Clock is the database's clock as seen from this process. The zero value
// reads this process's clock (offset 0) until a measurement succeeds.
type Clock struct {
	offset      atomic.Int64 // database minus local, nanoseconds
	uncertainty atomic.Int64 // half the kept probe's round trip, nanoseconds
	measured    atomic.Bool
	warned      atomic.Int64 // the offset last warned about, nanoseconds
}

// Now is the database's time now, as measured.
func (c *Clock) Now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// Offset is the database's clock less this process's, and how far off the
// figure may be.
func (c *Clock) Offset() (offset, uncertainty time.Duration, measured bool) {
	return time.Duration(c.offset.Load()), time.Duration(c.uncertainty.Load()), c.measured.Load()
}

// Uncertainty is how far Now may be from the database's clock.
func (c *Clock) Uncertainty() time.Duration { return time.Duration(c.uncertainty.Load()) }

// probes is how many probes one measurement takes (the shortest round trip
// is kept).
const probes = 3

// Measure takes one measurement; q reads the database's clock
// (SELECT clock_timestamp()).
func (c *Clock) Measure(ctx context.Context, q func(ctx context.Context) (time.Time, error)) error {
	best := time.Duration(math.MaxInt64)
	var off time.Duration
	for range probes {
		t0 := time.Now()
		db, err := q(ctx)
		t1 := time.Now()
		if err != nil {
			return fmt.Errorf("measure the database's clock: %w", err)
		}
		if rtt := t1.Sub(t0); rtt < best {
			best = rtt
			off = db.Sub(t0.Add(rtt / 2))
		}
	}
	c.offset.Store(int64(off))
	c.uncertainty.Store(int64(best / 2))
	c.measured.Store(true)
	return nil
}

// WarnBeyond is how far the database's clock and the relay's may differ
// before the relay says so: deadlines follow the database's either way,
// but a skew this large is a misconfigured host (no NTP) that other
// systems reading these deadlines will trip over.
const WarnBeyond = 2 * time.Second

// Keep measures every interval until ctx ends, and warns (once per change
// of a second or more) when the clocks differ by more than WarnBeyond.
func (c *Clock) Keep(ctx context.Context, q func(ctx context.Context) (time.Time, error), interval time.Duration, log zerolog.Logger) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := c.Measure(mctx, q)
		cancel()
		if err != nil && ctx.Err() == nil {
			log.Debug().Err(err).Msg("could not measure the database's clock; deciding deadlines on the last measurement")
		} else if err == nil {
			c.report(log)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// report warns when the clocks disagree beyond WarnBeyond.
func (c *Clock) report(log zerolog.Logger) {
	off, unc, _ := c.Offset()
	if off.Abs() <= WarnBeyond {
		if c.warned.Load() != 0 {
			c.warned.Store(0)
			log.Info().Dur("offset", off).Msg("the database's clock and the relay's agree again")
		}
		return
	}
	if last := time.Duration(c.warned.Load()); last != 0 && (off-last).Abs() < time.Second {
		return
	}
	c.warned.Store(int64(off))
	log.Warn().Dur("offset", off).Dur("uncertainty", unc).
		Msg("PostgreSQL's clock and the relay host's differ by more than 2 s: business deadlines (expires_at) are decided on PostgreSQL's clock and Nats-TTL is counted from it, so delivery stays right, but run NTP on both hosts: receivers that enforce Outbox-Expires-At on their own clocks will disagree")
}
