package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outbox-relay/outbox-relay/internal/app"
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
		// now would replay: the largest of the walsender's flush_lag (the
		// slot is streamed), the time since the slot went inactive (PostgreSQL
		// 17+, while it holds unconfirmed WAL) and the age of the oldest ready
		// row. LagSource names the one that gave it.
		LagSeconds float64 `json:"lag_seconds"`
		LagSource  string  `json:"lag_seconds_source,omitempty"`
		WALStatus  string  `json:"wal_status,omitempty"`
	} `json:"slot"`
	store.Counts
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
func readStream(ctx context.Context, url, name string) streamReport {
	r := streamReport{Name: name}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	scrub := app.NewNATSScrubber(url, app.NATSAuth{})
	fail := func(what string, err error) streamReport {
		r.Error = what + ": " + scrub.Err(err).Error()
		return r
	}
	nc, err := nats.Connect(url, nats.Name("outbox-relay status"), nats.Timeout(3*time.Second), nats.MaxReconnects(0),
		// Not the default handler: it prints to stderr unscrubbed.
		nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	if err != nil {
		return fail("cannot connect to NATS at "+app.RedactNATSURLs(url), err)
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

// replicationLagSeconds is the walsender's flush_lag for the slot's active
// pid: the time between PostgreSQL writing WAL and the relay confirming it.
// ok is false when PostgreSQL has no figure (no walsender, or caught up and
// idle long enough that it cleared it).
func replicationLagSeconds(ctx context.Context, pool *pgxpool.Pool, pid int32) (secs float64, ok bool, err error) {
	var lag *float64
	err = pool.QueryRow(ctx, `SELECT extract(epoch FROM flush_lag)::float8 FROM pg_catalog.pg_stat_replication WHERE pid = $1`, pid).Scan(&lag)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read replication lag of pid %d: %w", pid, err)
	}
	if lag == nil {
		return 0, false, nil
	}
	return *lag, true, nil
}

// inactiveSeconds is how long the slot has had no walsender, from
// pg_replication_slots.inactive_since (PostgreSQL 17+; read through to_jsonb
// so older servers, which lack the column, answer "unknown" instead of
// failing).
func inactiveSeconds(ctx context.Context, pool *pgxpool.Pool, slot string) (secs float64, ok bool, err error) {
	var s *float64
	err = pool.QueryRow(ctx, `SELECT extract(epoch FROM clock_timestamp() - (to_jsonb(s) ->> 'inactive_since')::timestamptz)::float8
		FROM pg_catalog.pg_replication_slots s WHERE slot_name = $1`, slot).Scan(&s)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, fmt.Errorf("read inactive_since of slot %s: %w", slot, err)
	}
	if s == nil {
		return 0, false, nil
	}
	return *s, true, nil
}

func runStatus(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("status", "Prints the slot's lag (bytes, and seconds where PostgreSQL can tell), rows by state, the oldest eligible row's age,\nfailures by reason and, with --nats-url, the stream; warns when a restart could replay past the duplicate window.", stderr)
	c.register(fs, false)
	asJSON := fs.Bool("json", false, "print JSON for machines")
	fs.StringVar(&c.natsURL, "nats-url", "", "NATS URL: also print the stream's messages, bytes, duplicate window and subjects (empty: skip)")
	fs.StringVar(&c.stream, "stream", "OUTBOX", "JetStream stream the relay publishes to")
	dupWindow := fs.Duration("duplicate-window", natssink.DefaultDuplicateWindow, "the stream's duplicate window, for the replay warning when the stream is not read")
	if err := parse(fs, args); err != nil {
		return err
	}
	if err := app.ValidateStream(c.stream); err != nil {
		return err
	}
	t, err := store.ParseTable(c.table)
	if err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, c.databaseURL)
	if err != nil {
		return fmt.Errorf("connect to PostgreSQL: %w", err)
	}
	defer pool.Close()
	st := store.New(pool, t, store.PolicyMark)
	if err := st.Check(ctx); err != nil {
		return err
	}
	var rep statusReport
	rep.Table = t.Qualified()
	rep.Slot.Name = c.slot
	slot, err := replication.LookupSlot(ctx, pool, c.slot)
	if err != nil {
		return err
	}
	rep.Slot.Exists, rep.Slot.Active, rep.Slot.ActivePID, rep.Slot.WALStatus = slot.Exists, slot.Active, slot.ActivePID, slot.WALStatus
	if slot.Exists {
		rep.Slot.ConfirmedLSN = slot.ConfirmedFlush.String()
		if rep.Slot.LagBytes, _, err = replication.SlotLag(ctx, pool, c.slot); err != nil {
			return err
		}
	}
	if rep.Counts, err = st.Counts(ctx); err != nil {
		return err
	}
	window := *dupWindow
	if c.natsURL != "" {
		si := readStream(ctx, c.natsURL, c.stream)
		rep.Stream = &si
		if si.Error == "" {
			window = time.Duration(si.DuplicateWindowSeconds * float64(time.Second))
		}
	}
	rep.DuplicateWindowSeconds = window.Seconds()
	if err := replayHorizon(ctx, pool, st, slot, &rep); err != nil {
		return err
	}
	rep.Warnings = replayWarnings(&rep, window)
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(rep)
	}
	fmt.Fprintf(stdout, "table      %s\n", rep.Table)
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
	for _, s := range []string{"ready", "scheduled", "running", "published", "failed", "cancelled"} {
		fmt.Fprintf(stdout, "%s=%d ", s, rep.ByState[s])
	}
	fmt.Fprintf(stdout, "\noldest eligible row: %.1fs\n", rep.OldestEligibleSeconds)
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
	for _, w := range rep.Warnings {
		fmt.Fprintln(stdout, w)
	}
	return nil
}

