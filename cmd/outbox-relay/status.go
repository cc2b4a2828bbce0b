package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/config"
	"github.com/outbox-relay/outbox-relay/internal/replay"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	"github.com/outbox-relay/outbox-relay/replication"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

type statusReport struct {
	Table string `json:"table"`
	Slot  struct {
		Name         string `json:"name"`
		Exists       bool   `json:"exists"`
		Active       bool   `json:"active"`
		ActivePID    int32  `json:"active_pid,omitempty"`
		ConfirmedLSN string `json:"confirmed_lsn,omitempty"`
		LagBytes     int64  `json:"lag_bytes"`
		// LagSeconds estimates how far back, in time, a relay that restarted
		// now would replay (replay.Estimate); LagSource names the evidence
		// that gave it, and is empty when there was none.
		LagSeconds float64 `json:"lag_seconds"`
		LagSource  string  `json:"lag_seconds_source,omitempty"`
		WALStatus  string  `json:"wal_status,omitempty"`
		// InvalidationReason is PostgreSQL's reason when it invalidated
		// the slot (idle_timeout, wal_removed, ...).
		InvalidationReason string `json:"invalidation_reason,omitempty"`
		// Failover: a failover slot (PostgreSQL 17+) that standbys with
		// sync_replication_slots keep; Synced: this copy came from a former
		// primary.
		Failover bool `json:"failover"`
		Synced   bool `json:"synced"`
	} `json:"slot"`
	// Standbys are the --standby-slot standbys: how far behind each is, and
	// which names have no slot here (they hold nothing back).
	Standbys []replication.StandbyPosition `json:"standbys,omitempty"`
	store.Counts
	// Partitions is set for a partitioned table (migrate --partition-interval).
	Partitions *store.PartitionSummary `json:"partitions,omitempty"`
	// Stream is set when --nats-url is given; Stream.Error says why it
	// could not be read.
	Stream *streamReport `json:"stream,omitempty"`
	// DuplicateWindowSeconds is the stream's, or --duplicate-window when the
	// stream could not be read.
	DuplicateWindowSeconds float64  `json:"duplicate_window_seconds"`
	Warnings               []string `json:"warnings"`
}

type streamReport struct {
	Name                   string   `json:"name"`
	Error                  string   `json:"error,omitempty"`
	Messages               uint64   `json:"messages"`
	Bytes                  uint64   `json:"bytes"`
	FirstSeq               uint64   `json:"first_seq"`
	LastSeq                uint64   `json:"last_seq"`
	DuplicateWindowSeconds float64  `json:"duplicate_window_seconds"`
	Subjects               []string `json:"subjects"`
}

