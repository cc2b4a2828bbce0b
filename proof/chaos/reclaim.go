package chaos

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// pollerSlowDB is how late poller-killed-after-acks delivers the relay's
// statements to PostgreSQL: a claimed batch's completion reaches the
// database that long after the broker acked its publishes, a window wide
// enough to see from outside and kill the relay in.
const pollerSlowDB = time.Second

// claimedRow is a row a poller held, as the table says.
type claimedRow struct {
	id         string
	generation int64
	leaseUntil time.Time // the database's clock
}

// pollerKilled is poller-killed-after-acks: SIGKILL of a relay while its
// poller holds a claimed batch that the broker already stored, before the
// completion reached the database. The rows stay 'running' until their
// lease (--lease, 6 s) runs out, and a new claim after that, past the
// duplicate window, must look them up in the stream from the position the
// first claim recorded (lookup_seq) and settle them without sending them
// again (G18). The relay's statements to PostgreSQL are delayed
// (SlowRequests) so that completions lag the acks; the run watches the
// relay's 'running' rows (straight from the table) and the stream, and
// kills the relay as soon as a row of its claims is both. The kind bites
// when at least one such row, still 'running' after the kill, was claimed
// again (a higher claim generation) and settled 'published', with its lease
// ending more than the duplicate window after its first copy was stored:
// a republish then would have been stored twice, which the checker counts.
func (r *runner) pollerKilled(ctx context.Context, kind, label string) error {
	ri, pid, err := r.streamingRelay(ctx, 10*time.Second)
	if err != nil {
		return err
	}
	if !ri.running() {
		r.skip(kind, "relay not running")
		return nil
	}
	ri.pgProxy.Set(SlowRequests, pollerSlowDB)
	var caught []claimedRow
	watch := time.Now()
	for time.Since(watch) < 15*time.Second && ctx.Err() == nil {
		running, err := r.claimedBy(ctx, ri.appName, nil)
		if err != nil {
			ri.pgProxy.Set(Pass, 0)
			return err
		}
		if len(running) > 0 {
			last, err := r.streamLastSeq(ctx)
			if err != nil {
				ri.pgProxy.Set(Pass, 0)
				return err
			}
			if err := r.catchUpStream(ctx, last); err != nil {
				ri.pgProxy.Set(Pass, 0)
				return err
			}
			for _, c := range running {
				if r.ledger.Stored(c.id) {
					caught = append(caught, c)
				}
			}
			if len(caught) > 0 {
				break
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	if len(caught) == 0 {
		ri.pgProxy.Set(Pass, 0)
		r.skip(kind, "no claimed batch of the relay's poller was seen stored before its completion")
		return nil
	}
	if err := ri.kill(); err != nil {
		ri.pgProxy.Set(Pass, 0)
		return err
	}
	// The statements the relay sent before it died are still on their way
	// in the proxy, its completions among them: a process killed with its
	// packets in flight loses nothing that left it, but this fault is about
	// the completion that never arrived, so the proxy drops them.
	ri.pgProxy.Set(Cut, 0)
	r.count(kind)
	ri.pgProxy.Set(Pass, 0)
	ids := make([]string, len(caught))
	for i, c := range caught {
		ids[i] = c.id
	}
	// The completion may have reached the database between the look and
	// the kill: only the rows still running are the kill's.
	still, err := r.claimedBy(ctx, ri.appName, ids)
	if err != nil {
		return err
	}
	r.logf("fault %s: SIGKILL relay %s (walsender %d) with %d rows of its poller's claims stored and not completed (%d seen after %.2fs of its statements to PostgreSQL %v late)",
		label, ri.name, pid, len(still), len(caught), time.Since(watch).Seconds(), pollerSlowDB)
	if err := r.g3Check(ctx, label, pid); err != nil {
		return err
	}
	if err := ri.start(); err != nil {
		return err
	}
	if len(still) == 0 {
		r.logf("fault %s: the completions won the race with the kill; nothing to reclaim (not bitten)", label)
		return nil
	}
	// The new process's poller reclaims them once their leases ran out.
	stillIDs := make([]string, len(still))
	for i, c := range still {
		stillIDs[i] = c.id
	}
	var leaseEnd time.Time
	for _, c := range still {
		leaseEnd = maxTime(leaseEnd, c.leaseUntil)
	}
	wait := time.Until(leaseEnd.Add(-r.clocks.DBMinusHost)) + 20*time.Second
	t0 := time.Now()
	type outcome struct {
		state      string
		generation int64
	}
	out := map[string]outcome{}
	for time.Since(t0) < wait && ctx.Err() == nil {
		clear(out)
		running := 0
		err := r.withDB(ctx, func(c *pgx.Conn) error {
			rows, err := c.Query(ctx, `SELECT work_id, state, claim_generation FROM outbox WHERE work_id = ANY($1)`, stillIDs)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				var id, st string
				var g int64
				if err := rows.Scan(&id, &st, &g); err != nil {
					return err
				}
				out[id] = outcome{st, g}
				if st == "running" {
					running++
				}
			}
			return rows.Err()
		})
		if err != nil {
			return err
		}
		if running == 0 {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	reclaimed, states := 0, map[string]int{}
	minGap := time.Duration(-1)
	for _, c := range still {
		o := out[c.id]
		states[o.state]++
		if o.state != "published" || o.generation <= c.generation {
			continue
		}
		reclaimed++
		stored, ok := r.ledger.StoredAt(c.id)
		if !ok {
			continue
		}
		// The reclaim came after the lease ran out: that much at least
		// after the first copy was stored (both on the broker's clock).
		gap := c.leaseUntil.Add(-r.clocks.DBMinusBroker()).Sub(stored)
		if minGap < 0 || gap < minGap {
			minGap = gap
		}
	}
	bit := reclaimed > 0 && minGap > r.cfg.DuplicateWindow
	if bit {
		r.bit(kind)
	}
	gap := "-"
	if minGap >= 0 {
		gap = fmt.Sprintf("%.2fs", minGap.Seconds())
	}
	r.logf("fault %s: of the %d rows the kill caught, %d were claimed again and settled published (states now %v), their leases ending at least %s after their first copies were stored (duplicate window %v) (bit: %v)",
		label, len(still), reclaimed, states, gap, r.cfg.DuplicateWindow, bit)
	return nil
}

// claimedBy reads the rows in 'running' that worker holds (of ids only,
// when ids is not nil), straight from the table.
func (r *runner) claimedBy(ctx context.Context, worker string, ids []string) ([]claimedRow, error) {
	var out []claimedRow
	err := r.withDB(ctx, func(c *pgx.Conn) error {
		out = out[:0]
		q := `SELECT work_id, claim_generation, lease_until FROM outbox WHERE state = 'running' AND claimed_by = $1`
		args := []any{worker}
		if ids != nil {
			q += ` AND work_id = ANY($2)`
			args = append(args, ids)
		}
		rows, err := c.Query(ctx, q, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var cr claimedRow
			if err := rows.Scan(&cr.id, &cr.generation, &cr.leaseUntil); err != nil {
				return err
			}
			out = append(out, cr)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, fmt.Errorf("read the rows %s holds: %w", worker, err)
	}
	return out, nil
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
