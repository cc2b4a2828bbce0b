package demo

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/console"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/outbox"
)

const (
	// ordersStreamSuffix names the orders' own stream after the relay's:
	// its small message limit is what refuses the invoice, and raising it
	// must not touch the main stream.
	ordersStreamSuffix = "_DEMO_ORDERS"
	ordersMaxMsgSize   = 1024
	raisedMaxMsgSize   = 64 * 1024
	// demoMaxAttempts makes the refused row a dead letter after one retry.
	demoMaxAttempts = 2
	// reminderDeadline is how long order 201's reminder may wait: less
	// than the demo waits before the operator steps in.
	reminderDeadline = 1500 * time.Millisecond
)

// orderMsg is one message of the orders section.
type orderMsg struct {
	order, seq int
	kind       string
	payload    map[string]any
	deadline   bool
}

func (m orderMsg) workID(suffix string) string {
	return fmt.Sprintf("order-%d-%d%s", m.order, m.seq, suffix)
}

// orders shows the rest of the product on two orders whose messages go to a
// stream of their own, limited to 1 KiB per message: --ordering aggregate
// keeps each order's messages in sequence while order 201's refused
// invoice holds its later ones and order 202 flows; 201's reminder, whose
// deadline passes while it waits, ends expired and is never sent; the
// invoice becomes a dead letter, which the operator redrives once the limit
// is raised.
func (d *run) orders(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, suffix string, rel *relayRun) error {
	st := store.New(pool, d.o.Table, d.o.Policy)
	subject := strings.ToLower(d.ordersStream)
	// The stream is the demo's own: a previous run's is replaced, so the
	// stream holds this run's messages only.
	if err := js.DeleteStream(ctx, d.ordersStream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("delete the demo's stream %s: %w", d.ordersStream, err)
	}
	cfg := jetstream.StreamConfig{Name: d.ordersStream, Subjects: []string{subject + ".>"},
		MaxMsgSize: ordersMaxMsgSize, Duplicates: 2 * time.Minute}
	if _, err := js.CreateStream(ctx, cfg); err != nil {
		return fmt.Errorf("create the demo's stream %s: %w", d.ordersStream, err)
	}
	d.printf("\norders, in sequence (--ordering aggregate): stream %s takes messages up to %d bytes (--allow-stream %s)\n",
		d.ordersStream, ordersMaxMsgSize, d.ordersStream)

	producer, err := outbox.New(outbox.WithTable(d.o.Table.Qualified()))
	if err != nil {
		return fmt.Errorf("outbox producer: %w", err)
	}
	placed := func(id int) map[string]any { return map[string]any{"order_id": id, "status": "placed"} }
	txs := [][]orderMsg{
		{{201, 1, "order_placed", placed(201), false}, {202, 1, "order_placed", placed(202), false}},
		{{201, 2, "invoice_attached", map[string]any{"order_id": 201, "invoice_pdf": strings.Repeat("J", 2*ordersMaxMsgSize)}, false},
			{202, 2, "order_paid", map[string]any{"order_id": 202, "status": "paid"}, false}},
		{{201, 3, "payment_reminder", map[string]any{"order_id": 201, "message": "please pay within the hour"}, true},
			{202, 3, "order_shipped", map[string]any{"order_id": 202, "status": "shipped"}, false}},
		{{201, 4, "order_cancelled", map[string]any{"order_id": 201, "status": "cancelled"}, false}},
	}
	var all []orderMsg
	var reminderDue time.Time
	for i, msgs := range txs {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return fmt.Errorf("orders: begin: %w", err)
		}
		var names []string
		for _, m := range msgs {
			payload, err := json.Marshal(m.payload)
			if err != nil {
				_ = tx.Rollback(ctx)
				return fmt.Errorf("%s: encode payload: %w", m.workID(suffix), err)
			}
			om := outbox.Message{
				WorkID: m.workID(suffix), Kind: m.kind, Payload: payload,
				Subject:   fmt.Sprintf("%s.%d", subject, m.order),
				Aggregate: outbox.Aggregate{Type: "order", ID: fmt.Sprintf("%d%s", m.order, suffix)},
			}
			note := ""
			if m.deadline {
				reminderDue = time.Now().Add(reminderDeadline)
				om.ExpiresAt = reminderDue
				note = fmt.Sprintf(", deadline in %v", reminderDeadline)
			}
			if len(payload) > ordersMaxMsgSize {
				note = fmt.Sprintf(", %d bytes: over the stream's limit", len(payload))
			}
			if err := producer.Enqueue(ctx, tx, om); err != nil {
				_ = tx.Rollback(ctx)
				return fmt.Errorf("enqueue %s: %w", om.WorkID, err)
			}
			names = append(names, fmt.Sprintf("%s #%d %s%s", om.WorkID, m.seq, m.kind, note))
			all = append(all, m)
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("orders: commit: %w", err)
		}
		d.printf("  -> transaction %d: %s\n", i+1, strings.Join(names, "; "))
	}

	want := map[string]string{}
	for _, m := range all {
		want[m.workID(suffix)] = "published"
	}
	invoice, reminder, cancelled := all[2].workID(suffix), all[4].workID(suffix), all[6].workID(suffix)
	want[invoice], want[reminder], want[cancelled] = "failed", "expired", "scheduled"
	rows, err := d.waitStates(ctx, st, all, suffix, want, rel)
	if err != nil || ctx.Err() != nil {
		return err
	}
	d.printf("  order 202 flowed; order 201 waits behind its refused #2, and #3's deadline passed while it waited:\n")
	d.printRows(all, suffix, rows)

	d.printf("\ndead letter: %s failed after %d attempts (%s)\n", invoice, rows[invoice].Attempts, clip(rows[invoice].LastError, 70))
	d.printf("  the operator raises the stream's limit to %d bytes and redrives it, as\n", raisedMaxMsgSize)
	d.printf("  `outbox-relay redrive --work-id %s --reason \"invoice limit raised\"` does:\n", invoice)
	cfg.MaxMsgSize = raisedMaxMsgSize
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("raise the limit of stream %s: %w", d.ordersStream, err)
	}
	res, err := st.Redrive(ctx, store.OpRequest{Selection: store.Selection{WorkIDs: []string{invoice}},
		By: "demo", Reason: "invoice limit raised"})
	if err != nil {
		return fmt.Errorf("redrive %s: %w", invoice, err)
	}
	if len(res.Changed) != 1 {
		return fmt.Errorf("redrive %s changed %d rows, want 1: %+v", invoice, len(res.Changed), res)
	}
	d.printf("  redriven: %s (attempts reset to 0, by demo: \"invoice limit raised\")\n", invoice)
	want[invoice], want[cancelled] = "published", "published"
	if rows, err = d.waitStates(ctx, st, all, suffix, want, rel); err != nil || ctx.Err() != nil {
		return err
	}
	d.printRows(all, suffix, rows)
	return d.showOrdersStream(ctx, js, all, suffix, reminder)
}

