package relay_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// G13 and G21 on the database's clock (issue 42, item 2). The CDC path
// compared expires_at with the relay's clock and counted Nats-TTL from it:
// with PostgreSQL 60 s ahead of the relay, a row 5 s past its deadline on
// the database's clock was published (with Nats-TTL 55s); 60 s behind, a
// message valid 30 s more got Nats-TTL 1s and the stream removed it a
// second later. PostgreSQL runs on a clock shifted by libfaketime; the
// relay and nats-server share this host's.
func TestDeadlinesOnTheDatabaseClock(t *testing.T) {
	// Its own PostgreSQL (and slot): it may run beside the others.
	t.Parallel()
	start := func(t *testing.T, offset time.Duration) *harness {
		t.Helper()
		h := shiftedHarness(t, offset)
		h.opts.DeadlineTTL = true
		h.start()
		return h
	}

	t.Run("database ahead", func(t *testing.T) {
		h := start(t, 60*time.Second)
		h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES
			('past', 'k', '{}', clock_timestamp() - interval '5 seconds'),
			('plain', 'k', '{}', NULL)`)
		testenv.WaitFor(t, 30*time.Second, "plain published and past expired", func() (bool, error) {
			return h.row("plain").state == "published" && h.row("past").state == "expired", nil
		})
		h.stop()
		if byID, _ := h.streamMsgs(); byID["past"] != nil {
			t.Fatalf("past, 5 s past its deadline on the database's clock, was published (Nats-TTL %q)", byID["past"].Header.Get(wire.HeaderTTL))
		}
	})

	t.Run("database behind", func(t *testing.T) {
		h := start(t, -60*time.Second)
		h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES ('valid', 'k', '{}', clock_timestamp() + interval '30 seconds')`)
		waitStored(t, h, "valid")
		h.stop()
		byID, _ := h.streamMsgs()
		if byID["valid"] == nil {
			t.Fatal("valid is no longer in the stream: its Nats-TTL removed it before its deadline")
		}
		ttl := byID["valid"].Header.Get(wire.HeaderTTL)
		secs, err := strconv.Atoi(strings.TrimSuffix(ttl, "s"))
		if err != nil || secs < 25 || secs > 32 {
			t.Fatalf("valid, 30 s before its deadline on the database's clock, carries Nats-TTL %q, want 25 to 32 s", ttl)
		}
	})
}

