package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/user"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outbox-relay/outbox-relay/internal/app"
	"github.com/outbox-relay/outbox-relay/internal/poller"
	"github.com/outbox-relay/outbox-relay/internal/store"
	"github.com/outbox-relay/outbox-relay/internal/termsafe"
	natssink "github.com/outbox-relay/outbox-relay/sinks/jetstream"
)

// listed is how many work IDs a report names before it says "and N more":
// a bulk redrive of 100k rows must not flood the terminal.
const listed = 20

// workIDs is the repeatable --work-id flag.
type workIDs []string

func (w *workIDs) String() string { return strings.Join(*w, ",") }

func (w *workIDs) Set(v string) error {
	if strings.TrimSpace(v) == "" {
		return errors.New("empty work ID")
	}
	*w = append(*w, v)
	return nil
}

// opFlags are the flags redrive and cancel share.
type opFlags struct {
	common
	ids                workIDs
	kind, state, since string
	by, reason         string
	limit              int
	dryRun             bool
}

func (o *opFlags) register(fs *flag.FlagSet, a store.Action, uses ...string) {
	o.common.register(fs, uses...)
	verb := string(a)
	fs.Var(&o.ids, "work-id", "work ID of a row to "+verb+"; repeat for more (not with a filter)")
	fs.StringVar(&o.state, "state", "", "filter: rows in this state ("+strings.Join(a.From(), " or ")+"); required with a filter")
	fs.StringVar(&o.kind, "kind", "", "filter: rows of this kind")
	fs.StringVar(&o.since, "since", "", "filter: rows created at or after this time: RFC3339 (2024-05-01T00:00:00Z) or an age (24h, 7d)")
	fs.IntVar(&o.limit, "limit", 0, "filter: at most this many rows, oldest first (0: all)")
	fs.StringVar(&o.reason, "reason", "", "why (required): kept in redrive_reason and the history table")
	fs.StringVar(&o.by, "by", defaultBy(), "who: kept in redriven_by and the history table")
	fs.BoolVar(&o.dryRun, "dry-run", false, "show what would change, change nothing")
}

// request turns the flags into a store request, refusing bad combinations
// before anything connects.
func (o *opFlags) request(fs *flag.FlagSet, a store.Action) (store.OpRequest, error) {
	r := store.OpRequest{
		Selection: store.Selection{WorkIDs: o.ids, Kind: o.kind, State: o.state, Limit: o.limit},
		By:        o.by, Reason: o.reason, DryRun: o.dryRun,
	}
	if len(o.ids) > 0 {
		for _, f := range []string{"kind", "state", "since", "limit"} {
			if flagGiven(fs, f) {
				return r, fmt.Errorf("--work-id and --%s: give work IDs or a filter, not both", f)
			}
		}
	}
	if o.since != "" {
		t, ago, err := parseSince(o.since)
		if err != nil {
			return r, err
		}
		r.Since, r.SinceAgo = t, ago
	}
	if err := r.Validate(a); err != nil {
		// The store's message names the flags already; its sentinel prefix
		// means nothing to an operator.
		return r, errors.New(strings.TrimPrefix(err.Error(), store.ErrBadSelection.Error()+": "))
	}
	return r, nil
}

// parseSince reads --since: an RFC3339 time, or an age (a Go duration, or
// whole days like 7d) before now.
func parseSince(s string) (time.Time, time.Duration, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, 0, nil
	}
	d, err := parseAge("since", s)
	if errors.As(err, new(ageSyntaxError)) {
		return time.Time{}, 0, fmt.Errorf("--since %q: want an age like 24h or 7d, or an RFC3339 time like 2024-05-01T00:00:00Z", s)
	}
	if err != nil {
		return time.Time{}, 0, err
	}
	return time.Time{}, d, nil
}

// parseDeadline reads --expires-at: an RFC3339 time, or a duration from now.
func parseDeadline(s string, now time.Time) (time.Time, error) {
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d <= 0 {
		return time.Time{}, fmt.Errorf("--expires-at %q: want an RFC3339 time like 2026-12-01T12:00:00Z or a positive duration from now like 2h", s)
	}
	return now.Add(d), nil
}

// defaultBy is user@host: enough to find the person behind a redrive when
// --by was not given.
func defaultBy() string {
	name := os.Getenv("USER")
	if name == "" {
		if u, err := user.Current(); err == nil {
			name = u.Username
		}
	}
	if name == "" {
		name = "unknown"
	}
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	return name + "@" + host
}

// openStore connects and checks the table, as every operator command does
// first.
func openStore(ctx context.Context, c *common) (*store.Store, func(), error) {
	return openStoreOn(ctx, c, func(ctx context.Context) (*pgxpool.Pool, error) {
		return c.db().Pool(ctx, "outbox-relay")
	})
}

