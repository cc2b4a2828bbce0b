// Package demo is `outbox-relay demo`: a producer writes orders and their
// outbox rows with package outbox, the relay streams them to JetStream, and
// a consumer applies each message's effect once with package inbox, all in
// one process and against throwaway servers unless it is given some.
//
// It shows the product as a user would use it, so it uses only what the
// binary ships: servers come from devenv, never from the test apparatus.
package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/devenv"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/outbox"
)

// Options configures Run.
type Options struct {
	// Relay is the relay as `outbox-relay run` would configure it. An empty
	// DatabaseURL or NATSURL means: start a throwaway server and remove it
	// afterwards.
	Relay app.Options
	// NATSServer is the nats-server binary for a throwaway server; empty
	// means the version go.mod pins when run in a source checkout, else
	// nats-server on PATH (devenv.FindNATSServer).
	NATSServer string
	// Terminal says stdout is a terminal: only then does the story
	// overwrite its progress line (\r and an erase sequence), which in a
	// file or a pipe would be noise.
	Terminal bool
	// Console, when set, ends the demo by serving the operator console
	// on ConsoleAddr (with a random token printed for the session) until
	// ctx ends.
	Console     bool
	ConsoleAddr string
}

// NATSServerEnv is the environment variable that names the nats-server
// binary (the demo's --nats-server flag).
const NATSServerEnv = "OUTBOX_RELAY_NATS_SERVER"

const (
	startTimeout   = 30 * time.Second
	deliverTimeout = 30 * time.Second
	// settleTime is how long the demo keeps listening after the last
	// committed row arrived, so that a phantom would have time to show.
	settleTime = time.Second
	// traceparent shows a producer's header travelling with the message.
	traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
)

// Run tells the story on stdout: servers, producer, relay, stream, consumer,
// and a summary that would name a loss or a phantom. It returns an error
// when anything went wrong, including a loss or a phantom. log gets the
// relay's and the inbox's lines; the caller picks their level.
func Run(ctx context.Context, o Options, stdout io.Writer, log zerolog.Logger) error {
	d := &run{o: o.Relay, opts: o, stdout: stdout, log: log}
	// The relay runs as the later sections show it: ordered by aggregate,
	// allowed a second stream for the orders, and with a poller quick
	// enough that a refused row becomes a dead letter within a second. The
	// table records --ordering on first use, so every run of the demo on a
	// table uses the same.
	d.o.Ordering = app.OrderingAggregate
	d.ordersStream = d.o.Stream + ordersStreamSuffix
	d.o.AllowStreams = append(d.o.AllowStreams, d.ordersStream)
	d.o.MaxAttempts = demoMaxAttempts
	d.o.BackoffMin, d.o.BackoffMax = 100*time.Millisecond, 300*time.Millisecond
	d.o.PollInterval = 100 * time.Millisecond
	d.o.DeadlineMargin = 200 * time.Millisecond
	d.o.RejectRetry, d.o.SweepInterval = 200*time.Millisecond, 200*time.Millisecond
	userDB := d.o.DatabaseURL != ""
	stopServers, err := d.startServers(o.NATSServer)
	defer stopServers()
	if err != nil {
		return err
	}

	conn, err := d.o.DB().Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	if _, err := schema.Migrate(ctx, conn, d.o.Table); err != nil {
		return fmt.Errorf("migrate %s: %w", d.o.Table.Qualified(), err)
	}
	d.printf("migrated %s\n", d.o.Table.Qualified())
	// A table records --ordering on its first run, and refuses a relay
	// with another: on a table an earlier `run` recorded unordered, the
	// demo runs unordered too and leaves out the orders.
	rec, found, err := store.ReadSettings(ctx, conn, d.o.Table)
	if err != nil {
		return err
	}
	showOrders := !found || rec.Ordering == app.OrderingAggregate
	if !showOrders {
		d.o.Ordering = rec.Ordering
		d.printf("%s records --ordering %s (by %s): the demo runs so too and leaves out the orders section; give it another --table to see it\n",
			d.o.Table.Qualified(), rec.Ordering, rec.RecordedBy)
	}
	pool, err := d.o.DB().Pool(ctx, "outbox-relay demo")
	if err != nil {
		return err
	}
	defer pool.Close()

	rel, err := d.startRelay(ctx)
	defer rel.stop() //nolint:errcheck // the error that matters is returned already
	if err != nil {
		return err
	}
	d.printf("relay streaming slot %s into stream %s (--ordering %s)\n\n", d.o.Slot, d.o.Stream, d.o.Ordering)

	js, received, closeNATS, err := d.subscribe(ctx)
	defer closeNATS()
	if err != nil {
		return err
	}

	// On a database of the user's the work IDs get a suffix, so a second
	// run does not collide with an earlier run's rows.
	suffix := ""
	if userDB {
		suffix = fmt.Sprintf("-%d", time.Now().UnixMilli())
	}
	committed, err := d.produce(ctx, conn, suffix)
	if err != nil {
		return err
	}

	d.printf("\n")
	seen, firstSeq, err := d.receive(ctx, received, committed, rel)
	if err != nil || ctx.Err() != nil {
		// An interrupted demo is not a failed one.
		return err
	}
	d.printf("\n")
	phantoms := settle(received, committed, seen)

	if showOrders {
		if err := d.orders(ctx, pool, js, suffix, rel); err != nil || ctx.Err() != nil {
			return err
		}
	}

	// Stop first: a graceful stop confirms the slot past everything acked.
	if err := rel.stop(); err != nil {
		return fmt.Errorf("stop the relay: %w", err)
	}
	if err := d.summary(ctx, conn, committed, seen, phantoms); err != nil {
		return err
	}
	if err := d.consume(ctx, pool, js, firstSeq, len(seen)); err != nil {
		return err
	}
	if o.Console {
		return d.serveConsole(ctx, pool)
	}
	return nil
}

