// Command outbox-relay delivers transactional-outbox rows from PostgreSQL to
// NATS JetStream. This file and its siblings only parse flags and wire parts
// together; the work is done in internal/ and the public packages.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"
)

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, args []string, stdout, stderr io.Writer) error
}

func commands() []command {
	return []command{
		{"migrate", "create or upgrade the outbox table, its indexes and the insert-only publication", runMigrate},
		{"run", "stream outbox rows from the replication slot to JetStream", runRun},
		{"status", "print slot lag, rows by state, oldest eligible age and failures", runStatus},
		{"redrive", "move failed or cancelled rows back to scheduled, keeping work_id and payload", runRedrive},
		{"republish", "publish again the published rows whose messages the broker lost (G19), looked up in the stream first", runRepublish},
		{"cancel", "stop scheduled or failed rows (cancelled), with who and why", runCancel},
		{"console", "serve the operator console (health, dead letters, redrive, cancel) without streaming", runConsole},
		{"prune", "delete published (and cancelled) rows older than an age, in batches", runPrune},
		{"demo", "start throwaway PostgreSQL and NATS (unless URLs are given) and show rows flowing", runDemo},
		{"version", "print the version", runVersion},
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: outbox-relay <command> [flags]\n\ncommands:")
	for _, c := range commands() {
		fmt.Fprintf(w, "  %-8s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w, "\nRun `outbox-relay <command> --help` for a command's flags. Every flag also reads OUTBOX_RELAY_<FLAG>.")
}

func main() {
	tuneGC()
	os.Exit(mainErr(os.Args[1:], os.Stdout, os.Stderr))
}

// defaultGCPercent is the relay's garbage-collection target unless GOGC is
// set. Its live heap is a few megabytes (queues are bounded), so at Go's
// default of 100 the collector ran every few thousand messages and marking
// was the largest single cost of a backlog drain; a higher target trades a
// little peak memory for fewer collections (the figures: docs/benchmarks.md,
// "Figures that used to live in code comments").
const defaultGCPercent = 400

func tuneGC() {
	if _, set := os.LookupEnv("GOGC"); !set {
		debug.SetGCPercent(defaultGCPercent)
	}
}

// memoryLimitBase is what the relay's Go memory may take besides the
// decoded rows it holds (--max-buffered-bytes), counted twice: a row's WAL
// message and its decoded copy. The live heap is small, so the limit only
// matters when rows are large: each then leaves its own size or more in
// garbage, and at GOGC 400 the heap grew to several times the budget before
// a collection. Under the soft limit the collector runs earlier instead
// (docs/benchmarks-scale.md, "One large transaction").
const memoryLimitBase = 48 << 20

// tuneMemoryLimit sets Go's soft memory limit from the byte budget, unless
// GOMEMLIMIT is set.
func tuneMemoryLimit(maxBufferedBytes int) {
	if _, set := os.LookupEnv("GOMEMLIMIT"); !set {
		debug.SetMemoryLimit(memoryLimitBase + 2*int64(maxBufferedBytes))
	}
}

func mainErr(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		usage(stdout)
		if len(args) == 0 {
			return 2
		}
		return 0
	}
	for _, c := range commands() {
		if c.name != args[0] {
			continue
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		done := make(chan struct{})
		defer close(done)
		go func() {
			// A second signal exits at once.
			select {
			case <-ctx.Done():
			case <-done:
				return
			}
			stop()
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(sig)
			select {
			case <-sig:
				fmt.Fprintln(stderr, "outbox-relay: second signal, exiting now")
				os.Exit(130)
			case <-done:
			}
		}()
		err := c.run(ctx, args[1:], stdout, stderr)
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		if err != nil {
			fmt.Fprintf(stderr, "outbox-relay %s: %v\n", c.name, err)
			return 1
		}
		return 0
	}
	fmt.Fprintf(stderr, "outbox-relay: unknown command %q\n\n", args[0])
	usage(stderr)
	return 2
}
