// Command producer is an example application that writes orders and, in the
// same transaction, the message announcing each one, with package outbox.
// outbox-relay then publishes the messages to JetStream.
//
//	DATABASE_URL=postgres://postgres:postgres@localhost:5432/postgres?sslmode=disable \
//	  go run ./examples/producer -orders 10
//
// The database needs the outbox table (`outbox-relay migrate`); the orders
// table is created here.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/outbox"
)

func main() {
	var (
		dbURL    = flag.String("database-url", envOr("DATABASE_URL", "postgres://postgres:postgres@localhost:5432/postgres?sslmode=disable"), "PostgreSQL URL (env DATABASE_URL)")
		table    = flag.String("table", envOr("OUTBOX_TABLE", "outbox"), "outbox table, as the relay's --table (env OUTBOX_TABLE)")
		orders   = flag.Int("orders", 10, "orders to place; 0 places one per interval until stopped")
		interval = flag.Duration("interval", time.Second, "pause between orders")
	)
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, *dbURL, *table, *orders, *interval); err != nil && !errors.Is(err, context.Canceled) {
		log.Fatal(err)
	}
}

func run(ctx context.Context, dbURL, table string, orders int, interval time.Duration) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	producer, err := outbox.New(outbox.WithTable(table))
	if err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS orders (
		id         bigserial   PRIMARY KEY,
		customer   text        NOT NULL,
		total      numeric     NOT NULL,
		created_at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		return fmt.Errorf("create orders table: %w", err)
	}
	for i := 0; orders == 0 || i < orders; i++ {
		id, err := placeOrder(ctx, pool, producer, "mina", "29.00")
		if err != nil {
			return err
		}
		fmt.Printf("placed order %d and enqueued order-%d-ack\n", id, id)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(interval):
		}
	}
	return nil
}

// placeOrder stores the order and its acknowledgement intention in one
// transaction: both commit or neither does.
func placeOrder(ctx context.Context, pool *pgxpool.Pool, producer *outbox.Producer, customer, total string) (int64, error) {
	var id int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := tx.QueryRow(ctx, `INSERT INTO orders (customer, total) VALUES ($1, $2) RETURNING id`, customer, total).Scan(&id); err != nil {
			return fmt.Errorf("insert order: %w", err)
		}
		payload, err := json.Marshal(map[string]any{"order_id": id, "customer": customer, "total": total})
		if err != nil {
			return err
		}
		return producer.Enqueue(ctx, tx, outbox.Message{
			// Derived from the order: a retry of this step enqueues the same
			// identity, which the relay, JetStream and the consumer's inbox
			// all recognise.
			WorkID:  fmt.Sprintf("order-%d-ack", id),
			Kind:    "order.received",
			Payload: payload,
		})
	})
	if err != nil {
		return 0, fmt.Errorf("place order: %w", err)
	}
	return id, nil
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}
