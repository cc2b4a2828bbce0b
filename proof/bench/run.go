// Package bench is the end-to-end benchmark behind `go run ./cmd/outbox-bench`:
// on one real PostgreSQL (wal_level=logical, fsync on) and one nats-server
// (file storage) it measures the ceilings (inserts with no relay, JetStream
// async publishes with no database), the relay's CDC path and its poller
// path, and a naive polling publisher, with the relay and the polling
// publisher as child processes whose CPU and memory are read from /proc.
package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/outbox-relay/outbox-relay/proof/bigtable"
)

// Case names, in the order a round runs them (CDC and polling alternate
// between rounds).
const (
	CeilingPG     = "ceiling-pg"
	CeilingJS     = "ceiling-js"
	CDCBacklog    = "cdc-backlog"
	CDCLive       = "cdc-live"
	PollBacklog   = "poll-backlog"
	PollLive      = "poll-live"
	PollerBacklog = "poller-backlog"
	PollerLive    = "poller-live"
	Idle          = "idle"
	Decode        = "decode" // decode.go: how far one slot goes
)

// AllCases is the default -cases.
var AllCases = []string{CeilingPG, CeilingJS, CDCBacklog, CDCLive, PollBacklog, PollLive, PollerBacklog, PollerLive, Idle, Decode, Restart, ReadBack, RestartDrains}

// Config is the workload and what to run.
type Config struct {
	Rows        int
	RowsPerTx   int
	Payload     int
	Producers   int
	Rate        float64 // rows/s for live cases; 0 = as fast as possible
	LiveSeconds float64 // with Rate > 0, live cases insert min(Rows, Rate*LiveSeconds) rows
	// Policy is the relay's --on-publish: mark | delete | none. The naive
	// polling publisher has no watermark: under none it marks.
	Policy       string
	Rounds       int
	Cases        []string
	PollInterval time.Duration // naive publisher's and the relay poller's
	NaiveMode    string        // async | sync
	IdleSeconds  float64
	RelayBin     string // built from the module when empty
	BaselineBin  string // -cases formats: a relay built before issue 45, whose jsonb × outbox drain is the baseline
	JSONPath     string
	PlotPath     string
	CPUProfile   string // profile one in-process CDC backlog drain into this file
	Trace        string // with CPUProfile: an execution trace of the same run (goroutine wake-ups: go tool trace)
	Keep         bool   // keep the children's logs
	// RelayPGOptions are server settings for the relay's sessions, e.g.
	// "-c plan_cache_mode=force_custom_plan" (an experiment, not a default).
	RelayPGOptions string
	ProfileCase    string // cdc-backlog or cdc-live
	MemProfile     string // and write its heap profile here when every message is acked
	// SameTable keeps each case's database, table, slot and stream from one
	// round to the next, as a deployment does: round N drains its rows from a
	// table that already holds the earlier rounds' rows.
	SameTable bool
	// RelayEnv is extra environment for the relay child (KEY=value), for
	// experiments with the Go runtime (GOMAXPROCS, GOGC).
	RelayEnv []string
	// RelayArgs are extra flags for the relay child's run command.
	RelayArgs []string
	// The bigtable case (bigtable.go): preloaded rows, and the window.
	BigTableRows    int
	BigTableSeconds float64
	BigTx           BigTxConfig // -cases bigtx (bigtx.go)
	Soak            SoakConfig  // -cases soak (soak.go)

	Out io.Writer // the table
	Log io.Writer // progress
}

// Report is what -json writes.
type Report struct {
	Started  time.Time         `json:"started"`
	Machine  map[string]string `json:"machine"`
	Config   Config            `json:"config"`
	Results  []Result          `json:"results"`
	Medians  []Result          `json:"medians"`
	Idle     *IdleResult       `json:"idle,omitempty"`
	Restart  *RestartResult    `json:"restart,omitempty"`
	ReadBack *ReadBackResult   `json:"readback,omitempty"`
	// RestartDrains is issue 41's drains with restarts between them.
	RestartDrains *RestartDrainsResult `json:"restart_drains,omitempty"`
	Profile       *Result              `json:"profiled_in_process,omitempty"`
	Warnings      []string             `json:"warnings,omitempty"`
	BigTable      *bigtable.Result     `json:"bigtable,omitempty"`
	Soak          []SoakSample         `json:"soak,omitempty"`
	// Formats is issue 45's drains per payload type and message format.
	Formats *FormatsResult `json:"formats,omitempty"`
}

