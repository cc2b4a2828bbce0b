package poller

import (
	"context"
	"fmt"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/sinks"
)

// DefaultLookupLimit bounds the messages one batch's stream lookup of its
// uncertain rows reads (Config.LookupLimit).
const DefaultLookupLimit = 10_000

// LookupSkew is taken off a lookup's start time where no position is
// known (rows claimed before migration 0019, or when the broker did not
// say where its stream stood): the database's clock (which dates the rows)
// and the broker's (which dates the messages) may disagree by that much.
const LookupSkew = 5 * time.Second

// positionAge is how old the sink's idea of where the own stream stands
// may be when a claim records it as the rows' lookup_seq: older, it asks
// the broker (once per this interval while idle). Any older position is
// still below every later publish, only further back to read from, unless
// the broker lost its newest messages in between (G19).
const positionAge = 5 * time.Second

// streamPosition is a sequence of the own stream that every message
// published after it returns is stored after, for a claim to record as
// its rows' lookup_seq; false when the sink cannot say.
func (p *Poller) streamPosition(ctx context.Context) (uint64, bool) {
	pos, ok := p.sink.(sinks.Positioner)
	if !ok || p.cfg.LookupLimit < 0 {
		return 0, false
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return pos.StreamPosition(ctx, positionAge)
}

// lookupFrom says whether c may be stored already by an earlier attempt
// the table does not know the outcome of, and where a lookup of it starts.
// A row with a lookup_seq from before this claim was claimed before: that
// claim may have published it (its lease expired after the publish, its
// ack never came, the broker lost it, an operator redrove it), unless the
// broker refused its last attempt on a claim that was not a reclaim (a
// known non-effect). Rows from before migration 0019 carry the evidence
// in last_error only, and are looked up by time.
func (p *Poller) lookupFrom(c store.Claimed) (from sinks.From, ok bool) {
	if c.HasLookupSeq {
		if store.ClassRejected.Of(c.LastError) && !c.Reclaimed {
			return sinks.From{}, false
		}
		return sinks.From{AfterSeq: c.LookupSeq, BySeq: true}, true
	}
	if t, ok := p.uncertainSince(c); ok {
		return sinks.From{Since: t}, true
	}
	if c.Reclaimed {
		// Its earlier claim was made after it became due.
		return sinks.From{Since: c.AvailableAt.Add(-LookupSkew)}, true
	}
	return sinks.From{}, false
}

// uncertainSince is the earliest time c's last, uncertain attempt can have
// happened, and false when c's last attempt was not uncertain (the
// fallback by time). A redrive records it
// (store.RedrivenUncertainSince); after a reschedule, the row became due at
// most the backoff's cap after it was rescheduled, which was at most a
// lease after the attempt.
func (p *Poller) uncertainSince(c store.Claimed) (time.Time, bool) {
	if store.ClassLost.Of(c.LastError) {
		// Handed back because the broker lost it (G19): the session start
		// that found the loss replays the slot from its confirmed position,
		// which can lie before the row, and the CDC path publishes what it
		// replays whatever the row's state. Past the duplicate window a
		// republish would store it twice; look from the hand-back on (the
		// check runs before that session's first publish).
		return c.AvailableAt.Add(-LookupSkew), true
	}
	if !store.ClassUncertain.Of(c.LastError) {
		return time.Time{}, false
	}
	if t, ok := store.RedrivenUncertainSince(c.LastError); ok {
		return t.Add(-LookupSkew), true
	}
	return c.AvailableAt.Add(-p.cfg.BackoffMax - p.cfg.Lease - LookupSkew), true
}

// resolveUncertain looks the claimed rows an earlier attempt may have
// stored (lookupFrom) up in the stream before they are published again
// (G18): past the broker's duplicate window a republish of a message the
// broker did store is stored a second time. The rows found are returned as
// completions (published with the sequence found, not sent again); the
// rest are published as always. One lookup per batch, on the rows' subjects,
// from the lowest of their positions (on the own stream; by time on
// another, or for rows that have none) to the stream's last message when
// the lookup began, reading at most LookupLimit messages: past that bound
// the rows not found are inconclusive and published with their Nats-Msg-Id
// as before, the broker's duplicate window the only guard left. A lookup
// that fails, or that the broker does not answer up to its end, returns its
// error and nothing else: the caller gives the whole batch back
// unpublished (a row held back alone could let the rest of its aggregate
// overtake it), and the next claim looks again.
func (p *Poller) resolveUncertain(ctx context.Context, claimed []store.Claimed) (rest []store.Claimed, found []store.Completion, err error) {
	finder, ok := p.sink.(sinks.Finder)
	if !ok || p.cfg.LookupLimit < 0 {
		return claimed, nil, nil
	}
	var want []sinks.Wanted
	from := sinks.From{BySeq: true}
	first, byTime := true, false
	extra := make(map[string]string, 2)
	for _, c := range claimed {
		f, look := p.lookupFrom(c)
		if !look {
			continue
		}
		msg, err := p.message(c, extra)
		if err != nil {
			continue // refused when published: nothing to find
		}
		want = append(want, sinks.Wanted{ID: c.WorkID, Subject: msg.Subject})
		if f.BySeq {
			if first || f.AfterSeq < from.AfterSeq {
				from.AfterSeq = f.AfterSeq
			}
			first = false
			// Another stream has no position: read it from the row's
			// earliest possible attempt, its available_at before the claim.
			f.Since = c.AvailableAt.Add(-p.cfg.BackoffMax - p.cfg.Lease - LookupSkew)
		} else {
			byTime = true
		}
		if from.Since.IsZero() || f.Since.Before(from.Since) {
			from.Since = f.Since
		}
	}
	if len(want) == 0 {
		return claimed, nil, nil
	}
	if byTime {
		// A row without a position: the own stream too is read by time.
		from.BySeq = false
	}
	limit := p.cfg.LookupLimit
	if limit == 0 {
		limit = DefaultLookupLimit
	}
	started := time.Now()
	stored, complete, err := finder.FindStored(ctx, want, from, limit)
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
	if from.BySeq {
		ev = ev.Uint64("after_seq", from.AfterSeq)
	} else {
		ev = ev.Time("since", from.Since)
	}
	ev.Int("rows", len(want)).Int("found", len(found)).Int(outcome, notFound).Int("limit", limit).
		Dur("took", time.Since(started)).
		Msg("looked rows an earlier attempt may have stored up in the stream before publishing them again: found ones are settled as published; the others are published (inconclusive: the lookup hit its bound, repeats are left to the duplicate window)")
	return rest, found, nil
}
