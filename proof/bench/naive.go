package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The naive polling publisher is the baseline the relay is compared with: the
// loop from the usual outbox articles, on its own copy of the table with a
// partial index on its predicate. Each batch is one transaction:
//
//	SELECT ... WHERE state = 'ready' ORDER BY created_at LIMIT 100 FOR UPDATE SKIP LOCKED
//	publish the batch (async, then wait for every ack; or one sync publish at a time)
//	UPDATE ... SET state = 'published' (or DELETE) WHERE work_id = ANY(...)
//	COMMIT
//
// It keeps the transaction open across the broker's acks (the articles
// advise against that; it is what makes a crash before COMMIT re-publish
// rather than lose). When a batch comes back empty it sleeps the poll
// interval.

// naiveTable is created in the polling cases' own database.
const naiveTable = `CREATE TABLE naive_outbox (
	work_id      text PRIMARY KEY,
	kind         text NOT NULL,
	payload      jsonb NOT NULL,
	state        text NOT NULL DEFAULT 'ready',
	created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
	published_at timestamptz
);
CREATE INDEX naive_outbox_ready ON naive_outbox (created_at) WHERE state = 'ready';`

// NaiveMain runs the polling publisher until SIGTERM; it is the hidden
// `naive-publish` subcommand of outbox-bench, run as a child process so its
// CPU and memory can be measured like the relay's.
func NaiveMain(args []string) error {
	fs := flag.NewFlagSet("naive-publish", flag.ContinueOnError)
	dbURL := fs.String("database-url", "", "")
	natsURL := fs.String("nats-url", "", "")
	subject := fs.String("subject", "", "")
	batch := fs.Int("batch", 100, "")
	poll := fs.Duration("poll-interval", 100*time.Millisecond, "")
	policy := fs.String("policy", "mark", "mark|delete")
	mode := fs.String("mode", "async", "async|sync")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	conn, err := pgx.Connect(ctx, *dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	nc, err := nats.Connect(*natsURL, nats.Name("naive-publisher"))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4*(*batch)))
	if err != nil {
		return err
	}
	done := `UPDATE naive_outbox SET state = 'published', published_at = clock_timestamp() WHERE work_id = ANY($1)`
	if *policy == "delete" {
		done = `DELETE FROM naive_outbox WHERE work_id = ANY($1)`
	}
	sel := fmt.Sprintf(`SELECT work_id, payload::text FROM naive_outbox WHERE state = 'ready'
		ORDER BY created_at LIMIT %d FOR UPDATE SKIP LOCKED`, *batch)
	ids := make([]string, 0, *batch)
	futs := make([]jetstream.PubAckFuture, 0, *batch)
	for ctx.Err() == nil {
		n, err := naiveBatch(ctx, conn, js, sel, done, *subject, *mode == "sync", ids, futs)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			fmt.Fprintf(os.Stderr, "naive publisher: %v\n", err)
			time.Sleep(*poll)
			continue
		}
		if n == 0 {
			select {
			case <-ctx.Done():
			case <-time.After(*poll):
			}
		}
	}
	return nil
}

func naiveBatch(ctx context.Context, conn *pgx.Conn, js jetstream.JetStream, sel, done, subject string, sync bool,
	ids []string, futs []jetstream.PubAckFuture) (int, error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return 0, err
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // no-op after commit
	rows, err := tx.Query(ctx, sel)
	if err != nil {
		return 0, err
	}
	ids, futs = ids[:0], futs[:0]
	var payloads [][]byte
	for rows.Next() {
		var id string
		var p []byte
		if err := rows.Scan(&id, &p); err != nil {
			return 0, err
		}
		ids = append(ids, id)
		payloads = append(payloads, p)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if len(ids) == 0 {
		return 0, tx.Commit(ctx)
	}
	for i, id := range ids {
		msg := &nats.Msg{Subject: subject, Data: payloads[i], Header: nats.Header{"Nats-Msg-Id": []string{id}}}
		if sync {
			if _, err := js.PublishMsg(ctx, msg); err != nil {
				return 0, fmt.Errorf("publish %s: %w", id, err)
			}
			continue
		}
		f, err := js.PublishMsgAsync(msg)
		if err != nil {
			return 0, fmt.Errorf("publish %s: %w", id, err)
		}
		futs = append(futs, f)
	}
	for _, f := range futs {
		select {
		case <-f.Ok():
		case err := <-f.Err():
			return 0, fmt.Errorf("publish %s: %w", f.Msg().Header.Get("Nats-Msg-Id"), err)
		case <-time.After(10 * time.Second):
			return 0, errors.New("no ack within 10s")
		}
	}
	if _, err := tx.Exec(ctx, done, ids); err != nil {
		return 0, err
	}
	return len(ids), tx.Commit(ctx)
}
