package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/inbox"
	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/relay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("demo", "Shows rows flowing end to end. Without --database-url / --nats-url it starts a throwaway PostgreSQL (wal_level=logical) and nats-server and removes them afterwards.", stderr)
	c.register(fs, true)
	if err := parse(fs, args); err != nil {
		return err
	}
	// The demo's URL defaults are "start one", unlike run's.
	if !flagGiven(fs, "nats-url") {
		c.natsURL = ""
	}
	log, err := c.log.Logger(stderr)
	if err != nil {
		return err
	}
	if c.log.Level == "info" && !flagGiven(fs, "log-level") {
		log = log.Level(4) // the demo's own lines tell the story; warnings and errors still show
	}

	userDB := c.databaseURL != ""
	if !userDB {
		fmt.Fprintln(stdout, "starting a throwaway PostgreSQL (wal_level=logical)...")
		pg, err := testenv.StartPostgres(testenv.PostgresOptions{Fsync: true})
		if err != nil {
			return fmt.Errorf("start throwaway PostgreSQL (or pass --database-url): %w", err)
		}
		defer pg.Close()
		c.databaseURL = pg.URL("postgres")
	}
	if c.natsURL == "" {
		fmt.Fprintln(stdout, "starting a throwaway nats-server with JetStream...")
		n, err := testenv.StartNATS(testenv.NATSOptions{})
		if err != nil {
			return fmt.Errorf("start throwaway nats-server (or pass --nats-url): %w", err)
		}
		defer n.Close()
		c.natsURL = n.URL()
	}
	o, err := c.options()
	if err != nil {
		return err
	}

	conn, err := pgx.Connect(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := store.Migrate(ctx, conn, o.Table); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "migrated %s\n", o.Table.Qualified())

	// The relay, in this process, exactly as `outbox-relay run` runs it.
	relayCtx, stopRelay := context.WithCancel(ctx)
	defer stopRelay()
	var (
		mu sync.Mutex
		r  *relay.Relay
	)
	o.Started = func(x *relay.Relay) { mu.Lock(); r = x; mu.Unlock() }
	relayDone := make(chan error, 1)
	go func() { relayDone <- app.Run(relayCtx, o, log) }()
	if err := waitUntil(ctx, 30*time.Second, relayDone, func() bool {
		mu.Lock()
		defer mu.Unlock()
		return r != nil && r.Role() == relay.RoleActive
	}); err != nil {
		return fmt.Errorf("relay did not start streaming: %w", err)
	}
	fmt.Fprintf(stdout, "relay streaming slot %s into stream %s\n\n", o.Slot, o.Stream)

	scrub := app.NewNATSScrubber(c.natsURL, app.NATSAuth{})
	// Where nats.go's default handler prints asynchronous errors (not the
	// stderr writer, which the main goroutine writes unguarded), but scrubbed.
	nc, err := nats.Connect(c.natsURL, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		fmt.Fprintf(os.Stderr, "NATS: %v\n", scrub.Err(err))
	}))
	if err != nil {
		return fmt.Errorf("connect to NATS at %s: %w", app.RedactNATSURLs(c.natsURL), scrub.Err(err))
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	cons, err := js.OrderedConsumer(ctx, o.Stream, jetstream.OrderedConsumerConfig{DeliverPolicy: jetstream.DeliverNewPolicy})
	if err != nil {
		return fmt.Errorf("consume stream %s: %w", o.Stream, err)
	}
	received := make(chan jetstream.Msg, 64)
	cc, err := cons.Consume(func(m jetstream.Msg) { received <- m })
	if err != nil {
		return fmt.Errorf("consume stream %s: %w", o.Stream, err)
	}
	defer cc.Stop()

	// On a database of the user's the work IDs get a suffix, so a second
	// run does not collide with the first run's rows.
	suffix := ""
	if userDB {
		suffix = fmt.Sprintf("-%d", time.Now().Unix())
	}
	committed, err := demoInserts(ctx, conn, o.Table, suffix, stdout)
	if err != nil {
		return err
	}

	seen := map[string]int{}
	var firstSeq uint64
	deadline := time.After(30 * time.Second)
	fmt.Fprintln(stdout)
	for len(seen) < len(committed) {
		select {
		case m := <-received:
			id := m.Headers().Get(jetstream.MsgIDHeader)
			seen[id]++
			if md, err := m.Metadata(); err == nil && (firstSeq == 0 || md.Sequence.Stream < firstSeq) {
				firstSeq = md.Sequence.Stream
			}
			fmt.Fprintf(stdout, "\r\033[K  <- %-16s subject=%s lsn=%s  %s\n", id, m.Subject(), m.Headers().Get(wire.HeaderCommitLSN), m.Data())
			fmt.Fprintf(stdout, "  received %d/%d", len(seen), len(committed))
		case <-deadline:
			return fmt.Errorf("only %d of %d committed rows reached the stream within 30s", len(seen), len(committed))
		case err := <-relayDone:
			return fmt.Errorf("relay stopped: %w", err)
		case <-ctx.Done():
			return nil
		}
	}
	fmt.Fprintln(stdout)

	// Give the phantom a moment to appear if the relay were wrong.
	phantoms := 0
	settle := time.After(time.Second)
wait:
	for {
		select {
		case m := <-received:
			if id := m.Headers().Get(jetstream.MsgIDHeader); committed[id] {
				seen[id]++
			} else {
				phantoms++
			}
		case <-settle:
			break wait
		}
	}
	// Stop first: a graceful stop confirms the slot past everything acked.
	stopRelay()
	if err := <-relayDone; err != nil {
		return err
	}
	var published int
	err = conn.QueryRow(ctx, `SELECT count(*) FROM `+o.Table.String()+` WHERE state = 'published'`).Scan(&published)
	if err != nil {
		return fmt.Errorf("count published rows: %w", err)
	}
	var confirmed string
	var lag int64
	err = conn.QueryRow(ctx, `SELECT confirmed_flush_lsn::text, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
		FROM pg_replication_slots WHERE slot_name = $1`, o.Slot).Scan(&confirmed, &lag)
	if err != nil {
		return fmt.Errorf("read slot: %w", err)
	}
	dups := 0
	for _, n := range seen {
		dups += n - 1
	}
	fmt.Fprintf(stdout, "\nsummary: %d rows committed, %d in the stream (%d duplicates), %d rolled back and %d published by mistake, %d rows marked published, slot confirmed at %s (%d bytes behind)\n",
		len(committed), len(seen), dups, 1, phantoms, published, confirmed, lag)
	if phantoms > 0 || len(seen) != len(committed) {
		return errors.New("the demo saw a phantom or a loss: please report it")
	}
	fmt.Fprintln(stdout, "relay stopped cleanly (slot confirmed past every acked row)")
	return demoConsumer(ctx, c.databaseURL, js, o.Stream, firstSeq, len(seen), stdout, log)
}

