// Command outbox-bench is the end-to-end benchmark: it starts its own
// PostgreSQL (wal_level=logical, fsync on) and nats-server (file storage),
// measures the ceilings, the relay's CDC and poller paths and a naive polling
// publisher on the same servers, and prints a table. See docs/benchmarks.md.
//
//	go run ./cmd/outbox-bench -rows 100000 -rows-per-tx 100 -producers 4 -rounds 3
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/proof/bench"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "naive-publish" {
		if err := bench.NaiveMain(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "naive-publish:", err)
			os.Exit(1)
		}
		return
	}
	var c bench.Config
	var cases string
	fs := flag.NewFlagSet("outbox-bench", flag.ExitOnError)
	fs.IntVar(&c.Rows, "rows", 100_000, "rows per case")
	fs.IntVar(&c.RowsPerTx, "rows-per-tx", 100, "rows per producer transaction (1, 10, 100)")
	fs.IntVar(&c.Payload, "payload", 200, "payload bytes (200, 2048, 65536)")
	fs.IntVar(&c.Producers, "producers", 4, "producer connections")
	fs.Float64Var(&c.Rate, "rate", 0, "live cases: target rows/s, open loop (0 = as fast as possible)")
	fs.Float64Var(&c.LiveSeconds, "live-seconds", 10, "live cases with -rate: insert at most rate × this many seconds of rows")
	fs.StringVar(&c.Policy, "policy", "mark", "after the ack: mark, delete or none (G17: the relay writes nothing, a watermark covers the rows; the polling publisher then marks)")
	fs.IntVar(&c.Rounds, "rounds", 1, "rounds, alternating CDC and polling first; the table shows the median round")
	fs.StringVar(&cases, "cases", strings.Join(bench.AllCases, ","), "comma-separated cases to run; also "+bench.BigTable+" (G16) and "+bench.Formats+" (issue 45), not by default")
	fs.DurationVar(&c.PollInterval, "poll-interval", 100*time.Millisecond, "polling publisher's and relay poller's pause when a batch is not full")
	fs.StringVar(&c.NaiveMode, "naive-mode", "async", "polling publisher: async (publish the batch, then wait for every ack) or sync")
	fs.Float64Var(&c.IdleSeconds, "idle-seconds", 10, "idle case: seconds with no traffic (plus 11 s for PostgreSQL's counters)")
	fs.StringVar(&c.RelayBin, "relay-bin", "", "outbox-relay binary to run (default: built from this module)")
	fs.StringVar(&c.BaselineBin, "baseline-bin", "", "formats case: a second outbox-relay binary (one built before issue 45) whose jsonb × outbox drain is the baseline")
	fs.StringVar(&c.JSONPath, "json", "", "write all results as JSON here")
	fs.StringVar(&c.PlotPath, "plot", "", "write a PNG here: latency histogram and throughput over time of the live cases")
	fs.StringVar(&c.CPUProfile, "cpuprofile", "", "run one more CDC backlog drain with the relay in-process and write its CPU profile here")
	fs.StringVar(&c.Trace, "trace", "", "with -cpuprofile: write an execution trace of the profiled run here (goroutine wake-ups, for go tool trace)")
	fs.StringVar(&c.MemProfile, "memprofile", "", "with -cpuprofile: write the in-process relay's heap profile here at the moment every message is acked")
	fs.BoolVar(&c.Keep, "keep", false, "keep the relay's and the polling publisher's logs (their directory is printed)")
	fs.StringVar(&c.ProfileCase, "profile-case", bench.CDCBacklog, "with -cpuprofile: which case to run with the relay in-process (cdc-backlog or cdc-live)")
	fs.StringVar(&c.RelayPGOptions, "relay-pg-options", "", `experiment: server settings for the relay's sessions (libpq options), e.g. "-c plan_cache_mode=force_custom_plan"`)
	fs.IntVar(&c.BigTableRows, "bigtable-rows", 20_000_000, "bigtable case: published rows preloaded into the table")
	fs.Float64Var(&c.BigTableSeconds, "bigtable-seconds", 60, "bigtable case: seconds of trickle, console and metrics polling measured")
	fs.BoolVar(&c.SameTable, "same-table", false, "keep each case's database, table and stream across rounds: later rounds drain on a table holding the earlier rounds' rows")
	c.BigTx.Flags(fs)
	c.Soak.Flags(fs)
	relayEnv := fs.String("relay-env", "", "experiment: comma-separated KEY=value environment for the relay child, e.g. GOMAXPROCS=1,GOGC=200")
	relayArgs := fs.String("relay-args", "", "experiment: space-separated extra flags for the relay's run command, e.g. \"--linger 0\"")
	_ = fs.Parse(os.Args[1:])
	c.RelayArgs = strings.Fields(*relayArgs)
	if *relayEnv != "" {
		c.RelayEnv = strings.Split(*relayEnv, ",")
	}
	c.Cases = strings.Split(cases, ",")
	c.Out, c.Log = os.Stdout, os.Stderr
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := bench.Run(ctx, c); err != nil {
		fmt.Fprintln(os.Stderr, "outbox-bench:", err)
		os.Exit(1)
	}
}
