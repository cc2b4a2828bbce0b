package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/outbox"
)

// Enqueue the acknowledgement of order 103 in the transaction that stores
// the order: both commit, or neither.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDatabase())
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	tx, err := pool.Begin(ctx)
	if err != nil {
		panic(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, `INSERT INTO orders (id, total) VALUES (103, 29.00)`); err != nil {
		panic(err)
	}
	ack := outbox.Message{
		WorkID:  "order-103-ack", // stable: derived from the order, not per attempt
		Kind:    "order.received",
		Payload: json.RawMessage(`{"order_id": 103, "total": "29.00"}`),
		Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
	}
	if err := outbox.Enqueue(ctx, tx, ack); err != nil {
		panic(err)
	}
	if err := tx.Commit(ctx); err != nil {
		panic(err)
	}
	fmt.Println("order 103 and its acknowledgement committed")

	// A retried request enqueues the same intention again: no second row.
	err = outbox.Enqueue(ctx, pool, ack)
	fmt.Println("retry:", errors.Is(err, outbox.ErrAlreadyEnqueued))

	// The same work_id with another payload is a bug in the caller.
	changed := ack
	changed.Payload = json.RawMessage(`{"order_id": 103, "total": "31.00"}`)
	err = outbox.Enqueue(ctx, pool, changed)
	fmt.Println("changed:", errors.Is(err, outbox.ErrConflict))
	fmt.Println(err)
	// Output:
	// order 103 and its acknowledgement committed
	// retry: true
	// changed: true
	// outbox: work_id "order-103-ack" is already enqueued with a different payload (stored kind "order.received", subject "", payload {"total": "29.00", "order_id": 103}); a changed intention needs a new work_id
}

// EnqueueBatch writes many rows in one round trip and reports each.
func ExampleEnqueueBatch() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, exampleDatabase())
	if err != nil {
		panic(err)
	}
	defer pool.Close()

	msgs := []outbox.Message{
		{WorkID: "order-1-ack", Kind: "order.received", Payload: json.RawMessage(`{"order_id": 1}`)},
		{WorkID: "order-2-ack", Kind: "order.received", Payload: json.RawMessage(`{"order_id": 2}`)},
	}
	if _, err := outbox.EnqueueBatch(ctx, pool, msgs[:1]); err != nil {
		panic(err)
	}
	results, err := outbox.EnqueueBatch(ctx, pool, msgs)
	if err != nil {
		panic(err)
	}
	for i, r := range results {
		fmt.Println(msgs[i].WorkID, r)
	}
	// Output:
	// order-1-ack already enqueued
	// order-2-ack inserted
}

// Messages are checked before the database with the relay's rules.
func ExampleMessage_Validate() {
	m := outbox.Message{WorkID: "order-103-ack", Kind: "order.received", Subject: "shop.>", Payload: json.RawMessage(`{}`)}
	fmt.Println(m.Validate())
	m = outbox.Message{WorkID: "order-103-ack", Kind: "order.received", Payload: json.RawMessage(`{}`), Headers: map[string]string{"Nats-Msg-Id": "x"}}
	fmt.Println(m.Validate())
	// Output:
	// outbox: invalid message: work_id "order-103-ack": subject "shop.>" contains a wildcard (* or >); publish to a concrete subject; NATS would refuse to publish it
	// outbox: invalid message: work_id "order-103-ack": header "Nats-Msg-Id": Nats-* and Outbox-* headers are reserved for the broker and the relay; choose another name
}

// A producer for a table other than public.outbox (the relay's --table).
func ExampleWithTable() {
	p, err := outbox.New(outbox.WithTable("shop.outbox"))
	if err != nil {
		panic(err)
	}
	fmt.Println(p.Table())
	// Output: shop.outbox
}