// extraCases run once each after the rounds, only when named in -cases;
// each is registered by its own file.
var extraCases = map[string]func(b *bench, ctx context.Context, rep *Report) error{}

func (c *Config) validate() error {
	if c.Rows < 1 || c.RowsPerTx < 1 || c.Producers < 1 || c.Payload < 16 || c.Rounds < 1 {
		return fmt.Errorf("-rows, -rows-per-tx, -producers, -rounds must be positive and -payload at least 16")
	}
	if c.Policy != "mark" && c.Policy != "delete" && c.Policy != "none" {
		return fmt.Errorf("-policy %q: want mark, delete or none", c.Policy)
	}
	if c.NaiveMode != "async" && c.NaiveMode != "sync" {
		return fmt.Errorf("-naive-mode %q: want async or sync", c.NaiveMode)
	}
	if c.ProfileCase != CDCBacklog && c.ProfileCase != CDCLive {
		return fmt.Errorf("-profile-case %q: want %s or %s", c.ProfileCase, CDCBacklog, CDCLive)
	}
	for _, k := range c.Cases {
		if !slices.Contains(AllCases, k) && extraCases[k] == nil && k != BigTx {
			return fmt.Errorf("-cases: unknown case %q (known: %s)", k, strings.Join(AllCases, ","))
		}
	}
	return nil
}

func (c *Config) liveRows() int {
	if c.Rate <= 0 || c.LiveSeconds <= 0 {
		return c.Rows
	}
	return min(c.Rows, max(1, int(c.Rate*c.LiveSeconds)))
}

