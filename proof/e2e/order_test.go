package e2e

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
)

// G12 across kill -9: the relay binary with --ordering aggregate is killed
// while an aggregate is held behind a refused row, and while rows of every
// aggregate keep coming: a producer commits rows before the kill, while the
// relay is down and after it is back, and the test checks it did. After the restart the held set comes from the
// table: the held rows stay behind, other aggregates flow, and once the
// operator raises the limit and redrives the row, every aggregate's
// messages are stored in sequence order, once each.
func TestOrderingSurvivesKill9(t *testing.T) {
	t.Parallel()
	env := testenv.Shared(t)
	dbURL := env.PG.CreateDatabase(t)
	stream, prefix := env.StreamName(t)
	slot, publication := uniqueName("e2e_order"), "outbox_relay"
	migrate(t, dbURL, publication)
	conn := connectPG(t, dbURL)
	js := connectNATS(t, env.NATS.URL())
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{prefix + ">"}, MaxMsgSize: 1024}); err != nil {
		t.Fatal(err)
	}
	r := newRelay(t, runArgs(dbURL, env.NATS.URL(), stream, prefix, slot, publication,
		"--ordering", "aggregate", "--max-attempts", "2", "--backoff-min", "10ms", "--backoff-max", "50ms", "--poll-interval", "100ms")...)
	r.start()
	waitSlot(t, conn, slot, true, 60*time.Second)

	insert := func(agg, seq int) {
		t.Helper()
		pad := 0
		if agg == 3 && seq == 2 {
			pad = 2048 // over the stream's max message size: refused at ack time
		}
		id := fmt.Sprintf("o-%d-%d", agg, seq)
		if _, err := conn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
			VALUES ($1, 'order_event', jsonb_build_object('pad', repeat('x', $3::int)), 'order', $2, outbox_next_seq('order', $2))`,
			id, strconv.Itoa(agg), pad); err != nil {
			t.Fatalf("insert %s: %v", id, err)
		}
	}
	const aggs = 6
	for seq := 1; seq <= 4; seq++ {
		for a := 1; a <= aggs; a++ {
			insert(a, seq)
		}
	}
	count := func(q string) int {
		var n int
		if err := conn.QueryRow(ctx, q).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testenv.WaitFor(t, 60*time.Second, "o-3-2 failed, everything else of the other aggregates published", func() (bool, error) {
		return count(`SELECT count(*) FROM outbox WHERE state = 'failed'`) == 1 &&
			count(`SELECT count(*) FROM outbox WHERE state = 'published'`) == aggs*4-3, nil
	})
	// A producer commits rows of every aggregate, round robin, across the
	// kill, on its own connection.
	pconn := connectPG(t, dbURL)
	stopProducer, producerDone := make(chan struct{}), make(chan error, 1)
	go func() {
		for i := 0; ; i++ {
			select {
			case <-stopProducer:
				producerDone <- nil
				return
			default:
			}
			a := strconv.Itoa(1 + i%aggs)
			if _, err := pconn.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload, aggregate_type, aggregate_id, aggregate_seq)
				VALUES ($1, 'order_event', '{}', 'order', $2, outbox_next_seq('order', $2))`, fmt.Sprintf("live-%s-%d", a, i), a); err != nil {
				producerDone <- err
				return
			}
			time.Sleep(5 * time.Millisecond)
		}
	}()
	var epoch time.Time
	dbNow := func() time.Time {
		var now time.Time
		if err := conn.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	liveBetween := func(from, to time.Time) int {
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM outbox WHERE work_id LIKE 'live-%' AND created_at >= $1 AND created_at < $2`, from, to).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitLive := func(from time.Time, what string) {
		t.Helper()
		testenv.WaitFor(t, 30*time.Second, "rows committed "+what, func() (bool, error) {
			return liveBetween(from, time.Now().Add(time.Hour)) >= 2*aggs, nil
		})
	}
	waitLive(epoch, "before the kill")
	r.kill()
	killed := dbNow()
	for seq := 5; seq <= 6; seq++ {
		for a := 1; a <= aggs; a++ {
			insert(a, seq)
		}
	}
	waitLive(killed, "while the relay is down")
	restarting := dbNow()
	r.start()
	back := dbNow()
	waitLive(back, "after the restart")
	close(stopProducer)
	if err := <-producerDone; err != nil {
		t.Fatalf("producer: %v", err)
	}
	far := time.Now().Add(time.Hour)
	before, during, after := liveBetween(epoch, killed), liveBetween(killed, restarting), liveBetween(back, far)
	t.Logf("producer rows committed before the kill %d, while the relay was down %d, after the restart %d", before, during, after)
	if before == 0 || during == 0 || after == 0 {
		t.Fatalf("the producer was not writing across the kill (%d before, %d during, %d after): the test proves nothing", before, during, after)
	}
	total, held := count(`SELECT count(*) FROM outbox`), count(`SELECT count(*) FROM outbox WHERE aggregate_id = '3'`)-2
	// Both at once: the producer's last rows may still be on their way
	// (streamed, not yet settled) when the other aggregates' are out.
	testenv.WaitFor(t, 60*time.Second, "the other aggregates' new rows published and aggregate 3's held after the restart", func() (bool, error) {
		published := count(`SELECT count(*) FROM outbox WHERE state = 'published'`)
		n := count(`SELECT count(*) FROM outbox WHERE aggregate_id = '3' AND state = 'scheduled' AND last_error LIKE 'held: waiting for %'`)
		return published == total-held-1 && n == held, fmt.Errorf("%d published, want %d; %d rows of aggregate 3 held, want %d (every one after sequence 2)",
			published, total-held-1, n, held)
	})
	r.kill()
	r.start()
	info, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	cfg := info.CachedInfo().Config
	cfg.MaxMsgSize = 1 << 20
	if _, err := js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	if code, out, errOut := runCmd(t, nil, "redrive", "--database-url", dbURL, "--work-id", "o-3-2", "--reason", "limit raised"); code != 0 {
		t.Fatalf("redrive: %d %s %s", code, out, errOut)
	}
	testenv.WaitFor(t, 60*time.Second, "every row published", func() (bool, error) {
		return count(`SELECT count(*) FROM outbox WHERE state = 'published'`) == total, nil
	})
	last := map[string]int{}
	seen := map[string]bool{}
	for _, m := range readStream(t, js, stream) {
		id := m.header.Get(jetstream.MsgIDHeader)
		if seen[id] {
			t.Errorf("%s stored twice", id)
		}
		seen[id] = true
		agg := m.header.Get(wire.HeaderAggregateID)
		seq, err := strconv.Atoi(m.header.Get(wire.HeaderSequence))
		if err != nil {
			t.Fatalf("%s: %s: %v", id, wire.HeaderSequence, err)
		}
		if seq != last[agg]+1 {
			t.Errorf("aggregate %s: sequence %d stored after %d", agg, seq, last[agg])
		}
		last[agg] = seq
	}
	if len(seen) != total {
		t.Errorf("%d messages, want %d", len(seen), total)
	}
}