// waitStates waits until every orders row is in its wanted state and
// returns the rows.
func (d *run) waitStates(ctx context.Context, st *store.Store, all []orderMsg, suffix string, want map[string]string, rel *relayRun) (map[string]store.ListedRow, error) {
	deadline := time.Now().Add(deliverTimeout)
	for {
		rows := map[string]store.ListedRow{}
		var wrong []string
		for _, m := range all {
			id := m.workID(suffix)
			r, found, err := st.Row(ctx, id)
			if err != nil {
				return nil, fmt.Errorf("read %s: %w", id, err)
			}
			rows[id] = r
			if !found || r.State != want[id] {
				wrong = append(wrong, fmt.Sprintf("%s is %q, want %s", id, r.State, want[id]))
			}
		}
		if len(wrong) == 0 {
			return rows, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("orders: after %v %s", deliverTimeout, strings.Join(wrong, "; "))
		}
		select {
		case <-ctx.Done():
			return nil, nil
		case <-rel.done:
			return nil, fmt.Errorf("relay stopped: %w", relayErr(rel.err))
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func (d *run) printRows(all []orderMsg, suffix string, rows map[string]store.ListedRow) {
	for _, m := range all {
		r := rows[m.workID(suffix)]
		d.printf("     %-22s #%d %-17s %-9s %s\n", r.WorkID, m.seq, m.kind, r.State, clip(r.LastError, 60))
	}
}

// showOrdersStream prints the orders' stream and checks it: each order's
// messages in sequence, the expired reminder never sent.
func (d *run) showOrdersStream(ctx context.Context, js jetstream.JetStream, all []orderMsg, suffix, expired string) error {
	s, err := js.Stream(ctx, d.ordersStream)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", d.ordersStream, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return fmt.Errorf("read stream %s: %w", d.ordersStream, err)
	}
	seqOf := map[string]orderMsg{}
	for _, m := range all {
		seqOf[m.workID(suffix)] = m
	}
	d.printf("  stream %s now holds, in stream order:\n", d.ordersStream)
	last := map[int]int{}
	var problems []string
	n := 0
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		raw, err := s.GetMsg(ctx, seq)
		if err != nil {
			return fmt.Errorf("read message %d of stream %s: %w", seq, d.ordersStream, err)
		}
		id := raw.Header.Get(jetstream.MsgIDHeader)
		m, ok := seqOf[id]
		if !ok {
			problems = append(problems, "an unknown message "+id)
			continue
		}
		n++
		d.printf("     stream seq %-3d %-22s order %d #%d %s\n", seq, id, m.order, m.seq, m.kind)
		if id == expired {
			problems = append(problems, id+" was sent after its deadline")
		}
		if m.seq < last[m.order] {
			problems = append(problems, fmt.Sprintf("order %d's #%d after #%d", m.order, m.seq, last[m.order]))
		}
		last[m.order] = m.seq
	}
	if n != len(all)-1 {
		problems = append(problems, fmt.Sprintf("%d messages, want %d", n, len(all)-1))
	}
	if len(problems) > 0 {
		return fmt.Errorf("the orders' stream is wrong (%s): please report it", strings.Join(problems, "; "))
	}
	d.printf("  each order in sequence; %s expired and was never sent\n", expired)
	return nil
}

// serveConsole serves the operator console on the demo's table until ctx
// ends, with a random token for this session only.
func (d *run) serveConsole(ctx context.Context, pool *pgxpool.Pool) error {
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return fmt.Errorf("console token: %w", err)
	}
	token := hex.EncodeToString(b[:])
	addr := d.opts.ConsoleAddr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ui, err := console.New(console.Options{Enabled: true, Token: token}, addr, console.Sources{
		Store: store.New(pool, d.o.Table, d.o.Policy), Catalog: pool, Slot: d.o.Slot,
	})
	if err != nil {
		return fmt.Errorf("console: %w", err)
	}
	return app.ServeConsole(ctx, addr, ui, func(a net.Addr) {
		d.printf("\nconsole: %s\n  token for this session: %s\n  dead letters, their evidence, redrive and cancel, and the history (the demo's redrive is there).\n  Ctrl-C stops the console and removes the demo's servers.\n", "http://"+a.String()+"/ui/", token)
	})
}

// clip shortens s for one line of the story.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