// demoConsumer is the receiving end: package inbox applies each message's
// effect once. Every message is delivered twice, by two JetStream consumers,
// as a redelivery or a republish would: the second delivery changes nothing.
func demoConsumer(ctx context.Context, dbURL string, js jetstream.JetStream, stream string, firstSeq uint64, n int, stdout io.Writer, log zerolog.Logger) error {
	fmt.Fprintln(stdout, "\nconsumer: applying each message's effect once with package inbox; every message is delivered twice")
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := inbox.Migrate(ctx, pool, "demo_inbox"); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS demo_effects (
		work_id text PRIMARY KEY, payload jsonb NOT NULL, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		return fmt.Errorf("create demo_effects: %w", err)
	}
	in, err := inbox.New(pool, inbox.Config{Consumer: "demo", Table: "demo_inbox", Logger: &log})
	if err != nil {
		return err
	}
	apply := func(ctx context.Context, tx pgx.Tx, m jetstream.Msg) error {
		_, err := tx.Exec(ctx, `INSERT INTO demo_effects (work_id, payload) VALUES ($1, $2)`, m.Headers().Get(jetstream.MsgIDHeader), m.Data())
		return err
	}
	outcomes := map[inbox.Outcome]int{}
	for pass := 1; pass <= 2; pass++ {
		cons, err := js.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{
			AckPolicy: jetstream.AckExplicitPolicy, DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
			OptStartSeq: firstSeq, InactiveThreshold: time.Minute,
		})
		if err != nil {
			return fmt.Errorf("create consumer on %s: %w", stream, err)
		}
		batch, err := cons.Fetch(n, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return fmt.Errorf("fetch from %s: %w", stream, err)
		}
		for m := range batch.Messages() {
			out, err := in.Process(ctx, m, apply)
			if err != nil {
				return fmt.Errorf("inbox: %s: %w", m.Headers().Get(jetstream.MsgIDHeader), err)
			}
			outcomes[out]++
			if out == inbox.Applied {
				fmt.Fprintf(stdout, "  effect applied: %-16s %s\n", m.Headers().Get(jetstream.MsgIDHeader), m.Data())
			}
		}
	}
	fmt.Fprintf(stdout, "consumer: %d deliveries, %d effects applied, %d duplicates dropped by the inbox\n",
		outcomes[inbox.Applied]+outcomes[inbox.Duplicate], outcomes[inbox.Applied], outcomes[inbox.Duplicate])
	if outcomes[inbox.Applied] != n || outcomes[inbox.Duplicate] != n {
		return fmt.Errorf("the consumer applied %d effects and dropped %d duplicates, want %d of each: please report it", outcomes[inbox.Applied], outcomes[inbox.Duplicate], n)
	}
	return nil
}