// openObserverStore is openStore on a pool with the observer bounds
// (app.DB.ObserverPool), for the commands that only look.
func openObserverStore(ctx context.Context, c *common, appName string) (*store.Store, func(), error) {
	return openStoreOn(ctx, c, func(ctx context.Context) (*pgxpool.Pool, error) {
		return c.db().ObserverPool(ctx, appName)
	})
}

func openStoreOn(ctx context.Context, c *common, open func(context.Context) (*pgxpool.Pool, error)) (*store.Store, func(), error) {
	t, err := store.ParseTable(c.table)
	if err != nil {
		return nil, nil, err
	}
	pool, err := open(ctx)
	if err != nil {
		return nil, nil, err
	}
	st := store.New(pool, t, store.PolicyMark)
	if err := st.Check(ctx); err != nil {
		pool.Close()
		return nil, nil, err
	}
	return st, pool.Close, nil
}

// maxStagger bounds redrive --stagger, the gap between consecutive redriven
// rows: at 1h a redrive of 100 rows already spans four days, far beyond
// sparing the broker a burst. A larger value is a slip of the unit that
// schedules rows years ahead (1000000h: the second row 114 years on) or
// overflows the statement's arithmetic for a few thousand rows.
const maxStagger = time.Hour

func runRedrive(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var o opFlags
	fs := newFlagSet("redrive", `Moves failed, cancelled or expired rows back to scheduled for the poller: same work_id and
payload, attempts reset to 0, who, when and why recorded on the row and in the <table>_redrives history.
A row whose deadline passed needs a new one (--expires-at) or none (--no-deadline).

  outbox-relay redrive --reason "INC-42: limit raised" --work-id w1 --work-id w2
  outbox-relay redrive --reason "INC-42" --state failed --kind order.created --since 24h`, stderr)
	o.register(fs, store.ActionRedrive, withNATS(flagDatabaseURL, flagTable, flagStream, flagSubjectPrefix)...)
	stagger := fs.Duration("stagger", store.DefaultStagger, "row i (oldest first) becomes due at now + i*stagger, so a bulk redrive does not hit the broker at once")
	lookupLimit := fs.Int("lookup-limit", poller.DefaultLookupLimit, "with --nats-url: messages the stream lookup of the uncertain rows reads at most, on their subjects from their last attempt on; rows not found when it stops there are inconclusive and sent again")
	dupWindow := fs.Duration("duplicate-window", natssink.DefaultDuplicateWindow, "the stream's duplicate window, for the uncertain-outcome warning (read from the stream instead when --nats-url is given)")
	expiresAt := fs.String("expires-at", "", "a new business deadline for the redriven rows: RFC3339 (2026-12-01T12:00:00Z) or a duration from now (2h); needed for rows whose deadline passed")
	noDeadline := fs.Bool("no-deadline", false, "redriven rows have no deadline any more (rows whose deadline passed need this or --expires-at)")
	outOfOrder := fs.Bool("out-of-order", false, "send rows of an aggregate whose later sequences are already published; receivers get them after those. Without it such a redrive is refused")
	if err := parse(fs, args); err != nil {
		return err
	}
	req, err := o.request(fs, store.ActionRedrive)
	if err != nil {
		return err
	}
	req.NoDeadline = *noDeadline
	req.OutOfOrder = *outOfOrder
	if *expiresAt != "" {
		if req.ExpiresAt, err = parseDeadline(*expiresAt, time.Now()); err != nil {
			return err
		}
	}
	if err := req.Validate(store.ActionRedrive); err != nil {
		return errors.New(strings.TrimPrefix(err.Error(), store.ErrBadSelection.Error()+": "))
	}
	if err := app.ValidateStream(o.stream); err != nil {
		return err
	}
	if *lookupLimit < 1 {
		return fmt.Errorf("--lookup-limit %d: must be 1 or more", *lookupLimit)
	}
	if *stagger < 0 || *stagger > maxStagger {
		return fmt.Errorf("--stagger %s: must be from 0 to %s", *stagger, maxStagger)
	}
	req.Stagger = *stagger
	st, closeDB, err := openStore(ctx, &o.common)
	if err != nil {
		return err
	}
	defer closeDB()
	window, windowFrom := *dupWindow, "--duplicate-window"
	streamOK := false
	if o.natsGiven(fs) {
		if si := readStream(ctx, &o.common, "redrive"); si.Error != "" {
			fmt.Fprintf(stderr, "stream %s: %s; using --duplicate-window %s\n", o.stream, termsafe.String(si.Error), window)
		} else {
			window, windowFrom = time.Duration(si.DuplicateWindowSeconds*float64(time.Second)), "stream "+o.stream
			streamOK = true
		}
	}
	res, err := st.Redrive(ctx, req)
	if err != nil {
		return err
	}
	report(stdout, st.Table(), req, res)
	if len(res.Changed) > 0 {
		first, last := res.Changed[0].AvailableAt, res.Changed[len(res.Changed)-1].AvailableAt
		fmt.Fprintf(stdout, "due from %s to %s (stagger %s)\n", first.UTC().Format(time.RFC3339Nano), last.UTC().Format(time.RFC3339Nano), req.Stagger)
	}
	if len(res.OutOfOrder) > 0 {
		fmt.Fprintf(stderr, "WARNING: %d rows %s after later sequences of their aggregates were published; receivers get them out of order (inbox InSequence past a skipped gap, and LatestWins, record them as superseded):\n",
			len(res.OutOfOrder), map[bool]string{false: "redriven", true: "would be redriven"}[req.DryRun])
		for i, o := range res.OutOfOrder {
			if i == listed {
				fmt.Fprintf(stderr, "  ... and %d more\n", len(res.OutOfOrder)-listed)
				break
			}
			fmt.Fprintf(stderr, "  %s: sequence %d of aggregate %q/%q, sequence %d already published\n",
				termsafe.String(o.WorkID), o.Seq, o.Aggregate.Type, o.Aggregate.ID, o.Latest)
		}
	}
	var look lookupResult
	if streamOK {
		look = lookupUncertain(ctx, &o, st, req, res.Changed, *lookupLimit, stdout, stderr)
	}
	var risky []string
	for _, c := range res.Changed {
		// Rows the lookup found are settled, and rows it ruled out are not
		// stored: only the rest can be stored twice.
		if look.done && (look.complete || look.found[c.WorkID]) {
			continue
		}
		if c.Uncertain() && c.SinceLastAttempt > window {
			risky = append(risky, c.WorkID)
		}
	}
	if len(risky) > 0 {
		fmt.Fprintf(stderr, "WARNING: %d rows %s last failed with an uncertain outcome (the broker may have stored them) and become due more than the duplicate window (%s, from %s) after that attempt: the broker can store the republish as a second message, so consumers must deduplicate by Nats-Msg-Id (inbox): %s\n",
			len(risky), map[bool]string{false: "redriven", true: "to be redriven"}[req.DryRun], window, windowFrom, idList(risky))
	}
	return refusedErr(res, req)
}

