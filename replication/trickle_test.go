package replication_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/rs/zerolog"

	"github.com/outbox-relay/outbox-relay/replication"
)

// A trickle of one-row transactions with a linger, against a real server
// over TCP: the stream drains each lingering batch with reads that never
// wait (its socket is a drainConn), groups the transactions, and hands over
// every event in order (a batch may end inside a transaction whose rest was
// not in yet: the rest comes first in the next), losing none.
func TestTrickleDrainsWholeTransactions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url, db := outboxDatabase(ctx, t)
	if _, err := replication.EnsurePublication(ctx, db, "trickle", "public", "outbox"); err != nil {
		t.Fatal(err)
	}
	conn, err := replication.Connect(ctx, url, "trickle-test")
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if !replication.IsDrainConn(conn.Conn()) {
		t.Fatalf("the replication connection's socket is %T, want a drainConn", conn.Conn())
	}
	created, err := replication.CreateSlot(ctx, conn, "trickle", false)
	if err != nil {
		t.Fatal(err)
	}
	s, err := replication.Start(ctx, conn, replication.StreamConfig{
		Slot: "trickle", Publication: "trickle", Table: replication.Table{Schema: "public", Name: "outbox"},
		StatusInterval: time.Second, Linger: 20 * time.Millisecond, Logger: zerolog.Nop(),
	}, created.ConsistentPoint, nil)
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan []replication.Event)
	confirms := make(chan pglogrepl.LSN, 1)
	stop := make(chan struct{})
	runErr := make(chan error, 1)
	go func() { runErr <- s.Run(ctx, out, confirms, stop) }()

	const n = 60
	produced := make(chan error, 1)
	go func() {
		for i := range n {
			if _, err := db.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload) VALUES ($1, 'k', '{}')`, fmt.Sprintf("t%03d", i)); err != nil {
				produced <- err
				return
			}
			time.Sleep(2 * time.Millisecond)
		}
		produced <- nil
	}()
	var got []string
	batches, inTx := 0, false
	timeout := time.After(60 * time.Second)
	for len(got) < n {
		select {
		case batch := <-out:
			batches++
			for _, ev := range batch {
				switch ev.Type {
				case replication.EventBegin:
					if inTx {
						t.Fatalf("batch %d: a Begin inside a transaction", batches)
					}
					inTx = true
				case replication.EventRow:
					if !inTx {
						t.Fatalf("batch %d: a row outside a transaction", batches)
					}
					got = append(got, ev.Row.WorkID)
				case replication.EventCommit:
					if !inTx {
						t.Fatalf("batch %d: a Commit outside a transaction", batches)
					}
					inTx = false
				}
			}
		case err := <-runErr:
			t.Fatalf("stream ended: %v", err)
		case <-timeout:
			t.Fatalf("after 60s %d of %d rows", len(got), n)
		}
	}
	if err := <-produced; err != nil {
		t.Fatal(err)
	}
	for i, id := range got {
		if want := fmt.Sprintf("t%03d", i); id != want {
			t.Fatalf("row %d is %s, want %s (commit order)", i, id, want)
		}
	}
	if batches >= n {
		t.Errorf("%d transactions came in %d batches: the linger grouped none", n, batches)
	}
	t.Logf("%d transactions in %d batches", n, batches)
	close(stop)
	close(confirms)
	go func() {
		for range out {
		}
	}()
	err = <-runErr
	close(out)
	if err != nil {
		t.Fatal(err)
	}
}
