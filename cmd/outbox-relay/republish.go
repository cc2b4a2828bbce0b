package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	"github.com/outbox-relay/outbox-relay/internal/wire"
	"github.com/outbox-relay/outbox-relay/sinks"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// DefaultRepublishLimit bounds the rows one republish reads: a run past it
// says where it stopped, and the next one goes on from there.
const DefaultRepublishLimit = 10_000

// DefaultRepublishLookupLimit bounds the messages its stream lookup reads:
// the rows' subjects from the oldest row's creation on carry every message
// published since, the rows' own and the rest.
const DefaultRepublishLookupLimit = 100_000

// republishInFlight is how many republished messages wait for their acks
// at once.
const republishInFlight = 256

// runRepublish is the repair of G19 under --on-publish none (and mark): the
// broker acknowledged messages and then lost them, the rows say published,
// and nothing else publishes them again. It reads the published rows created
// since --since, looks each one's message up in the stream, and publishes
// again exactly those the stream does not hold, in the poller's format with
// the same Nats-Msg-Id. A row the lookup could not rule out (it stopped at
// --lookup-limit) is not republished without --force: past the broker's
// duplicate window a message it does hold would be stored twice.
func runRepublish(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("republish", `After the broker lost messages it had acknowledged (G19: the relay logs "the broker lost messages"
and counts outbox_relay_broker_lost_total): publishes again the rows created since --since that are
published (under --on-publish none: covered by the watermark) and whose message the stream does not hold,
with the same Nats-Msg-Id. A message found in the stream is left as it is. Under --on-publish delete the
rows are gone from the table and nothing can be republished from it.

  outbox-relay republish --on-publish none --since 30m --dry-run
  outbox-relay republish --on-publish none --since 2026-12-02T17:00:00Z`, stderr)
	c.register(fs, withNATS(flagDatabaseURL, flagTable, flagStream, flagSubjectPrefix, flagOnPublish, flagMessageFormat, flagCloudEventsSource)...)
	since := fs.String("since", "", "rows created at or after this time (required): RFC3339 (2026-12-02T17:00:00Z) or an age (30m, 2h, 1d); the relay's error log names one")
	limit := fs.Int("limit", DefaultRepublishLimit, "read at most this many rows, oldest first, through the index on created_at; a run that stops there says the --since to go on with")
	lookupLimit := fs.Int("lookup-limit", DefaultRepublishLookupLimit, "messages the stream lookup reads at most, on the rows' subjects from the oldest row's creation on; rows not found when it stops there are not checked (not republished without --force)")
	force := fs.Bool("force", false, "republish the rows not checked too (the lookup stopped at --lookup-limit): the broker's duplicate window is then the only guard against storing one twice")
	dryRun := fs.Bool("dry-run", false, "look the rows up and print what would be published; publish nothing")
	var allowStreams config.List
	fs.Var(&allowStreams, "allow-stream", "as run --allow-stream: a further stream a row's subject column may name")
	deadlineTTL := fs.Bool("deadline-ttl", true, "as run --deadline-ttl: a republished row with expires_at carries Nats-TTL where its stream allows it")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *since == "" {
		return errors.New("--since is required: the time the broker's loss reaches back to (the relay's error log names one), e.g. --since 30m")
	}
	sinceT, sinceAgo, err := parseSince(*since)
	if err != nil {
		return err
	}
	if *limit < 1 {
		return fmt.Errorf("--limit %d: must be 1 or more", *limit)
	}
	if *lookupLimit < 1 {
		return fmt.Errorf("--lookup-limit %d: must be 1 or more", *lookupLimit)
	}
	if err := app.ValidateStream(c.stream); err != nil {
		return err
	}
	policy, err := store.ParsePolicy(c.onPublish)
	if err != nil {
		return err
	}
	if policy == store.PolicyDelete {
		return fmt.Errorf("--on-publish delete: the relay deletes each row once the broker acknowledged it, so the rows whose messages the broker lost are no longer in %s and cannot be republished from it; republish them from their source (the producer, a backup of the table). Give --on-publish as the relay runs with", termsafe.String(c.table))
	}
	if c.natsURL == "" {
		return errors.New("--nats-url is empty: republish looks each row up in the stream and publishes to it")
	}
	table, err := store.ParseTable(c.table)
	if err != nil {
		return err
	}
	// The format run publishes in: a republished message is the one the
	// broker lost, byte for byte where the format is the same.
	format, err := c.format(table)
	if err != nil {
		return err
	}

	st, closeDB, err := openStore(ctx, &c)
	if err != nil {
		return err
	}
	defer closeDB()
	read, err := st.PublishedSince(ctx, sinceT, sinceAgo, *limit)
	if err != nil {
		return err
	}
	what := "created " + describeSince(sinceT, sinceAgo)
	fmt.Fprintf(stdout, "read %d rows %s in %s: %d published (%s)\n", read.Read, what, termsafe.String(st.Table().Qualified()), len(read.Rows), publishedMeans(policy))
	if read.Read == *limit {
		fmt.Fprintf(stdout, "stopped at --limit %d: rows created at or after %s were not read; run again with --since %s\n",
			*limit, read.Next.UTC().Format(time.RFC3339Nano), read.Next.UTC().Format(time.RFC3339Nano))
	}

	// The poller's rule (G13): a row this close to its deadline, or past it,
	// is not published.
	cutoff := time.Now().Add(poller.DefaultDeadlineMargin)
	var rows []store.PublishedRow
	var expired []string
	for _, r := range read.Rows {
		if !r.ExpiresAt.IsZero() && !r.ExpiresAt.After(cutoff) {
			expired = append(expired, r.WorkID)
			continue
		}
		rows = append(rows, r)
	}
	if len(expired) > 0 {
		fmt.Fprintf(stdout, "not looked up: %d rows past or within %s of their deadline (expires_at), not published again (G13): %s\n",
			len(expired), poller.DefaultDeadlineMargin, idList(expired))
	}
	if len(rows) == 0 {
		fmt.Fprintln(stdout, "checked 0, found stored 0, republished 0, not checked 0")
		return nil
	}

	// A row whose message cannot be built (changed since it was published,
	// or written past the table's checks) is named and left out; the others
	// are still repaired.
	msgs := make([]*wire.Message, 0, len(rows))
	extra := make(map[string]string, 2)
	want := make([]sinks.Wanted, 0, len(rows))
	var unbuildable []string
	kept := rows[:0]
	for _, r := range rows {
		m, err := poller.Message(r.Claimed, format, extra)
		if err != nil {
			unbuildable = append(unbuildable, r.WorkID)
			fmt.Fprintf(stderr, "not published: row %s: its message cannot be built (%s); fix the row, or leave it to its producer\n", termsafe.String(r.WorkID), termsafe.String(err.Error()))
			continue
		}
		kept = append(kept, r)
		msgs = append(msgs, m)
		want = append(want, sinks.Wanted{ID: r.WorkID, Subject: m.Subject})
	}
	rows = kept
	if len(rows) == 0 {
		fmt.Fprintln(stdout, "checked 0, found stored 0, republished 0, not checked 0")
		return unbuildableErr(unbuildable)
	}
	from := rows[0].CreatedAt
	for _, r := range rows {
		if r.CreatedAt.Before(from) {
			from = r.CreatedAt
		}
	}
	// A message is stored after its row was created, by the broker's clock.
	from = from.Add(-poller.LookupSkew)

	scrub := app.NewNATSScrubber(c.natsURL, c.nats)
	nc, err := c.connectNATS("republish")
	if err != nil {
		return fmt.Errorf("%s (check --nats-url and the --nats-* credentials)", termsafe.String(scrub.Err(err).Error()))
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("JetStream at %s: %s", app.RedactNATSURLs(c.natsURL), termsafe.String(scrub.Err(err).Error()))
	}
	sink := natssink.New(js, natssink.Options{Stream: c.stream, SubjectPrefix: c.subjectPrefix, AllowStreams: allowStreams, DeadlineTTL: *deadlineTTL})
	lctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	// By time: the operator's --since names rows, not a position, and the
	// messages lost left no position behind. The read still ends at the
	// stream's last sequence, never at a late answer.
	stored, complete, err := sink.FindStored(lctx, want, sinks.From{Since: from}, *lookupLimit)
	cancel()
	if err != nil {
		return fmt.Errorf("look the %d rows up in stream %s (nothing was published): %s", len(rows), termsafe.String(c.stream), termsafe.String(scrub.Err(err).Error()))
	}
	var missing, unchecked []int
	var foundIDs []string
	for i, r := range rows {
		switch _, ok := stored[r.WorkID]; {
		case ok:
			foundIDs = append(foundIDs, r.WorkID)
		case complete:
			missing = append(missing, i)
		default:
			unchecked = append(unchecked, i)
		}
	}
	fmt.Fprintf(stdout, "looked %d rows up in stream %s (their subjects, since %s, at most %d messages): %d found stored, %d not in the stream, %d not checked\n",
		len(rows), termsafe.String(c.stream), from.UTC().Format(time.RFC3339), *lookupLimit, len(foundIDs), len(missing), len(unchecked))
	if len(foundIDs) > 0 {
		fmt.Fprintf(stdout, "found stored, left as they are: %s\n", idList(foundIDs))
	}
	send := missing
	if len(unchecked) > 0 {
		ids := make([]string, len(unchecked))
		for i, j := range unchecked {
			ids[i] = rows[j].WorkID
		}
		if *force {
			fmt.Fprintf(stderr, "WARNING: --force: %d rows not checked (the lookup stopped at --lookup-limit %d) are published again too; the broker's duplicate window is the only guard: one it does hold, stored before that window, is stored a second time: %s\n",
				len(ids), *lookupLimit, idList(ids))
			send = append(send, unchecked...)
		} else {
			fmt.Fprintf(stderr, "not checked, not published: %d rows the lookup did not reach (it stopped at --lookup-limit %d, or a row's subject is on a stream not allowed): raise --lookup-limit, narrow --since, or pass --force: %s\n",
				len(ids), *lookupLimit, idList(ids))
		}
	}
	slices.Sort(send)
	sendIDs := make([]string, len(send))
	for i, j := range send {
		sendIDs[i] = rows[j].WorkID
	}
	if *dryRun {
		fmt.Fprintf(stdout, "dry run, nothing published: would republish %d rows: %s\n", len(send), idList(sendIDs))
		fmt.Fprintf(stdout, "checked %d, found stored %d, would republish %d, not checked %d\n", len(rows)-len(unchecked), len(foundIDs), len(send), len(unchecked))
		return errors.Join(uncheckedErr(unchecked, *force), unbuildableErr(unbuildable))
	}

	var done []string
	var record []store.Republished
	var failed []string
	var firstErr error
	dups := 0
	for start := 0; start < len(send); start += republishInFlight {
		batch := send[start:min(start+republishInFlight, len(send))]
		futs := make([]sinks.Future, len(batch))
		for k, j := range batch {
			// Published one after another on one connection, and stored
			// in that order: the rows' creation order.
			f, err := sink.Publish(ctx, msgs[j])
			if err != nil {
				failed = append(failed, rows[j].WorkID)
				firstErr = cmpErr(firstErr, err)
				continue
			}
			futs[k] = f
		}
		for k, j := range batch {
			if futs[k] == nil {
				continue
			}
			ack, err := futs[k].Wait(ctx)
			if err != nil {
				failed = append(failed, rows[j].WorkID)
				firstErr = cmpErr(firstErr, err)
				continue
			}
			if ack.Duplicate {
				dups++
			}
			done = append(done, rows[j].WorkID)
			if rows[j].State == store.StatePublished && rows[j].Seq != 0 {
				record = append(record, store.Republished{WorkID: rows[j].WorkID, LostSeq: rows[j].Seq, Stream: ack.Stream, Seq: ack.Sequence})
			}
		}
	}
	fmt.Fprintf(stdout, "republished %d rows: %s\n", len(done), idList(done))
	if dups > 0 {
		fmt.Fprintf(stdout, "of them, %d the broker answered as duplicates (it held a message with that Nats-Msg-Id within its duplicate window): stored once\n", dups)
	}
	if len(record) > 0 {
		ids, err := st.RecordRepublished(ctx, record)
		if err != nil {
			fmt.Fprintf(stderr, "republished, but could not record the new sequences on the rows (the relay's check may hand them to the poller, which publishes them with the same Nats-Msg-Id): %v\n", err)
		} else if len(ids) < len(record) {
			fmt.Fprintf(stdout, "recorded the new sequence on %d of %d published rows (the rest changed meanwhile)\n", len(ids), len(record))
		}
	}
	fmt.Fprintf(stdout, "checked %d, found stored %d, republished %d, not checked %d\n", len(rows)-len(unchecked), len(foundIDs), len(done), len(unchecked))
	if len(failed) > 0 {
		return errors.Join(fmt.Errorf("could not republish %d rows (%s): %s; the rest are stored; run the same command again once the broker takes them (a row stored meanwhile is found and left alone)",
			len(failed), idList(failed), termsafe.String(scrub.Err(firstErr).Error())), unbuildableErr(unbuildable))
	}
	return errors.Join(uncheckedErr(unchecked, *force), unbuildableErr(unbuildable))
}

// unbuildableErr makes rows left out because their message cannot be built
// an exit status.
func unbuildableErr(ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	return fmt.Errorf("%d rows not published, their message cannot be built (listed above): %s", len(ids), idList(ids))
}

// uncheckedErr makes rows left not checked an exit status: a script that
// asked for the repair must learn it is not complete.
func uncheckedErr(unchecked []int, force bool) error {
	if len(unchecked) == 0 || force {
		return nil
	}
	return fmt.Errorf("%d rows not checked and not republished (listed above): raise --lookup-limit, narrow --since, or pass --force", len(unchecked))
}

func cmpErr(first, err error) error {
	if first != nil {
		return first
	}
	return err
}

func describeSince(t time.Time, ago time.Duration) string {
	if ago != 0 {
		return "in the last " + ago.String()
	}
	return "since " + t.UTC().Format(time.RFC3339Nano)
}

func publishedMeans(p store.Policy) string {
	if p == store.PolicyNone {
		return "ready rows the watermark covers, and rows in state published"
	}
	return "rows in state published"
}