func (c *Config) logf(format string, args ...any) {
	if c.Log != nil {
		fmt.Fprintf(c.Log, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05")}, args...)...)
	}
}

// Run runs the benchmark and prints the table.
func Run(ctx context.Context, cfg Config) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "outbox-bench-")
	if err != nil {
		return err
	}
	if cfg.Keep {
		cfg.logf("keeping the relay's and the polling publisher's logs in %s", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	if cfg.RelayBin == "" {
		cfg.logf("building cmd/outbox-relay")
		if cfg.RelayBin, err = buildRelay(dir); err != nil {
			return err
		}
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	cfg.logf("starting PostgreSQL (fsync on) and nats-server (file storage)")
	s, err := startServers(ctx, dir)
	if err != nil {
		return err
	}
	defer s.close()
	b := &bench{cfg: cfg, s: s, dir: dir, self: self, payload: makePayload(cfg.Payload)}
	rep := Report{Started: time.Now().UTC(), Machine: machineInfo(), Config: cfg}

	want := func(k string) bool { return slices.Contains(cfg.Cases, k) }
	// A fresh server is slower for its first load (cold caches, first
	// checkpoint); one unrecorded ceiling run takes that out of round 1.
	cfg.logf("warm-up: %s, not recorded", CeilingPG)
	if _, err := b.runCase(ctx, CeilingPG, 0); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	for round := 1; round <= cfg.Rounds; round++ {
		order := []string{CeilingPG, CeilingJS, CDCBacklog, PollBacklog, PollerBacklog, CDCLive, PollLive, PollerLive}
		if round%2 == 0 {
			order = []string{CeilingPG, CeilingJS, PollBacklog, CDCBacklog, PollerBacklog, PollLive, CDCLive, PollerLive}
		}
		order = append(order, Decode)
		for _, k := range order {
			if !want(k) {
				continue
			}
			cfg.logf("round %d: %s", round, k)
			r, err := b.runCase(ctx, k, round)
			if err != nil {
				return fmt.Errorf("round %d, %s: %w", round, k, err)
			}
			cfg.logf("round %d: %s: %.0f msg/s in %.2fs", round, k, r.MsgsPerSec, r.Seconds)
			rep.Results = append(rep.Results, r)
		}
	}
	if want(BigTx) {
		if err := b.bigTx(ctx, &rep); err != nil {
			return err
		}
	}
	if want(Idle) {
		cfg.logf("idle: %gs with no outbox traffic", cfg.IdleSeconds)
		ir, err := b.idle(ctx)
		if err != nil {
			return fmt.Errorf("idle: %w", err)
		}
		rep.Idle = &ir
	}
	for _, k := range cfg.Cases {
		if run := extraCases[k]; run != nil {
			cfg.logf("%s", k)
			if err := run(b, ctx, &rep); err != nil {
				return err
			}
		}
	}
	if want(Restart) {
		cfg.logf("restart: %d rounds of %d rows, then a restart under load", restartRounds, cfg.Rows)
		rr, err := b.restart(ctx)
		if err != nil {
			return fmt.Errorf("restart: %w", err)
		}
		rep.Restart = &rr
	}
	if want(ReadBack) {
		cfg.logf("readback: kill -9 under load, restart after %v, with the read-back on and off", readBackOutages)
		rr, err := b.readBack(ctx)
		if err != nil {
			return fmt.Errorf("readback: %w", err)
		}
		rep.ReadBack = &rr
	}
	if want(RestartDrains) {
		cfg.logf("restart-drains: %d backlogs of %d rows, a clean restart of the relay before each, beside the polling publisher", restartDrainRounds, readBackBacklog)
		rr, err := b.restartDrains(ctx)
		if err != nil {
			return fmt.Errorf("restart-drains: %w", err)
		}
		rep.RestartDrains = &rr
	}
	if cfg.CPUProfile != "" {
		cfg.logf("profiling an in-process %s into %s", cfg.ProfileCase, cfg.CPUProfile)
		profile := b.profiledBacklog
		if cfg.ProfileCase == CDCLive {
			profile = b.profiledLive
		}
		r, err := profile(ctx)
		if err != nil {
			return fmt.Errorf("profile: %w", err)
		}
		rep.Profile = &r
	}
	addWALShares(rep.Results)
	rep.Medians = medians(rep.Results, cfg.Cases, cfg.Rate > 0)
	fmt.Fprint(cfg.Out, Render(rep))
	if rep.Restart != nil {
		fmt.Fprint(cfg.Out, renderRestart(rep.Restart))
	}
	if rep.ReadBack != nil {
		fmt.Fprint(cfg.Out, renderReadBack(rep.ReadBack))
	}
	if rep.RestartDrains != nil {
		fmt.Fprint(cfg.Out, renderRestartDrains(rep.RestartDrains))
	}
	if rep.Formats != nil {
		fmt.Fprint(cfg.Out, renderFormats(rep.Formats))
	}
	if cfg.JSONPath != "" {
		data, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(cfg.JSONPath, append(data, '\n'), 0o644); err != nil {
			return err
		}
	}
	if cfg.PlotPath != "" {
		if err := Plot(cfg.PlotPath, rep); err != nil {
			return fmt.Errorf("plot: %w", err)
		}
	}
	return nil
}

// medians picks, per case, the round with the median throughput, so each
// row of the table is one real run. Live cases at a target rate all reach
// about the same throughput; for them the key is the p99 latency.
func medians(rs []Result, order []string, paced bool) []Result {
	var out []Result
	for _, k := range AllCases {
		if !slices.Contains(order, k) {
			continue
		}
		var runs []Result
		var rates []float64
		for _, r := range rs {
			if r.Case == k {
				runs = append(runs, r)
				rates = append(rates, medianKey(r, paced))
			}
		}
		if i := MedianIndex(rates); i >= 0 {
			m := runs[i]
			m.Extra = cloneExtra(m.Extra)
			if len(runs) > 1 {
				m.Extra["rounds"] = float64(len(runs))
				m.Extra["median_key_min"] = slices.Min(rates)
				m.Extra["median_key_max"] = slices.Max(rates)
			}
			out = append(out, m)
		}
	}
	return out
}

func cloneExtra(m map[string]float64) map[string]float64 {
	out := make(map[string]float64, len(m)+3)
	for k, v := range m {
		out[k] = v
	}
	return out
}

func machineInfo() map[string]string {
	m := map[string]string{}
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		n := 0
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok {
				switch strings.TrimSpace(k) {
				case "model name":
					m["cpu"] = strings.TrimSpace(v)
				case "processor":
					n++
				}
			}
		}
		m["cpus"] = fmt.Sprint(n)
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		m["memory"] = strings.Join(strings.Fields(line)[1:], " ")
	}
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		m["loadavg_at_start"] = strings.TrimSpace(string(b))
	}
	m["tmp"] = filepath.Clean(os.TempDir())
	return m
}

// medianKey is what rounds are ranked by: throughput, or for live cases at
// a target rate the p99 commit-to-ack latency.
func medianKey(r Result, paced bool) float64 {
	if paced && r.Latency != nil {
		return r.Latency.P99
	}
	return r.MsgsPerSec
}