// run is one demo's state.
type run struct {
	o            app.Options
	opts         Options
	ordersStream string
	stdout       io.Writer
	log          zerolog.Logger
}

// printf writes the story; a reader who closed stdout loses nothing the
// summary and the exit status do not also say.
func (d *run) printf(format string, args ...any) {
	_, _ = fmt.Fprintf(d.stdout, format, args...)
}

// startServers starts a throwaway PostgreSQL and nats-server for the URLs
// that were not given. The returned func removes them; it is never nil.
func (d *run) startServers(natsServer string) (stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	if d.o.DatabaseURL == "" {
		d.printf("starting a throwaway PostgreSQL (wal_level=logical)...\n")
		pg, err := devenv.StartPostgres(devenv.PostgresOptions{Fsync: true})
		if err != nil {
			return stop, fmt.Errorf("start a throwaway PostgreSQL (or pass --database-url to use yours): %w", err)
		}
		stops = append(stops, pg.Close)
		d.o.DatabaseURL = pg.URL("postgres")
	}
	if d.o.NATSURL == "" {
		bin, err := devenv.FindNATSServer(natsServer)
		if err != nil {
			return stop, fmt.Errorf("%w: pass --nats-url to use a running server, or install nats-server on PATH, or set %s to its path", err, NATSServerEnv)
		}
		d.printf("starting a throwaway nats-server with JetStream...\n")
		n, err := devenv.StartNATS(devenv.NATSOptions{Bin: bin})
		if err != nil {
			return stop, fmt.Errorf("start a throwaway nats-server (or pass --nats-url to use yours): %w", err)
		}
		stops = append(stops, n.Close)
		d.o.NATSURL = n.URL()
	}
	return stop, nil
}

// relayRun is the relay running in this process, exactly as `outbox-relay
// run` runs it.
type relayRun struct {
	cancel context.CancelFunc
	done   chan struct{} // closed when app.Run returned
	err    error         // app.Run's result, valid once done is closed
}

// stop stops the relay and waits for it; it is safe to call more than once.
func (r *relayRun) stop() error {
	r.cancel()
	<-r.done
	return r.err
}

