package poller

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// DefaultLookupLimit bounds the messages one batch's stream lookup of its
// uncertain rows reads (Config.LookupLimit).
const DefaultLookupLimit = 10_000

// LookupSkew is taken off a lookup's start time: the database's clock
// (which dates the rows) and the broker's (which dates the messages) may
// disagree by that much.
const LookupSkew = 5 * time.Second

// uncertainSince is the earliest time c's last, uncertain attempt can have
// happened, and false when c's last attempt was not uncertain. A redrive
// records it (store.RedrivenUncertainSince); after a reschedule, the row
// became due at most the backoff's cap after it was rescheduled, which was
// at most a lease after the attempt.
func (p *Poller) uncertainSince(c store.Claimed) (time.Time, bool) {
	if strings.HasPrefix(c.LastError, store.LostNotePrefix) {
		// Handed back because the broker lost it (G19): the session start
		// that found the loss replays the slot from its confirmed position,
		// which can lie before the row, and the CDC path publishes what it
		// replays whatever the row's state. Past the duplicate window a
		// republish would store it twice; look from the hand-back on (the
		// check runs before that session's first publish).
		return c.AvailableAt.Add(-LookupSkew), true
	}
	if !strings.HasPrefix(c.LastError, "uncertain") {
		return time.Time{}, false
	}
	if t, ok := store.RedrivenUncertainSince(c.LastError); ok {
		return t.Add(-LookupSkew), true
	}
	return c.AvailableAt.Add(-p.cfg.BackoffMax - p.cfg.Lease - LookupSkew), true
}

// resolveUncertain looks the claimed rows whose last attempt was uncertain
// up in the stream before they are published again (G18): past the
// broker's duplicate window a republish of a message the broker did store
// is stored a second time. The rows found are returned as completions
// (published with the sequence found, not sent again); the rest are
// published as always. One lookup per batch, on the rows' subjects, from
// the earliest of their attempts on, reading at most LookupLimit messages:
// past that bound (or when the lookup fails) the rows not found are
// inconclusive and published with their Nats-Msg-Id as before, the
// broker's duplicate window the only guard left. A lookup that fails
// returns its error and nothing else: the caller gives the whole batch back
// unpublished (a row held back alone could let the rest of its aggregate
// overtake it), and the next claim looks again.
func (p *Poller) resolveUncertain(ctx context.Context, claimed []store.Claimed) (rest []store.Claimed, found []store.Completion, err error) {
	finder, ok := p.sink.(sinks.Finder)
	if !ok || p.cfg.LookupLimit < 0 {
		return claimed, nil, nil
	}
	var want []sinks.Wanted
	var since time.Time
	extra := make(map[string]string, 2)
	for _, c := range claimed {
		t, uncertain := p.uncertainSince(c)
		if !uncertain {
			continue
		}
		msg, err := p.message(c, extra)
		if err != nil {
			continue // refused when published: nothing to find
		}
		want = append(want, sinks.Wanted{ID: c.WorkID, Subject: msg.Subject})
		if since.IsZero() || t.Before(since) {
			since = t
		}
	}
	if len(want) == 0 {
		return claimed, nil, nil
	}
	limit := p.cfg.LookupLimit
	if limit == 0 {
		limit = DefaultLookupLimit
	}
	started := time.Now()
	stored, complete, err := finder.FindStored(ctx, want, since, limit)
	if err != nil {
		p.m.UncertainResolved.WithLabelValues("lookup_failed").Add(float64(len(want)))
		return nil, nil, fmt.Errorf("look %d uncertain rows up in the stream: %w", len(want), err)
	}
	rest = make([]store.Claimed, 0, len(claimed))
	for _, c := range claimed {
		if s, ok := stored[c.WorkID]; ok {
			found = append(found, store.Completion{WorkID: c.WorkID, Generation: c.ClaimGeneration, Seq: s.Seq, Stream: s.Stream,
				Note: store.FoundNote(s.Stream, s.Seq)})
			continue
		}
		rest = append(rest, c)
	}
	notFound := len(want) - len(found)
	p.m.UncertainResolved.WithLabelValues("found").Add(float64(len(found)))
	outcome := "not_found"
	if !complete {
		outcome = "inconclusive"
	}
	p.m.UncertainResolved.WithLabelValues(outcome).Add(float64(notFound))
	ev := p.log.Info()
	if !complete && notFound > 0 {
		ev = p.log.Warn()
	}
	ev.Int("rows", len(want)).Int("found", len(found)).Int(outcome, notFound).Time("since", since).Int("limit", limit).
		Dur("took", time.Since(started)).
		Msg("looked uncertain rows up in the stream before publishing them again: found ones are settled as published; the others are published (inconclusive: the lookup hit its bound, repeats are left to the duplicate window)")
	return rest, found, nil
}