// report prints what an operator command changed and what it refused.
// Work IDs, kinds and the rest come from rows that producers wrote, so every
// such value goes through termsafe: printed raw, a work ID holding "\r\n" or
// an escape sequence could erase this report and forge another.
func report(w io.Writer, t store.Table, req store.OpRequest, res store.OpResult) {
	ids := make([]string, len(res.Changed))
	for i, c := range res.Changed {
		ids[i] = c.WorkID
	}
	what := fmt.Sprintf("of %d given work IDs", len(req.WorkIDs))
	if len(req.WorkIDs) == 0 {
		what = describeFilter(req.Selection)
	}
	prefix := ""
	if res.DryRun {
		prefix = "dry run, nothing changed: "
	}
	fmt.Fprintf(w, "%s%s %d rows %s in %s (by %s, reason %q)", prefix, verbed(res.Action, res.DryRun), len(ids), what,
		termsafe.String(t.Qualified()), termsafe.String(req.By), req.Reason)
	if len(ids) > 0 {
		fmt.Fprintf(w, ": %s", idList(ids))
	}
	fmt.Fprintln(w)
	if len(res.Refused) > 0 {
		fmt.Fprintf(w, "refused %d:\n", len(res.Refused))
		for i, r := range res.Refused {
			if i == listed {
				fmt.Fprintf(w, "  ... and %d more\n", len(res.Refused)-listed)
				break
			}
			fmt.Fprintf(w, "  %s: %s\n", termsafe.String(r.WorkID), termsafe.String(r.Why(res.Action)))
		}
	}
}

func verbed(a store.Action, dry bool) string {
	switch {
	case dry && a == store.ActionRedrive:
		return "would redrive"
	case dry:
		return "would cancel"
	case a == store.ActionRedrive:
		return "redrove"
	}
	return "cancelled"
}

func describeFilter(s store.Selection) string {
	d := "in state " + s.State
	if s.Kind != "" {
		d += " of kind " + termsafe.String(s.Kind)
	}
	if !s.Since.IsZero() {
		d += " created since " + s.Since.UTC().Format(time.RFC3339)
	}
	if s.SinceAgo != 0 {
		d += " created in the last " + s.SinceAgo.String()
	}
	if s.Limit > 0 {
		d += fmt.Sprintf(" (oldest %d at most)", s.Limit)
	}
	return d
}

// idList names work IDs for a human, escaped (see report).
func idList(ids []string) string {
	if len(ids) <= listed {
		return strings.Join(termsafe.Strings(ids), ", ")
	}
	return strings.Join(termsafe.Strings(ids[:listed]), ", ") + fmt.Sprintf(" and %d more", len(ids)-listed)
}

// refusedErr makes a refused work ID an exit status: a script that asked
// for these rows must learn that some did not move.
func refusedErr(res store.OpResult, req store.OpRequest) error {
	if len(res.Refused) == 0 {
		return nil
	}
	return fmt.Errorf("refused %d of %d work IDs (listed above)", len(res.Refused), len(req.WorkIDs))
}