// startRelay starts the relay and waits until it streams from the slot, so
// the rows that follow take the CDC path. The returned relayRun is never
// nil.
func (d *run) startRelay(ctx context.Context) (*relayRun, error) {
	relayCtx, cancel := context.WithCancel(ctx)
	r := &relayRun{cancel: cancel, done: make(chan struct{})}
	var (
		mu      sync.Mutex
		started *relay.Relay
	)
	o := d.o
	o.Started = func(x *relay.Relay) { mu.Lock(); started = x; mu.Unlock() }
	go func() {
		defer close(r.done)
		r.err = app.Run(relayCtx, o, d.log)
	}()
	deadline := time.Now().Add(startTimeout)
	for {
		mu.Lock()
		streaming := started != nil && started.Role() == relay.RoleActive
		mu.Unlock()
		if streaming {
			return r, nil
		}
		if time.Now().After(deadline) {
			return r, fmt.Errorf("relay did not start streaming within %v", startTimeout)
		}
		select {
		case <-r.done:
			return r, fmt.Errorf("relay stopped before it streamed: %w", relayErr(r.err))
		case <-ctx.Done():
			return r, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// relayErr is the relay's result as an error: app.Run returns nil only
// when it was asked to stop.
func relayErr(err error) error {
	if err == nil {
		return errors.New("it returned without an error")
	}
	return err
}

// subscribe follows the stream from now on, as any subscriber would. The
// returned func closes the connection; it is never nil.
func (d *run) subscribe(ctx context.Context) (jetstream.JetStream, <-chan jetstream.Msg, func(), error) {
	noop := func() {}
	scrub := app.NewNATSScrubber(d.o.NATSURL, d.o.NATS)
	// nats.go reports asynchronous errors from its own goroutines; the
	// logger is the one writer here that is safe to share with them.
	auth, err := d.o.NATS.Options()
	if err != nil {
		return nil, nil, noop, err
	}
	nc, err := nats.Connect(d.o.NATSURL, append(auth, nats.Name("outbox-relay demo"), nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		d.log.Warn().Err(scrub.Err(err)).Msg("demo subscriber: NATS error")
	}))...)
	if err != nil {
		return nil, nil, noop, fmt.Errorf("connect to NATS at %s: %w", app.RedactNATSURLs(d.o.NATSURL), scrub.Err(err))
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, noop, fmt.Errorf("open JetStream at %s: %w", app.RedactNATSURLs(d.o.NATSURL), scrub.Err(err))
	}
	cons, err := js.OrderedConsumer(ctx, d.o.Stream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		nc.Close()
		return nil, nil, noop, fmt.Errorf("consume stream %s: %w", d.o.Stream, err)
	}
	received := make(chan jetstream.Msg, 64)
	cc, err := cons.Consume(func(m jetstream.Msg) { received <- m })
	if err != nil {
		nc.Close()
		return nil, nil, noop, fmt.Errorf("consume stream %s: %w", d.o.Stream, err)
	}
	return js, received, func() { cc.Stop(); nc.Close() }, nil
}

// produce is the application: Mina's order 103 and its acknowledgement in
// one transaction, a few more orders, and one transaction that rolls back.
// It returns the work IDs that committed.
func (d *run) produce(ctx context.Context, conn *pgx.Conn, suffix string) (map[string]bool, error) {
	for _, s := range []string{
		`CREATE TABLE IF NOT EXISTS demo_orders (id int PRIMARY KEY, customer_id int NOT NULL, total numeric(10,2) NOT NULL, status text NOT NULL)`,
		`TRUNCATE demo_orders`,
	} {
		if _, err := conn.Exec(ctx, s); err != nil {
			return nil, fmt.Errorf("prepare demo_orders: %w", err)
		}
	}
	producer, err := outbox.New(outbox.WithTable(d.o.Table.Qualified()))
	if err != nil {
		return nil, fmt.Errorf("outbox producer: %w", err)
	}
	committed := map[string]bool{}
	order := func(id int, total string, commit bool) error {
		workID := fmt.Sprintf("order-%d-ack%s", id, suffix)
		payload, err := json.Marshal(map[string]any{
			"order_id": id, "customer_id": 1, "total": total, "message": "Order received; payment still pending",
		})
		if err != nil {
			return fmt.Errorf("order %d: encode payload: %w", id, err)
		}
		tx, err := conn.Begin(ctx)
		if err != nil {
			return fmt.Errorf("order %d: begin: %w", id, err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
		if _, err := tx.Exec(ctx, `INSERT INTO demo_orders VALUES ($1, 1, $2, 'pending')`, id, total); err != nil {
			return fmt.Errorf("insert order %d: %w", id, err)
		}
		// The business row and its message commit together or not at all.
		if err := producer.Enqueue(ctx, tx, outbox.Message{
			WorkID:  workID,
			Kind:    "order_received",
			Payload: payload,
			Headers: map[string]string{"traceparent": traceparent},
		}); err != nil {
			return fmt.Errorf("enqueue %s: %w", workID, err)
		}
		if !commit {
			d.printf("  -> order %d and %s inserted, then ROLLBACK (must never be published)\n", id, workID)
			if err := tx.Rollback(ctx); err != nil {
				return fmt.Errorf("order %d: rollback: %w", id, err)
			}
			return nil
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("order %d: commit: %w", id, err)
		}
		committed[workID] = true
		d.printf("  -> order %d and %s committed in one transaction\n", id, workID)
		return nil
	}
	if err := order(103, "29.00", true); err != nil {
		return nil, err
	}
	if err := order(999, "1.00", false); err != nil {
		return nil, err
	}
	for id := 104; id <= 107; id++ {
		if err := order(id, fmt.Sprintf("%d.50", id-90), true); err != nil {
			return nil, err
		}
	}
	return committed, nil
}

// receive shows messages as they arrive until every committed row did. It
// returns how often each work ID arrived and the lowest stream sequence,
// where the consumer starts. When ctx ends it returns without an error.
func (d *run) receive(ctx context.Context, received <-chan jetstream.Msg, committed map[string]bool, rel *relayRun) (map[string]int, uint64, error) {
	seen := map[string]int{}
	var firstSeq uint64
	deadline := time.After(deliverTimeout)
	for len(seen) < len(committed) {
		select {
		case m := <-received:
			id := m.Headers().Get(jetstream.MsgIDHeader)
			seen[id]++
			if md, err := m.Metadata(); err == nil && (firstSeq == 0 || md.Sequence.Stream < firstSeq) {
				firstSeq = md.Sequence.Stream
			}
			line := fmt.Sprintf("  <- %-16s subject=%s lsn=%s  %s\n", id, m.Subject(), m.Headers().Get(wire.HeaderCommitLSN), m.Data())
			if !d.opts.Terminal {
				d.printf("%s", line)
				continue
			}
			// On a terminal one progress line stays under the messages.
			d.printf("\r\033[K%s  received %d/%d", line, len(seen), len(committed))
		case <-deadline:
			return nil, 0, fmt.Errorf("only %d of %d committed rows reached the stream within %v", len(seen), len(committed), deliverTimeout)
		case <-rel.done:
			return nil, 0, fmt.Errorf("relay stopped: %w", relayErr(rel.err))
		case <-ctx.Done():
			return seen, firstSeq, nil
		}
	}
	return seen, firstSeq, nil
}

// settle gives a phantom a moment to appear if the relay were wrong, and
// counts it; repeats of committed rows add to seen.
func settle(received <-chan jetstream.Msg, committed map[string]bool, seen map[string]int) (phantoms int) {
	timeout := time.After(settleTime)
	for {
		select {
		case m := <-received:
			if id := m.Headers().Get(jetstream.MsgIDHeader); committed[id] {
				seen[id]++
			} else {
				phantoms++
			}
		case <-timeout:
			return phantoms
		}
	}
}

// summary prints what the database and the slot say after the relay
// stopped, and fails on a loss or a phantom.
func (d *run) summary(ctx context.Context, conn *pgx.Conn, committed map[string]bool, seen map[string]int, phantoms int) error {
	ids := make([]string, 0, len(committed))
	for id := range committed {
		ids = append(ids, id)
	}
	var published int
	err := conn.QueryRow(ctx, `SELECT count(*) FROM `+d.o.Table.String()+` WHERE state = 'published' AND work_id = ANY($1)`, ids).Scan(&published)
	if err != nil {
		return fmt.Errorf("count published rows: %w", err)
	}
	var confirmed string
	var lag int64
	err = conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, d.o.Slot).Scan(&confirmed, &lag)
	if err != nil {
		return fmt.Errorf("read slot %s: %w", d.o.Slot, err)
	}
	dups := 0
	for _, n := range seen {
		dups += n - 1
	}
	d.printf("\nsummary: %d rows committed, %d in the stream (%d duplicates), %d rolled back and %d published by mistake, %d rows marked published, slot confirmed at %s (%d bytes behind)\n",
		len(committed), len(seen), dups, 1, phantoms, published, confirmed, lag)
	if phantoms > 0 || len(seen) != len(committed) {
		return errors.New("the demo saw a phantom or a loss: please report it")
	}
	d.printf("relay stopped cleanly (slot confirmed past every acked row)\n")
	return nil
}

// consume is the receiving end: package inbox applies each message's effect
// once. Every message is delivered twice, by two JetStream consumers, as a
// redelivery or a republish would: the second delivery changes nothing.
func (d *run) consume(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, firstSeq uint64, n int) error {
	d.printf("\nconsumer: applying each message's effect once with package inbox; every message is delivered twice\n")
	if err := inbox.Migrate(ctx, pool, "demo_inbox"); err != nil {
		return fmt.Errorf("migrate demo_inbox: %w", err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS demo_effects (
		work_id text PRIMARY KEY, payload jsonb NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		return fmt.Errorf("create demo_effects: %w", err)
	}
	in, err := inbox.New(pool, inbox.Config{Consumer: "demo", Table: "demo_inbox", Logger: slog.New(zerolog.NewSlogHandler(d.log))})
	if err != nil {
		return fmt.Errorf("inbox: %w", err)
	}
	apply := func(ctx context.Context, tx pgx.Tx, m jetstream.Msg) error {
		_, err := tx.Exec(ctx, `INSERT INTO demo_effects (work_id, payload) VALUES ($1, $2)`, m.Headers().Get(jetstream.MsgIDHeader), m.Data())
		return err
	}
	outcomes := map[inbox.Outcome]int{}
	for range 2 {
		cons, err := js.CreateConsumer(ctx, d.o.Stream, jetstream.ConsumerConfig{
			AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
			OptStartSeq: firstSeq, InactiveThreshold: time.Minute,
		})
		if err != nil {
			return fmt.Errorf("create consumer on %s: %w", d.o.Stream, err)
		}
		batch, err := cons.Fetch(n, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return fmt.Errorf("fetch from %s: %w", d.o.Stream, err)
		}
		for m := range batch.Messages() {
			out, err := in.Process(ctx, m, apply)
			if err != nil {
				return fmt.Errorf("inbox: %s: %w", m.Headers().Get(jetstream.MsgIDHeader), err)
			}
			outcomes[out]++
			if out == inbox.Applied {
				d.printf("  effect applied: %-16s %s\n", m.Headers().Get(jetstream.MsgIDHeader), m.Data())
			}
		}
	}
	d.printf("consumer: %d deliveries, %d effects applied, %d duplicates dropped by the inbox\n",
		outcomes[inbox.Applied]+outcomes[inbox.Duplicate], outcomes[inbox.Applied], outcomes[inbox.Duplicate])
	if outcomes[inbox.Applied] != n || outcomes[inbox.Duplicate] != n {
		return fmt.Errorf("the consumer applied %d effects and dropped %d duplicates, want %d of each: please report it", outcomes[inbox.Applied], outcomes[inbox.Duplicate], n)
	}
	return nil
}
