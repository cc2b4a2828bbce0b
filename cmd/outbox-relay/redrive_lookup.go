package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// lookupResult is what redrive's stream lookup of its uncertain rows found.
type lookupResult struct {
	done         bool            // the lookup ran (a broker was given and reachable)
	complete     bool            // it read the rows' subjects to the stream's end within the bound
	found        map[string]bool // work IDs found stored (settled, or to be in a dry run)
	inconclusive []string        // uncertain rows neither found nor ruled out
}

// lookupUncertain looks redrive's uncertain rows up in the stream (G18):
// those the stream holds are settled as published with the sequence found
// instead of sent again, which past the duplicate window would store them
// twice. The read is on the rows' subjects, from the earliest of their
// last attempts (less poller.LookupSkew) on, at most limit messages; rows
// not found when the read stopped at that bound are inconclusive and left
// redriven (published again with their Nats-Msg-Id, as before the lookup).
func lookupUncertain(ctx context.Context, o *opFlags, st *store.Store, req store.OpRequest, changed []store.OpRow, limit int, stdout, stderr io.Writer) lookupResult {
	var rows []store.OpRow
	for _, c := range changed {
		if c.MayBeStored() {
			rows = append(rows, c)
		}
	}
	res := lookupResult{found: map[string]bool{}}
	if len(rows) == 0 {
		return res
	}
	scrub := app.NewNATSScrubber(o.natsURL, o.nats)
	nc, err := o.connectNATS("redrive")
	if err != nil {
		fmt.Fprintf(stderr, "could not look the %d uncertain rows up in the stream: %s\n", len(rows), termsafe.String(scrub.Err(err).Error()))
		return res
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		fmt.Fprintf(stderr, "could not look the %d uncertain rows up in the stream: JetStream: %s\n", len(rows), termsafe.String(scrub.Err(err).Error()))
		return res
	}
	sink := natssink.New(js, natssink.Options{Stream: o.stream, SubjectPrefix: o.subjectPrefix})
	want := make([]sinks.Wanted, 0, len(rows))
	var since time.Time
	from := sinks.From{BySeq: true}
	for i, c := range rows {
		subject := c.Subject
		if subject == "" {
			subject = o.subjectPrefix + c.Kind
		}
		want = append(want, sinks.Wanted{ID: c.WorkID, Subject: subject})
		// The attempt was at or after the row's available_at before the
		// redrive (store.OpRow.SinceLastAttempt).
		if t := c.AvailableAt.Add(-c.SinceLastAttempt - poller.LookupSkew); since.IsZero() || t.Before(since) {
			since = t
		}
		// A position where every row has one (claimed since migration
		// 0019): then no clock decides where the read starts.
		switch {
		case !c.HasLookupSeq:
			from.BySeq = false
		case i == 0 || c.LookupSeq < from.AfterSeq:
			from.AfterSeq = c.LookupSeq
		}
	}
	from.Since = since
	lctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	stored, complete, err := sink.FindStored(lctx, want, from, limit)
	if err != nil {
		fmt.Fprintf(stderr, "could not look the %d uncertain rows up in the stream: %s\n", len(rows), termsafe.String(scrub.Err(err).Error()))
		return res
	}
	res.done, res.complete = true, complete
	var items []store.Found
	for _, c := range rows {
		if s, ok := stored[c.WorkID]; ok {
			items = append(items, store.Found{WorkID: c.WorkID, Generation: c.PreviousGeneration, Stream: s.Stream, Seq: s.Seq})
		} else if !complete {
			res.inconclusive = append(res.inconclusive, c.WorkID)
		}
	}
	settled := map[string]bool{}
	if len(items) > 0 && !req.DryRun {
		ids, err := st.SettleFound(ctx, items)
		if err != nil {
			fmt.Fprintf(stderr, "found %d uncertain rows in the stream but could not settle them (the poller looks them up again before publishing): %v\n", len(items), err)
		}
		for _, id := range ids {
			settled[id] = true
		}
	}
	start := "since " + since.UTC().Format(time.RFC3339)
	if from.BySeq {
		start = fmt.Sprintf("after sequence %d", from.AfterSeq)
	}
	fmt.Fprintf(stdout, "looked %d uncertain rows up in stream %s (their subjects, %s, at most %d messages): %d found, %d not found, %d inconclusive\n",
		len(rows), termsafe.String(o.stream), start, limit, len(items), len(rows)-len(items)-len(res.inconclusive), len(res.inconclusive))
	for i, it := range items {
		if i == listed {
			fmt.Fprintf(stdout, "  ... and %d more found\n", len(items)-listed)
			break
		}
		res.found[it.WorkID] = true
		what := "settled as published, not sent again"
		switch {
		case req.DryRun:
			what = "would be settled as published, not sent again"
		case !settled[it.WorkID]:
			what = "claimed by the poller first, which looks it up itself before publishing"
		}
		fmt.Fprintf(stdout, "  found %s: stream %s sequence %d: %s\n", termsafe.String(it.WorkID), termsafe.String(it.Stream), it.Seq, what)
	}
	for _, it := range items[min(len(items), listed):] {
		res.found[it.WorkID] = true
	}
	if len(res.inconclusive) > 0 {
		fmt.Fprintf(stderr, "lookup inconclusive: the read stopped at --lookup-limit %d before the stream's end; %d rows not found in it are published again with their Nats-Msg-Id (a second copy if the broker stored them before the duplicate window): %s\n",
			limit, len(res.inconclusive), idList(res.inconclusive))
	}
	return res
}
