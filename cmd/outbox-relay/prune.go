package main

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/outbox-relay/outbox-relay/internal/schema"
	"github.com/outbox-relay/outbox-relay/internal/store"
)

func runPrune(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var c common
	fs := newFlagSet("prune", `Deletes published rows whose published_at is older than --older-than (and, with
--include-cancelled, cancelled rows cancelled that long ago), in batches, until none is left.
Ready rows the watermark covers (--on-publish none: published, left as inserted) go by created_at.
Ready rows in flight, scheduled, running and failed rows are never deleted. The <table>_redrives history is kept.
On a partitioned table (migrate --partition-interval) it deletes no row: it detaches and drops the
partitions that end before now - --older-than and hold nothing it must keep (the same rows as above),
and names the partitions it kept and why. Run it there as the table's owner.

  outbox-relay prune --older-than 7d`, stderr)
	c.register(fs, flagDatabaseURL, flagTable)
	olderThan := fs.String("older-than", "", "required: delete rows published (or cancelled) longer ago than this age, e.g. 168h or 7d")
	batch := fs.Int("batch", 1000, "rows per DELETE statement (each its own transaction)")
	includeCancelled := fs.Bool("include-cancelled", false, "also delete cancelled rows, by when they were cancelled (redriven_at, else created_at), and expired rows, by their deadline")
	dryRun := fs.Bool("dry-run", false, "count what would be deleted, delete nothing")
	lockTimeout := fs.Duration("lock-timeout", schema.DefaultLockTimeout, "partitioned table: longest wait for the table's lock to detach a partition (producers' INSERTs queue behind the wait); a partition not detached in time is kept for the next prune")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *olderThan == "" {
		return fmt.Errorf("--older-than is required, e.g. --older-than 7d")
	}
	age, err := parseAge("older-than", *olderThan)
	if err != nil {
		return err
	}
	if *lockTimeout <= 0 {
		return fmt.Errorf("--lock-timeout %s: want more than 0 (PostgreSQL reads 0 as no bound: producers would queue behind prune for as long as another session holds the table)", *lockTimeout)
	}
	if *batch <= 0 {
		return fmt.Errorf("--batch %d: must be positive", *batch)
	}
	st, closeDB, err := openStore(ctx, &c)
	if err != nil {
		return err
	}
	defer closeDB()
	res, err := st.Prune(ctx, store.PruneRequest{OlderThan: age, Batch: *batch, IncludeCancelled: *includeCancelled, DryRun: *dryRun, LockTimeout: *lockTimeout})
	if res.Partitioned {
		printPartitions(stdout, st.Table().Qualified(), res, *dryRun)
	}
	if err != nil {
		return err
	}
	if res.Partitioned {
		return nil
	}
	verb, batches := "pruned", fmt.Sprintf(" in %d batches", res.Batches)
	if *dryRun {
		verb, batches = "dry run, nothing deleted: would prune", ""
	}
	fmt.Fprintf(stdout, "%s %d published rows", verb, res.Published)
	if res.Covered > 0 {
		fmt.Fprintf(stdout, " (%d of them ready rows covered by the watermark, --on-publish none, by created_at)", res.Covered)
	}
	if *includeCancelled {
		fmt.Fprintf(stdout, " and %d cancelled and %d expired rows", res.Cancelled, res.Expired)
	}
	fmt.Fprintf(stdout, " older than %s (before %s) from %s%s\n", age, res.Cutoff.UTC().Format(time.RFC3339), st.Table().Qualified(), batches)
	return nil
}

// printPartitions says, for each partition that ends before the cutoff,
// whether prune dropped it or kept it and why.
func printPartitions(w io.Writer, table string, res store.PruneResult, dryRun bool) {
	dropped := 0
	for _, p := range res.Partitions {
		ends := "the DEFAULT partition"
		if !p.Default {
			ends = "ends " + p.End.UTC().Format("2006-01-02 15:04")
		}
		switch {
		case p.Kept != "":
			fmt.Fprintf(w, "kept %s (%s): %s\n", p.Name, ends, p.Kept)
		case dryRun:
			dropped++
			fmt.Fprintf(w, "would drop %s (%s): %d rows\n", p.Name, ends, p.Rows)
		default:
			dropped++
			fmt.Fprintf(w, "dropped %s (%s): %d rows\n", p.Name, ends, p.Rows)
		}
	}
	verb := "dropped"
	if dryRun {
		verb = "dry run, nothing dropped: would drop"
	}
	fmt.Fprintf(w, "%s %d partitions of %s ending before %s (no row deleted one by one)\n", verb, dropped, table, res.Cutoff.UTC().Format(time.RFC3339))
}