// demoInserts writes Mina's order 103 and its acknowledgement in one
// transaction, a few more orders, and one transaction that rolls back.
func demoInserts(ctx context.Context, conn *pgx.Conn, t store.Table, suffix string, w io.Writer) (map[string]bool, error) {
	stmts := []string{
		`CREATE TABLE IF NOT EXISTS demo_orders (id int PRIMARY KEY, customer_id int NOT NULL, total numeric(10,2) NOT NULL, status text NOT NULL)`,
		`TRUNCATE demo_orders`,
	}
	for _, s := range stmts {
		if _, err := conn.Exec(ctx, s); err != nil {
			return nil, fmt.Errorf("prepare demo_orders: %w", err)
		}
	}
	committed := map[string]bool{}
	order := func(id int, total string, commit bool) error {
		workID := fmt.Sprintf("order-%d-ack%s", id, suffix)
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		if _, err := tx.Exec(ctx, `INSERT INTO demo_orders VALUES ($1, 1, $2, 'pending')`, id, total); err != nil {
			return fmt.Errorf("insert order %d: %w", id, err)
		}
		payload := fmt.Sprintf(`{"order_id":%d,"customer_id":1,"total":"%s","message":"Order received; payment still pending"}`, id, total)
		if _, err := tx.Exec(ctx, `INSERT INTO `+t.String()+` (work_id, kind, payload, headers) VALUES ($1, 'order_received', $2, $3)
			ON CONFLICT (work_id) DO NOTHING`, workID, payload, `{"traceparent":"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}`); err != nil {
			return fmt.Errorf("insert %s: %w", workID, err)
		}
		if !commit {
			fmt.Fprintf(w, "  -> order %d and %s inserted, then ROLLBACK (must never be published)\n", id, workID)
			return tx.Rollback(ctx)
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		committed[workID] = true
		fmt.Fprintf(w, "  -> order %d and %s committed in one transaction\n", id, workID)
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

func waitUntil(ctx context.Context, timeout time.Duration, failed <-chan error, cond func() bool) error {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return errors.New("timed out")
		}
		select {
		case err := <-failed:
			return err
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}
