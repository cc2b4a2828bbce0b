package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
)

// load is the producers' side: several connections committing transactions
// of 1 to 50 outbox rows at a paced rate, with rolled-back transactions
// mixed in. Some transactions carry a business deadline a few seconds
// ahead (expires_at, G13), so that a publish past it is measurable under
// every fault, and some are delayed (available_at a moment ahead), so that
// the poller's claims carry traffic all along and not only after a broker
// refusal. Connections go straight to PostgreSQL, so the relay's faults
// do not slow the load; PostgreSQL restarts do, and a commit whose outcome
// is unknown is left to the witness to resolve. With pg-failover dbURL names
// both servers (target_session_attrs=read-write), so the load follows the
// promotion as an application would.
type load struct {
	cfg   Config
	dbURL string

	budget        atomic.Int64 // rows left when cfg.Rows > 0
	committedRows atomic.Int64
	committedTxns atomic.Int64
	rolledRows    atomic.Int64
	rolledTxns    atomic.Int64
	unknown       atomic.Int64

	mu    sync.Mutex
	acked [][]string

	// quiet is held (Lock) by a fault that needs a moment without new
	// commits; every producer's commit holds it for reading.
	quiet sync.RWMutex
}

// hush stops new commits until the returned func is called; a commit under
// way finishes first.
func (l *load) hush() (resume func()) {
	l.quiet.Lock()
	return l.quiet.Unlock
}

func newLoad(cfg Config, dbURL string) *load {
	l := &load{cfg: cfg, dbURL: dbURL, acked: make([][]string, cfg.Producers)}
	l.budget.Store(int64(cfg.Rows))
	return l
}

func (l *load) exhausted() bool { return l.cfg.Rows > 0 && l.budget.Load() <= 0 }

func (l *load) take(n int64) int64 {
	if l.cfg.Rows <= 0 {
		return n
	}
	for {
		left := l.budget.Load()
		if left <= 0 {
			return 0
		}
		k := min(n, left)
		if l.budget.CompareAndSwap(left, left-k) {
			return k
		}
	}
}

// ackedIDs are the rows whose commit a producer saw succeed.
func (l *load) ackedIDs() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, ids := range l.acked {
		out = append(out, ids...)
	}
	return out
}

func (l *load) produce(ctx context.Context, p int) {
	rng := rand.New(rand.NewPCG(l.cfg.Seed, uint64(p)+100))
	perSec := float64(l.cfg.Rate) / float64(l.cfg.Producers)
	seq := 0
	next := time.Now()
	var conn *pgx.Conn
	defer func() {
		if conn != nil {
			conn.Close(context.Background())
		}
	}()
	ids := func(prefix string, n int) []string {
		out := make([]string, n)
		for i := range out {
			seq++
			out[i] = fmt.Sprintf("%s%d-%d", prefix, p, seq)
		}
		return out
	}
	for ctx.Err() == nil {
		if conn == nil {
			c, err := pgx.Connect(ctx, l.dbURL)
			if err != nil {
				time.Sleep(200 * time.Millisecond)
				continue
			}
			conn = c
		}
		if rng.IntN(8) == 0 {
			rb := ids(RollbackPrefix, 1+rng.IntN(5))
			if err := insertTx(ctx, conn, rb, rng, false, timing{}); err != nil {
				conn.Close(context.Background())
				conn = nil
				continue
			}
			l.rolledRows.Add(int64(len(rb)))
			l.rolledTxns.Add(1)
		}
		n := l.take(1 + rng.Int64N(50))
		if n == 0 {
			return
		}
		w := ids(CommitPrefix, int(n))
		l.quiet.RLock()
		err := insertTx(ctx, conn, w, rng, true, rowTiming(rng))
		l.quiet.RUnlock()
		switch {
		case err == nil:
			l.committedRows.Add(n)
			l.committedTxns.Add(1)
			l.mu.Lock()
			l.acked[p] = append(l.acked[p], w...)
			l.mu.Unlock()
		case isCommitErr(err):
			// The commit may or may not have happened: the witness knows.
			l.unknown.Add(1)
			conn.Close(context.Background())
			conn = nil
		default:
			conn.Close(context.Background())
			conn = nil
			continue
		}
		// Paced, not bursty: after an outage the load does not catch up,
		// so the rate stays what was asked for.
		next = next.Add(time.Duration(float64(n) / perSec * float64(time.Second)))
		if d := time.Until(next); d > 0 {
			select {
			case <-ctx.Done():
			case <-time.After(d):
			}
		} else if d < -time.Second {
			next = time.Now()
		}
	}
}

type commitErr struct{ error }

func (e commitErr) Unwrap() error { return e.error }

func isCommitErr(err error) bool {
	_, ok := err.(commitErr)
	return ok
}

var kinds = []string{"order", "invoice", "mail"}

// timing is when a transaction's rows fall due and expire, as offsets from
// the database's clock at the insert (zero: now, and no deadline). Both are
// taken on the database's clock, which decides them (G6, G13), whatever
// the clocks of the relay and the broker say.
type timing struct {
	delay    time.Duration // available_at ahead: the CDC path hands the rows to the poller
	deadline time.Duration // expires_at ahead
}

// Shares of the committed transactions with a deadline and delayed. A
// deadline of 2 to 6 s outlasts normal delivery by far (milliseconds) but
// not most faults' holds, so some rows meet their deadline while a fault
// holds them back; a delay of 0.5 to 2 s gives the poller a steady share
// of the load.
const (
	deadlineOneIn = 6
	delayedOneIn  = 8
)

// rowTiming draws a transaction's timing: a deadline or a delay, never
// both (a delayed row that expires while it waits tells nothing).
func rowTiming(rng *rand.Rand) timing {
	n := rng.IntN(deadlineOneIn * delayedOneIn)
	switch {
	case n < delayedOneIn:
		return timing{deadline: 2*time.Second + time.Duration(rng.Int64N(int64(4*time.Second)))}
	case n < delayedOneIn+deadlineOneIn:
		return timing{delay: 500*time.Millisecond + time.Duration(rng.Int64N(int64(1500*time.Millisecond)))}
	}
	return timing{}
}

func insertTx(ctx context.Context, conn *pgx.Conn, ids []string, rng *rand.Rand, commit bool, tm timing) error {
	kk := make([]string, len(ids))
	payloads := make([]string, len(ids))
	for i, id := range ids {
		kk[i] = kinds[rng.IntN(len(kinds))]
		payloads[i] = fmt.Sprintf(`{"id":%q,"pad":%q}`, id, strings.Repeat("x", rng.IntN(200)))
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	// A NULL offset leaves the column's default (available_at) or no
	// deadline (expires_at).
	var delay, deadline *int64
	if tm.delay > 0 {
		ms := tm.delay.Milliseconds()
		delay = &ms
	}
	if tm.deadline > 0 {
		ms := tm.deadline.Milliseconds()
		deadline = &ms
	}
	if _, err := tx.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, available_at, expires_at)
		SELECT w, k, p::jsonb, coalesce(clock_timestamp() + $4::bigint * interval '1 millisecond', clock_timestamp()),
			clock_timestamp() + $5::bigint * interval '1 millisecond'
		FROM unnest($1::text[], $2::text[], $3::text[]) AS u(w, k, p)`, ids, kk, payloads, delay, deadline); err != nil {
		_ = tx.Rollback(context.Background())
		return err
	}
	if !commit {
		return tx.Rollback(ctx)
	}
	if err := tx.Commit(ctx); err != nil {
		return commitErr{err}
	}
	return nil
}