// readStream reads the stream's state and configuration. Any failure is
// reported in Error, not returned: status and redrive are still useful with
// the broker down. Error is printed, so it is scrubbed of the URL's
// credentials (nats.go's and net/url's errors can quote the URL).
func readStream(ctx context.Context, c *common, command string) streamReport {
	name := c.stream
	r := streamReport{Name: name}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	scrub := app.NewNATSScrubber(c.natsURL, c.nats)
	fail := func(what string, err error) streamReport {
		r.Error = what + ": " + scrub.Err(err).Error()
		return r
	}
	nc, err := c.connectNATS(command)
	if err != nil {
		// "cannot connect to NATS at ...", or a refused flag as it is.
		r.Error = strings.Replace(scrub.Err(err).Error(), "connect to NATS", "cannot connect to NATS", 1)
		return r
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail("JetStream", err)
	}
	s, err := js.Stream(ctx, name)
	if err != nil {
		return fail("cannot read stream", err)
	}
	info := s.CachedInfo()
	r.Messages, r.Bytes = info.State.Msgs, info.State.Bytes
	r.FirstSeq, r.LastSeq = info.State.FirstSeq, info.State.LastSeq
	r.DuplicateWindowSeconds = info.Config.Duplicates.Seconds()
	r.Subjects = info.Config.Subjects
	return r
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("status", "Prints the slot's lag (bytes, and seconds where PostgreSQL can tell), rows by state, the oldest eligible row's age,\n"+
		"failures by reason, the watermark of --on-publish none (ready rows it covers count as published) and, when --nats-url\n"+
		"is given, the stream; warns when a restart could replay past the duplicate window.", stderr)
	c.register(fs, withNATS(flagDatabaseURL, flagTable, flagSlot, flagStream)...)
	asJSON := fs.Bool("json", false, "print JSON for machines")
	dupWindow := fs.Duration("duplicate-window", natssink.DefaultDuplicateWindow, "the stream's duplicate window, for the replay warning when the stream is not read")
	var standbySlots config.List
	fs.Var(&standbySlots, "standby-slot", "the physical slots of the standbys run waits for (run --standby-slot): report their lag and names with no slot")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := app.ValidateStream(c.stream); err != nil {
		return err
	}
	// The observer pool: status is run by hand and by scripts against the
	// server the relay uses, so it gets the console's bounds (G16).
	st, closeDB, err := openObserverStore(ctx, &c, "outbox-relay status")
	if err != nil {
		return err
	}
	defer closeDB()
	pool, t := st.Pool(), st.Table()
	ev, err := replay.Read(ctx, pool, st, c.slot)
	if err != nil {
		return err
	}
	slot := ev.Slot
	var rep statusReport
	rep.Table = t.Qualified()
	rep.Slot.Name = c.slot
	rep.Slot.Exists, rep.Slot.Active, rep.Slot.ActivePID, rep.Slot.WALStatus = slot.Exists, slot.Active, slot.ActivePID, slot.WALStatus
	rep.Slot.LagBytes = ev.LagBytes
	rep.Slot.InvalidationReason = slot.InvalidationReason
	if slot.Exists {
		rep.Slot.ConfirmedLSN = slot.ConfirmedFlush.String()
	}
	idle, err := replication.IdleSlotTimeout(ctx, pool)
	if err != nil {
		return err
	}
	switch {
	case slot.Invalidated():
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("WARNING: slot %s was invalidated by PostgreSQL (wal_status %s, reason %q): the next `outbox-relay run` re-creates it and hands every row still ready to the poller (delivered, not in commit order)", c.slot, slot.WALStatus, slot.InvalidationReason))
	case slot.Exists && !slot.Active && idle > 0:
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("WARNING: slot %s is inactive and PostgreSQL invalidates a slot no one streams for %s (idle_replication_slot_timeout) at its next checkpoint; start a relay, or set the timeout to 0 or longer than a relay may be away (after an invalidation the relay re-creates the slot and hands the rows to the poller, not in commit order)", c.slot, idle))
	}
	if rep.Counts, err = st.Counts(ctx); err != nil {
		return err
	}
	if rep.Partitions, err = st.PartitionSummary(ctx); err != nil {
		return err
	}
	if p := rep.Partitions; p != nil && len(p.Detached) > 0 {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("WARNING: partitions of %s are out of the table: %s; their rows are not reachable through it and the relay holds its checkpoint at a row it cannot find: run `outbox-relay prune` as the table's owner (it attaches them back, or drops those with nothing to keep), or let the relay's partition keeper attach them back", t.Qualified(), strings.Join(p.Detached, ", ")))
	}
	if p := rep.Partitions; p != nil && p.DefaultRows > 0 {
		rep.Warnings = append(rep.Warnings, fmt.Sprintf("WARNING: the DEFAULT partition of %s holds about %d rows that found no partition of their own (was the relay stopped longer than the partitions made ahead?); prune never drops them (docs/partitions.md, \"Partition sizing\")", t.Qualified(), p.DefaultRows))
	}
	if slot.Exists {
		if rep.Slot.Failover, rep.Slot.Synced, err = replication.SlotFailover(ctx, pool, c.slot); err != nil {
			return err
		}
	}
	if len(standbySlots) > 0 {
		if rep.Standbys, err = replication.StandbyPositions(ctx, pool, standbySlots); err != nil {
			return err
		}
		for _, s := range rep.Standbys {
			if !s.Exists {
				rep.Warnings = append(rep.Warnings, fmt.Sprintf("WARNING: --standby-slot %s names no physical slot on this server: run holds nothing back for it (after a failover, name the new primary's standbys)", s.Slot))
			}
		}
	}
	window := *dupWindow
	if c.natsGiven(fs) {
		si := readStream(ctx, &c, "status")
		rep.Stream = &si
		if si.Error == "" {
			window = time.Duration(si.DuplicateWindowSeconds * float64(time.Second))
		}
	}
	rep.DuplicateWindowSeconds = window.Seconds()
	horizon := replay.Estimate(ev)
	rep.Slot.LagSeconds, rep.Slot.LagSource = horizon.Seconds, horizon.Source
	rep.Warnings = append(rep.Warnings, replay.Warnings(ev, horizon, window)...)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	fmt.Fprintf(stdout, "table      %s\n", rep.Table)
	if p := rep.Partitions; p != nil {
		fmt.Fprintf(stdout, "partitions %d by created_at every %s, the last ending %s; DEFAULT partition: ~%d rows\n",
			p.Partitions, time.Duration(p.IntervalSeconds*float64(time.Second)), p.LastEnd.UTC().Format(time.RFC3339), p.DefaultRows)
	}
	if !slot.Exists {
		fmt.Fprintf(stdout, "slot       %s: missing (created by `outbox-relay run`)\n", c.slot)
	} else {
		owner := "inactive"
		if slot.Active {
			owner = fmt.Sprintf("active (pid %d)", slot.ActivePID)
		}
		lag := ""
		if rep.Slot.LagSource != "" {
			lag = fmt.Sprintf(" (~%.1fs by %s)", rep.Slot.LagSeconds, rep.Slot.LagSource)
		}
		fmt.Fprintf(stdout, "slot       %s: %s, confirmed %s, lag %d bytes%s, wal_status %s\n",
			c.slot, owner, rep.Slot.ConfirmedLSN, rep.Slot.LagBytes, lag, slot.WALStatus)
	}
	if si := rep.Stream; si != nil {
		if si.Error != "" {
			fmt.Fprintf(stdout, "stream     %s: %s (duplicate window assumed %s)\n", si.Name, si.Error, window)
		} else {
			fmt.Fprintf(stdout, "stream     %s: %d messages, %d bytes, seq %d..%d, duplicate window %s, subjects %s\n",
				si.Name, si.Messages, si.Bytes, si.FirstSeq, si.LastSeq, window, strings.Join(si.Subjects, " "))
		}
	}
	fmt.Fprintf(stdout, "rows       ")
	for _, s := range store.States {
		// How exact each figure is: docs/operator-commands.md, "How exact the
		// counts are". ~ an estimate, + at least this many.
		n, mark := strconv.FormatInt(rep.ByState[s], 10), ""
		switch {
		case s == store.StatePublished && rep.PublishedEstimated && rep.ByState[s] < 0:
			n = "?"
		case s == store.StatePublished && rep.PublishedEstimated:
			mark = "~"
		case s == store.StateReady && rep.ReadyAtLeast:
			n += "+"
		}
		fmt.Fprintf(stdout, "%s=%s%s ", s, mark, n)
	}
	bound := ""
	if rep.ReadyAtLeast {
		// Only the newest rows are looked at for ready rows (G16): say so
		// where it shows.
		bound = fmt.Sprintf(" or more (ready rows in flight reach past the newest %d rows looked at)", store.RecentRows)
	}
	fmt.Fprintf(stdout, "\noldest eligible row: %.1fs%s\n", rep.OldestEligibleSeconds, bound)
	if w := rep.Watermark; w != nil {
		// --on-publish none (G17): published rows left as inserted count
		// as published once the watermark covers them.
		n := strconv.FormatInt(rep.PublishedByWatermark, 10)
		if rep.PublishedByWatermarkAtLeast {
			n += "+ (among the newest " + strconv.Itoa(store.RecentRows) + " rows)"
		}
		fmt.Fprintf(stdout, "watermark  %s of slot %s, recorded %s (%.1fs ago): published (watermark)=%s, ready rows it covers, without stream_seq; ready counts the rows in flight\n",
			w.LSN, termsafe.String(w.Slot), w.RecordedAt.UTC().Format(time.RFC3339), w.AgeSeconds, n)
	}
	if rep.Slot.Exists {
		fmt.Fprintf(stdout, "failover slot: %v (synced from a former primary: %v)\n", rep.Slot.Failover, rep.Slot.Synced)
	}
	for _, s := range rep.Standbys {
		if s.Exists {
			fmt.Fprintf(stdout, "standby    %s: connected %v, flushed %s, %d bytes behind\n", s.Slot, s.Active, s.Flushed, s.Lag)
		} else {
			fmt.Fprintf(stdout, "standby    %s: no such physical slot here\n", s.Slot)
		}
	}
	if len(rep.FailedByReason) > 0 {
		fmt.Fprintln(stdout, "failed by reason:")
		reasons := make([]string, 0, len(rep.FailedByReason))
		for r := range rep.FailedByReason {
			reasons = append(reasons, r)
		}
		sort.Strings(reasons)
		for _, r := range reasons {
			// r is read from last_error, which rows carry: escape it.
			fmt.Fprintf(stdout, "  %-40s %d\n", termsafe.String(r), rep.FailedByReason[r])
		}
	}
	if rep.BlockedAggregates > 0 || rep.BlockedAggregatesAtLeast {
		// Only so many held aggregates are looked at (G16): say so where
		// the count is a lower bound, as for ready rows.
		n, oldest := strconv.FormatInt(rep.BlockedAggregates, 10), "oldest"
		if rep.BlockedAggregatesAtLeast {
			n += fmt.Sprintf(" or more (only the first %d held aggregates are looked at)", rep.BlockedAggregatesLookedAt)
			oldest = "oldest of those"
		}
		fmt.Fprintf(stdout, "blocked aggregates: %s", n)
		if b := rep.OldestBlocked; b != nil {
			waiting := strconv.FormatInt(b.Waiting, 10)
			if b.WaitingAtLeast {
				waiting += "+"
			}
			// Aggregates and work IDs come from rows: escape them.
			// The aggregate prints quoted ("a/b"/"c"), which escapes it too.
			fmt.Fprintf(stdout, "; %s %s: %s rows wait behind %s (sequence %d, %s since %s)",
				oldest, b.Aggregate, waiting, termsafe.String(b.WorkID), b.Seq, b.State, b.Since.UTC().Format(time.RFC3339))
		}
		fmt.Fprintln(stdout)
	}
	for _, w := range rep.Warnings {
		fmt.Fprintln(stdout, w)
	}
	return nil
}
