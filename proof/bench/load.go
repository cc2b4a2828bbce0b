package bench

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sync/errgroup"
)

// makePayload returns a JSON object whose text (as jsonb prints it) is size
// bytes, padded with random base64 so that PostgreSQL cannot compress it
// more than real payloads.
func makePayload(size int) string {
	const overhead = len(`{"pad": ""}`)
	n := max(size-overhead, 0)
	raw := make([]byte, n)
	_, _ = rand.Read(raw)
	pad := base64.RawStdEncoding.EncodeToString(raw)[:n]
	return `{"pad": "` + pad + `"}`
}

// workID names row i; the consumer parses it back from Nats-Msg-Id.
func workID(i int) string { return "m" + strconv.Itoa(i) }

func parseWorkID(s string) (int, bool) {
	n, err := strconv.Atoi(strings.TrimPrefix(s, "m"))
	return n, err == nil && strings.HasPrefix(s, "m")
}

// load inserts rows like an application: producers connections, each
// transaction one INSERT of rowsPerTx rows. With rate > 0 the transactions
// follow a fixed schedule (open loop): a late producer does not push the
// next ones back.
type load struct {
	url       string
	table     string // quoted
	state     string // "" for the column default ('ready')
	rows      int
	rowsPerTx int
	producers int
	rate      float64 // rows/s, 0 = as fast as possible
	payload   string
	// payloadSQL turns the text parameter p into the column ("": p::jsonb).
	payloadSQL string
	idBase     int // row i is workID(idBase+i): rounds on one table (-same-table) do not collide

	base     time.Time
	commitNs []int64 // per row: when its COMMIT returned, ns since base
}

func (l *load) sql() string {
	p := l.payloadSQL
	if p == "" {
		p = "p::jsonb"
	}
	if l.state == "" {
		return `INSERT INTO ` + l.table + ` (work_id, kind, payload)
			SELECT w, 'bench', ` + p + ` FROM unnest($1::text[], $2::text[]) AS u(w, p)`
	}
	return `INSERT INTO ` + l.table + ` (work_id, kind, payload, state)
		SELECT w, 'bench', ` + p + `, '` + l.state + `' FROM unnest($1::text[], $2::text[]) AS u(w, p)`
}

// run inserts all rows and returns the time from the first to the last
// commit.
func (l *load) run(ctx context.Context) (time.Duration, error) {
	if l.commitNs == nil {
		l.commitNs = make([]int64, l.rows)
	}
	ntx := (l.rows + l.rowsPerTx - 1) / l.rowsPerTx
	conns := make([]*pgx.Conn, l.producers)
	for i := range conns {
		c, err := pgx.Connect(ctx, l.url)
		if err != nil {
			return 0, fmt.Errorf("producer %d: connect: %w", i, err)
		}
		defer c.Close(context.Background())
		conns[i] = c
	}
	var txInterval time.Duration
	if l.rate > 0 {
		txInterval = time.Duration(float64(time.Second) * float64(l.rowsPerTx) / l.rate)
	}
	sql := l.sql()
	start := time.Now()
	var next atomic.Int64
	g, gctx := errgroup.WithContext(ctx)
	for p := range l.producers {
		conn := conns[p]
		g.Go(func() error {
			ids := make([]string, 0, l.rowsPerTx)
			payloads := make([]string, 0, l.rowsPerTx)
			for {
				k := int(next.Add(1) - 1)
				if k >= ntx {
					return nil
				}
				if txInterval > 0 {
					if d := time.Until(start.Add(time.Duration(k) * txInterval)); d > 0 {
						select {
						case <-gctx.Done():
							return gctx.Err()
						case <-time.After(d):
						}
					}
				}
				ids, payloads = ids[:0], payloads[:0]
				first := k * l.rowsPerTx
				last := min(first+l.rowsPerTx, l.rows)
				for i := first; i < last; i++ {
					ids = append(ids, workID(l.idBase+i))
					payloads = append(payloads, l.payload)
				}
				if _, err := conn.Exec(gctx, sql, ids, payloads); err != nil {
					return fmt.Errorf("insert rows %d-%d: %w", first, last-1, err)
				}
				now := int64(time.Since(l.base))
				for i := first; i < last; i++ {
					l.commitNs[i] = now
				}
			}
		})
	}
	err := g.Wait()
	return time.Since(start), err
}

// collector receives the stream through an ordered consumer and records
// when each row's message arrived: the message is delivered to a consumer
// only once the stream has stored it, which is when the publisher gets its
// ack.
type collector struct {
	base   time.Time
	recvNs []int64
	n      int
	count  atomic.Int64
	done   chan struct{}
	cc     jetstream.ConsumeContext
	once   sync.Once
}

func collect(ctx context.Context, js jetstream.JetStream, stream string, base time.Time, n, idBase int) (*collector, error) {
	c := &collector{base: base, recvNs: make([]int64, n), n: n, done: make(chan struct{})}
	cfg := jetstream.OrderedConsumerConfig{}
	if idBase > 0 {
		// The stream holds earlier rounds' messages (-same-table).
		cfg.DeliverPolicy = jetstream.DeliverNewPolicy
	}
	cons, err := js.OrderedConsumer(ctx, stream, cfg)
	if err != nil {
		return nil, fmt.Errorf("consumer on %s: %w", stream, err)
	}
	c.cc, err = cons.Consume(func(m jetstream.Msg) {
		now := int64(time.Since(base))
		i, ok := parseWorkID(m.Headers().Get("Nats-Msg-Id"))
		i -= idBase
		if !ok || i < 0 || i >= n || c.recvNs[i] != 0 {
			return
		}
		c.recvNs[i] = now
		if c.count.Add(1) == int64(n) {
			c.once.Do(func() { close(c.done) })
		}
	})
	if err != nil {
		return nil, fmt.Errorf("consume %s: %w", stream, err)
	}
	return c, nil
}

func (c *collector) wait(ctx context.Context, timeout time.Duration) error {
	defer c.cc.Stop()
	select {
	case <-c.done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(timeout):
		return fmt.Errorf("received %d of %d messages within %v", c.count.Load(), c.n, timeout)
	}
}

// latencies pairs each row's commit with its arrival.
func latencies(commitNs, recvNs []int64) []time.Duration {
	out := make([]time.Duration, 0, len(recvNs))
	for i, r := range recvNs {
		if r != 0 && commitNs[i] != 0 {
			out = append(out, time.Duration(r-commitNs[i]))
		}
	}
	return out
}

// throughput counts arrivals per 100 ms from the earliest one.
func throughput(recvNs []int64) []int {
	var lo, hi int64 = -1, 0
	for _, r := range recvNs {
		if r == 0 {
			continue
		}
		if lo < 0 || r < lo {
			lo = r
		}
		hi = max(hi, r)
	}
	if lo < 0 {
		return nil
	}
	const bucket = int64(100 * time.Millisecond)
	out := make([]int, (hi-lo)/bucket+1)
	for _, r := range recvNs {
		if r != 0 {
			out[(r-lo)/bucket]++
		}
	}
	return out
}

func firstLast(xs []int64) (lo, hi int64) {
	lo = -1
	for _, x := range xs {
		if x == 0 {
			continue
		}
		if lo < 0 || x < lo {
			lo = x
		}
		hi = max(hi, x)
	}
	return lo, hi
}