// Deadlines far ahead (issue 42, item 1): a Nats-TTL past about 292 years
// is refused by nats-server (error 10165, time.ParseDuration's range), and
// the relay took the refusal for an outage: the session ended and replayed
// the same row, 8 sessions in 20 s, every later row held behind it. A
// message whose deadline is more than natssink.MaxTTL ahead now carries no
// Nats-TTL (Outbox-Expires-At still says the deadline), on both paths, and
// the ordinary rows behind it go at once.
func TestFarDeadlinesNeverStopTheStream(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	parallel(t, h)
	h.opts.DeadlineTTL = true
	h.start()
	far := []string{"2200-01-01", "2400-01-01", "9999-12-31"}
	for i, d := range far {
		h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES ($1, 'k', '{}', $2::timestamptz)`, "cdc-far-"+strconv.Itoa(i), d)
		h.exec(`INSERT INTO outbox (work_id, kind, payload, state, expires_at) VALUES ($1, 'k', '{}', 'scheduled', $2::timestamptz)`, "poller-far-"+strconv.Itoa(i), d)
	}
	ordinary := h.insertRows("ordinary", 5, 1)
	testenv.WaitFor(t, 30*time.Second, "every row published", func() (bool, error) {
		return h.countState("published") == len(ordinary)+2*len(far), nil
	})
	h.stop()
	byID, counts := h.streamMsgs()
	for _, id := range ordinary {
		if counts[id] != 1 {
			t.Errorf("%s stored %d times, want 1", id, counts[id])
		}
	}
	for i := range far {
		for _, id := range []string{"cdc-far-" + strconv.Itoa(i), "poller-far-" + strconv.Itoa(i)} {
			m := byID[id]
			switch {
			case m == nil:
				t.Errorf("%s (deadline %s) not in the stream", id, far[i])
			case m.Header.Get(wire.HeaderTTL) != "":
				t.Errorf("%s (deadline %s) carries Nats-TTL %q, want none past %s", id, far[i], m.Header.Get(wire.HeaderTTL), "MaxTTL")
			case m.Header.Get(wire.HeaderExpiresAt) == "":
				t.Errorf("%s (deadline %s) carries no %s", id, far[i], wire.HeaderExpiresAt)
			}
		}
	}
}

// failingRow is the relay's sink with one work ID's publishes failing in a
// way the sink does not recognise.
type failingRow struct {
	*natssink.Sink
	id    string
	tries *atomic.Int32
}

func (s *failingRow) Publish(ctx context.Context, m *wire.Message) (sinks.Future, error) {
	if m.ID == s.id {
		s.tries.Add(1)
		return nil, fmt.Errorf("%w: test failure", sinks.ErrUnrecognised)
	}
	return s.Sink.Publish(ctx, m)
}

// G7 for a failure the relay does not recognise (issue 42, item 1): it
// ends the session like an outage, and the next session meets the same
// row first. Without a bound that was an endless replay, every row behind
// it held. The third such failure of one row is its refusal: it goes to
// the poller with its reason, and the rows behind it are published.
func TestUnrecognisedFailureOfOneRowEndsAsItsRefusal(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	parallel(t, h)
	var tries atomic.Int32
	h.opts.CDCSink = func(s *natssink.Sink) sinks.Sink { return &failingRow{Sink: s, id: "odd", tries: &tries} }
	h.opts.MaxAttempts = 1
	h.start()
	h.exec(`INSERT INTO outbox (work_id, kind, payload) VALUES ('odd', 'k', '{}')`)
	behind := h.insertRows("behind", 5, 1)
	testenv.WaitFor(t, 60*time.Second, "the rows behind published, odd handed to the poller as refused", func() (bool, error) {
		r := h.row("odd")
		return h.countState("published") >= len(behind) && r.state != "ready" && strings.Contains(r.lastError, "rejected: refused"), nil
	})
	h.stop()
	if got := tries.Load(); got != 3 {
		t.Errorf("odd was tried %d times on the CDC path, want 3 before its refusal", got)
	}
	_, counts := h.streamMsgs()
	for _, id := range behind {
		if counts[id] != 1 {
			t.Errorf("%s stored %d times, want 1", id, counts[id])
		}
	}
}

// A row's deadline is asked again when it is published, not only when it
// is read (G13): a row waiting for room in flight (behind a broker that
// answers late) was published past its deadline (the chaos run's
// broker-slow: 28 rows stored 74 to 83 ms past it). Here the in-flight
// window is full of acks held back while the row's deadline comes within
// --deadline-margin: it is never published, and ends expired.
func TestDeadlineAskedAgainAtPublish(t *testing.T) {
	h := newHarness(t, sharedSetup(t))
	parallel(t, h)
	open := make(chan struct{})
	h.opts.CDCSink = func(s *natssink.Sink) sinks.Sink { return &gatedAcks{Sink: s, open: open} }
	h.opts.MaxInFlight = 2
	h.start()
	front := h.insertRows("front", 2, 2)
	h.exec(`INSERT INTO outbox (work_id, kind, payload, expires_at) VALUES ('late', 'k', '{}', clock_timestamp() + interval '2500 milliseconds')`)
	testenv.WaitFor(t, 10*time.Second, "the front rows stored", func() (bool, error) {
		return h.streamCount() == 2, nil
	})
	time.Sleep(2 * time.Second) // late's deadline comes within the 1 s margin
	close(open)
	testenv.WaitFor(t, 30*time.Second, "late expired and the front rows published", func() (bool, error) {
		return h.row("late").state == "expired" && h.countState("published") == len(front), nil
	})
	h.stop()
	if byID, _ := h.streamMsgs(); byID["late"] != nil {
		t.Fatal("late was published after it waited past --deadline-margin of its deadline")
	}
}