// replayHorizon fills the slot's lag in seconds from what PostgreSQL can
// tell; see statusReport.
func replayHorizon(ctx context.Context, pool *pgxpool.Pool, st *store.Store, slot replication.SlotInfo, rep *statusReport) error {
	consider := func(secs float64, source string) {
		if source != "" && (rep.Slot.LagSource == "" || secs > rep.Slot.LagSeconds) {
			rep.Slot.LagSeconds, rep.Slot.LagSource = secs, source
		}
	}
	if slot.Exists && slot.Active && slot.ActivePID != 0 {
		secs, ok, err := replicationLagSeconds(ctx, pool, slot.ActivePID)
		if err != nil {
			return err
		}
		switch {
		case ok:
			consider(secs, "pg_stat_replication.flush_lag")
		case rep.Slot.LagBytes == 0:
			consider(0, "pg_stat_replication (caught up)")
		}
	}
	if slot.Exists && !slot.Active && rep.Slot.LagBytes > 0 {
		secs, ok, err := inactiveSeconds(ctx, pool, rep.Slot.Name)
		if err != nil {
			return err
		}
		if ok {
			consider(secs, "pg_replication_slots.inactive_since")
		}
	}
	if !slot.Exists {
		// Nothing to replay: ready rows wait for a new slot's handover and
		// are published once.
		return nil
	}
	ready, err := st.OldestReadySeconds(ctx)
	if err != nil {
		return err
	}
	if ready > 0 {
		consider(ready, "oldest ready row")
	}
	return nil
}

// replayWarnings says when a relay restart could republish a message after
// the broker forgot its Nats-Msg-Id. The relay replays from the slot's
// confirmed position, and anything it had already published before that is
// deduplicated only inside the duplicate window.
func replayWarnings(rep *statusReport, window time.Duration) []string {
	var out []string
	if rep.Slot.LagSource != "" && rep.Slot.LagSeconds > window.Seconds() {
		out = append(out, fmt.Sprintf("WARNING: the replay horizon (~%.0fs by %s) exceeds the duplicate window (%s): a relay restart now "+
			"republishes messages first published longer ago than the window, and the broker may store them twice; consumers need the inbox",
			rep.Slot.LagSeconds, rep.Slot.LagSource, window))
	} else if rep.Slot.Exists && !rep.Slot.Active && rep.Slot.LagBytes > 0 && rep.Slot.LagSource != "pg_replication_slots.inactive_since" {
		out = append(out, fmt.Sprintf("NOTE: no relay streams the slot and it holds %d bytes unconfirmed; this PostgreSQL cannot say since when. "+
			"If outbox rows in that WAL were published more than the duplicate window (%s) before the relay resumes, the broker may store them twice",
			rep.Slot.LagBytes, window))
	}
	return out
}
