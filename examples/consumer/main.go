// Command consumer is an example receiver of outbox-relay's messages that
// applies each one's effect once with package inbox, however often
// JetStream delivers it, and prints every effect when it commits.
//
//	DATABASE_URL=postgres://postgres:postgres@localhost:5432/postgres?sslmode=disable \
//	NATS_URL=nats://localhost:4222 go run ./examples/consumer
//
// It creates its inbox and effect tables itself (inbox.Migrate); in
// production the consumer's database is usually not the outbox's.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/inbox"
)

func main() {
	var (
		dbURL   = flag.String("database-url", envOr("DATABASE_URL", "postgres://postgres:postgres@localhost:5432/postgres?sslmode=disable"), "the consumer's PostgreSQL (env DATABASE_URL)")
		natsURL = flag.String("nats-url", envOr("NATS_URL", nats.DefaultURL), "NATS URL (env NATS_URL)")
		stream  = flag.String("stream", envOr("STREAM", "OUTBOX"), "the relay's stream (env STREAM)")
		subject = flag.String("subject", envOr("SUBJECT", "outbox.order.>"), "subjects to consume (env SUBJECT)")
		name    = flag.String("consumer", envOr("CONSUMER", "order-acks"), "durable consumer name, also the inbox key (env CONSUMER)")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dbURL, *natsURL, *stream, *subject, *name); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func run(ctx context.Context, dbURL, natsURL, streamName, subject, name string) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	if err := inbox.Migrate(ctx, pool, "inbox"); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS acknowledged_orders (
		order_id        bigint      NOT NULL,
		message_id      text        NOT NULL,
		acknowledged_at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		return fmt.Errorf("create acknowledged_orders: %w", err)
	}

	nc, err := nats.Connect(natsURL, nats.MaxReconnects(-1), nats.Name("example-consumer"))
	if err != nil {
		return fmt.Errorf("connect to NATS: %w", err)
	}
	defer nc.Drain() //nolint:errcheck
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	// The relay creates the stream on its first start; wait for it.
	var stream jetstream.Stream
	for {
		if stream, err = js.Stream(ctx, streamName); err == nil {
			break
		}
		log.Printf("waiting for stream %s: %v", streamName, err)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(2 * time.Second):
		}
	}
	cons, err := stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
		Durable:       name,
		FilterSubject: subject,
		AckPolicy:     jetstream.AckExplicitPolicy,
		AckWait:       30 * time.Second,
		// The inbox decides when to give up (Config.MaxDeliveries).
		MaxDeliver: -1,
	})
	if err != nil {
		return fmt.Errorf("create consumer %s: %w", name, err)
	}

	logger := slog.New(slog.NewJSONHandler(os.Stderr, nil))
	in, err := inbox.New(pool, inbox.Config{Consumer: name, Logger: logger})
	if err != nil {
		return err
	}
	acknowledge := func(ctx context.Context, tx pgx.Tx, msg jetstream.Msg) error {
		var order struct {
			OrderID int64 `json:"order_id"`
		}
		// The payload in any --message-format (a structured CloudEvent's
		// data included).
		payload, err := inbox.Payload(msg)
		if err != nil {
			return err
		}
		if err := json.Unmarshal(payload, &order); err != nil {
			// Redelivering cannot fix a payload: terminate it.
			return fmt.Errorf("%w: decode payload: %v", inbox.ErrRejected, err)
		}
		_, err = tx.Exec(ctx, `INSERT INTO acknowledged_orders (order_id, message_id) VALUES ($1, $2)`,
			order.OrderID, msg.Headers().Get(jetstream.MsgIDHeader))
		return err
	}
	cc, err := cons.Consume(func(msg jetstream.Msg) {
		// Print after the commit, so each effect is printed once.
		if out, _ := in.Process(ctx, msg, acknowledge); out == inbox.Applied {
			payload, _ := inbox.Payload(msg)
			fmt.Printf("acknowledged %s (%s)\n", msg.Headers().Get(jetstream.MsgIDHeader), payload)
		}
	})
	if err != nil {
		return fmt.Errorf("consume: %w", err)
	}
	defer cc.Stop()
	log.Printf("consuming %s from %s as %s", subject, streamName, name)

	// Daily: drop inbox entries old enough that no redelivery or redrive can
	// bring their message back.
	tick := time.NewTicker(24 * time.Hour)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			s := in.Stats()
			log.Printf("stopping: %d applied, %d duplicates dropped, %d retried, %d rejected", s.Applied, s.Duplicates, s.Retried, s.Rejected)
			return nil
		case <-tick.C:
			n, err := in.Prune(ctx, 30*24*time.Hour)
			if err != nil {
				log.Printf("prune inbox: %v", err)
				continue
			}
			log.Printf("pruned %d inbox entries older than 30 days", n)
		}
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
