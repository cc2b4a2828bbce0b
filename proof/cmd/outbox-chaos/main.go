// Command outbox-chaos runs the relay under seeded random faults against
// real PostgreSQL and NATS and checks G1, G2, G3 and G5 from the database,
// an independent test_decoding slot and the stream (see internal/chaos).
//
//	go run ./cmd/outbox-chaos -duration 30m -json chaos.json
//	go run ./cmd/outbox-chaos -cluster 3 -duration 15m   # three-node JetStream cluster, R3 stream
//	go run ./cmd/outbox-chaos -failover -pg-version 17 -duration 3m   # plus a standby promotion (G14)
//	go run ./cmd/outbox-chaos -pg-clock-offset 60s   # PostgreSQL's clock a minute ahead (libfaketime), pg-clock-shifted with it
//
// It prints one table and exits 1 when a figure that must be zero is not
// or an enabled fault kind was never injected or never bit, 2 when the run
// itself could not be carried out. The seed and the command that replays
// the run (the same flags plus -seed) are always printed.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/outbox-relay/outbox-relay/proof/chaos"
)

func main() { os.Exit(run()) }

func run() int {
	var (
		cfg      chaos.Config
		faults   string
		jsonPath string
		seed     uint64
	)
	fs := flag.NewFlagSet("outbox-chaos", flag.ContinueOnError)
	fs.DurationVar(&cfg.Duration, "duration", 2*time.Minute, "how long the load and the faults last (the drain comes after)")
	fs.Uint64Var(&seed, "seed", 0, "seed of the fault schedule and the load (0: from the clock); printed for replay")
	fs.IntVar(&cfg.Rate, "rate", 400, "committed outbox rows per second over all producers")
	fs.IntVar(&cfg.Rows, "rows", 0, "stop the load after this many committed rows (0: -duration decides)")
	fs.IntVar(&cfg.Producers, "producers", 4, "producer connections")
	fs.StringVar(&faults, "faults", "", "comma-separated fault kinds to enable (default all): "+strings.Join(chaos.AllFaults, ",")+" (and "+chaos.FaultNATSNodeKill+" with -cluster; "+chaos.FaultPGFailover+" only when named or with -failover)")
	fs.BoolVar(&cfg.Failover, "failover", false, "add "+chaos.FaultPGFailover+": run PostgreSQL with a physical standby (relay: multi-host URL, --standby-slot), cut it off, kill the primary -m immediate and promote it; once per run, then the run goes on against the new primary")
	fs.IntVar(&cfg.PGVersion, "pg-version", 0, "PostgreSQL major version (15; 16 to 18 from make pg-versions); 0: the test environment's default")
	fs.DurationVar(&cfg.PGClockOffset, "pg-clock-offset", 0, "run PostgreSQL on a wall clock this far ahead of this host's (behind when negative; whole seconds; libfaketime, make setup installs it) for the whole run: deadlines, leases and the relays' reads are then decided with the database and the broker 60 s apart, and "+chaos.FaultPGClockShifted+" applies (not applicable without it)")
	fs.IntVar(&cfg.Cluster, "cluster", 0, "run against a JetStream cluster of this many nodes (3: the relay gets every node's URL and --stream-replicas 3; nats-kill then kills one node, and "+chaos.FaultNATSNodeKill+" joins the faults); 0: one nats-server")
	fs.StringVar(&jsonPath, "json", "", "also write the report as JSON to this file")
	fs.DurationVar(&cfg.MinGap, "min-gap", 500*time.Millisecond, "shortest pause between two faults")
	fs.DurationVar(&cfg.MaxGap, "max-gap", 3*time.Second, "longest pause between two faults")
	fs.DurationVar(&cfg.MaxHold, "max-hold", 5*time.Second, "longest outage of most faults (relay-kill-long stays down 3 to 4 duplicate windows)")
	fs.DurationVar(&cfg.DuplicateWindow, "duplicate-window", chaos.DefaultDuplicateWindow, "the duplicate window the relays create the stream with (at least 1s): short, so that outages outlast it and only the relay's read-back (G18) keeps a replay from being stored twice")
	fs.DurationVar(&cfg.WalSenderTimeout, "wal-sender-timeout", 5*time.Second, "PostgreSQL's wal_sender_timeout: how long a partitioned relay keeps the slot")
	fs.DurationVar(&cfg.DrainTimeout, "drain-timeout", 3*time.Minute, "after the faults, how long to wait for every row to be published")
	fs.StringVar(&cfg.OnPublish, "on-publish", "mark", "the relays' --on-publish: mark, or none (G17: each observation also checks that every row the watermark covers is in the stream)")
	fs.BoolVar(&cfg.Race, "race", false, "build the relay with the race detector")
	fs.StringVar(&cfg.RelayBin, "relay-bin", "", "relay binary to run (default: go build ./cmd/outbox-relay into a temp dir)")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the work directory (relay and server logs) even when the run passes")
	if err := fs.Parse(os.Args[1:]); err != nil {
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "outbox-chaos: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if faults != "" {
		for _, f := range strings.Split(faults, ",") {
			if f = strings.TrimSpace(f); f != "" {
				cfg.Faults = append(cfg.Faults, f)
			}
		}
		if err := chaos.ValidateFaults(cfg.Faults); err != nil {
			fmt.Fprintf(os.Stderr, "outbox-chaos: -faults: %v\n", err)
			return 2
		}
	}
	if seed == 0 {
		seed = uint64(time.Now().UnixNano())
	}
	cfg.Seed = seed
	cfg.Log = os.Stderr
	cfg.Command = "outbox-chaos " + strings.Join(os.Args[1:], " ")
	cfg.Replay = replayCommand(os.Args[1:], seed)
	fmt.Fprintf(os.Stderr, "outbox-chaos: seed %d; replay: %s\n", seed, cfg.Replay)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := chaos.Run(ctx, cfg)
	code := 0
	if rep != nil {
		fmt.Print(rep.Table())
		if rep.WorkDir != "" {
			fmt.Printf("relay and server logs kept in %s\n", rep.WorkDir)
		}
		if len(rep.Failures()) > 0 {
			code = 1
		}
		if jsonPath != "" {
			b, _ := json.MarshalIndent(rep, "", "  ")
			if werr := os.WriteFile(jsonPath, append(b, '\n'), 0o644); werr != nil {
				fmt.Fprintf(os.Stderr, "outbox-chaos: write %s: %v\n", jsonPath, werr)
				code = max(code, 2)
			}
		}
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "outbox-chaos: the run could not be completed: %v (seed %d; replay: %s)\n", err, seed, cfg.Replay)
		code = 2
	}
	return code
}

// replayCommand is the command line, run from the repository's root, that
// repeats this run's schedule and load: the same flags with -seed set to
// the seed used.
func replayCommand(args []string, seed uint64) string {
	out := []string{"cd proof && go run ./cmd/outbox-chaos"}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "seed" {
			if !hasValue {
				i++ // the value is the next argument
			}
			continue
		}
		out = append(out, shellQuote(a))
	}
	return strings.Join(append(out, "-seed", strconv.FormatUint(seed, 10)), " ")
}

func shellQuote(s string) string {
	if s != "" && strings.IndexFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./:=,@+", r))
	}) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
