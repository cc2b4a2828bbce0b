package chaos

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

func (c Clocks) String() string {
	return fmt.Sprintf("PostgreSQL %+v, broker %+v from this host (database - broker %+v, within %v)",
		c.DBMinusHost.Round(time.Millisecond), c.BrokerMinusHost.Round(time.Millisecond),
		c.DBMinusBroker().Round(time.Millisecond), c.Uncertainty.Round(100*time.Microsecond))
}

// measureClocks reads the database's clock (clock_timestamp()) and the
// broker's (the time stamp of a stream info answer) against this
// process's, a few times each, and keeps the reading with the shortest
// round trip: the clock read lies within half of it from its midpoint.
// Deadlines are database-clock times and stored messages are dated by the
// broker, so a deadline check needs the difference between the two,
// whatever -pg-clock-offset set it to.
func (r *runner) measureClocks(ctx context.Context) (Clocks, error) {
	const samples = 5
	var c Clocks
	var dbUnc, brokerUnc time.Duration = -1, -1
	err := r.withDB(ctx, func(conn *pgx.Conn) error {
		for range samples {
			var db time.Time
			t0 := time.Now()
			if err := conn.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&db); err != nil {
				return err
			}
			rtt := time.Since(t0)
			if dbUnc < 0 || rtt/2 < dbUnc {
				dbUnc = rtt / 2
				c.DBMinusHost = db.Sub(t0.Add(rtt / 2))
			}
		}
		return nil
	})
	if err != nil {
		return c, fmt.Errorf("read PostgreSQL's clock: %w", err)
	}
	for range samples {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		t0 := time.Now()
		s, err := r.js.Stream(cctx, streamName)
		if err != nil {
			cancel()
			return c, fmt.Errorf("read the broker's clock: %w", err)
		}
		// The handle's lookup above was a round trip of its own; time the
		// info alone.
		t0 = time.Now()
		info, err := s.Info(cctx)
		rtt := time.Since(t0)
		cancel()
		if err != nil {
			return c, fmt.Errorf("read the broker's clock: %w", err)
		}
		if info.TimeStamp.IsZero() {
			return c, fmt.Errorf("read the broker's clock: stream info has no time stamp (nats-server before 2.10?)")
		}
		if brokerUnc < 0 || rtt/2 < brokerUnc {
			brokerUnc = rtt / 2
			c.BrokerMinusHost = info.TimeStamp.Sub(t0.Add(rtt / 2))
		}
	}
	// Both clocks are read to the microsecond at best.
	c.Uncertainty = dbUnc + brokerUnc + 2*time.Microsecond
	return c, nil
}

// clockShifted is pg-clock-shifted: with PostgreSQL's wall clock shifted for
// the whole run (-pg-clock-offset, libfaketime), the streaming relay is
// SIGKILLed, rows with deadlines 2 s and 8 s ahead (on the database's clock)
// are committed while it is down, and it starts again once the 2 s ones are
// past their deadline on the database's clock and not on this host's (the
// relay's and the broker's). Its replay must leave the 2 s rows to the
// poller, which expires them (G13: the database's clock decides), publish
// the 8 s ones before their deadline, and its read-back must find what the
// killed session stored by position, not by time (G18). The checker's
// figures judge that (published past the deadline, stored twice); the kind
// bites when the database's clock was measured off by the offset asked for
// (within a second), rows of the burst reached their deadline on that clock
// while the relay was down, and the restarted relay's read-back ran.
func (r *runner) clockShifted(ctx context.Context, kind, label string) error {
	ri, pid, err := r.activeRelay(ctx)
	if err != nil {
		return err
	}
	if !ri.running() {
		r.skip(kind, "relay not running")
		return nil
	}
	c, err := r.measureClocks(ctx)
	if err != nil {
		return err
	}
	if err := ri.kill(); err != nil {
		return err
	}
	r.count(kind)
	t0 := time.Now()
	r.logf("fault %s: SIGKILL relay %s (walsender %d); %s", label, ri.name, pid, c)
	if err := r.g3Check(ctx, label, pid); err != nil {
		return err
	}
	const short, long = 2 * time.Second, 8 * time.Second
	r.mu.Lock()
	r.faultRows++
	batch := r.faultRows
	r.mu.Unlock()
	var ids []string
	for i := range 100 {
		ids = append(ids, fmt.Sprintf("%sclock%d-%d", CommitPrefix, batch, i))
	}
	var expiredByDB int
	err = r.withDB(ctx, func(conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, expires_at)
			SELECT w, 'order', jsonb_build_object('id', w),
				clock_timestamp() + CASE WHEN i % 2 = 0 THEN $2::bigint ELSE $3::bigint END * interval '1 millisecond'
			FROM unnest($1::text[]) WITH ORDINALITY AS u(w, i)`, ids, short.Milliseconds(), long.Milliseconds())
		return err
	})
	if err != nil {
		return fmt.Errorf("%s: insert the burst: %w", label, err)
	}
	// Past the short deadline on the database's clock, well before the
	// long one.
	r.pause(ctx, short+500*time.Millisecond)
	if err := r.withDB(ctx, func(conn *pgx.Conn) error {
		return conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id = ANY($1) AND expires_at <= clock_timestamp()`, ids).Scan(&expiredByDB)
	}); err != nil {
		return fmt.Errorf("%s: %w", label, err)
	}
	offset := logSize(ri.logPath)
	if err := ri.start(); err != nil {
		return err
	}
	rb, ok := waitReadBack(ctx, ri.logPath, offset, 30*time.Second)
	off := c.DBMinusHost - r.cfg.PGClockOffset
	bit := r.cfg.PGClockOffset != 0 && off < time.Second && off > -time.Second && expiredByDB > 0 && ok
	if bit {
		r.bit(kind)
	}
	r.logf("fault %s: relay %s down %.2fs; %d of the %d burst rows past their deadline on the database's clock at the restart; its read-back (seen: %v, %s) read %d messages, found %d replayed rows stored (bit: %v)",
		label, ri.name, time.Since(t0).Seconds(), expiredByDB, len(ids), ok, rb.from(), rb.Read, rb.Stored, bit)
	return nil
}
