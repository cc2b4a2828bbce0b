package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Soak is the retention case of issue 23: producers at a steady rate for
// -soak-duration beside the relay, with `outbox-relay prune` every
// -soak-every, for each variant in turn (a partitioned table with
// --on-publish none, pruned by dropping partitions; a plain table with
// mark, pruned by batched DELETE). At each prune it samples the table's
// size (every partition, indexes and TOAST included), its dead tuples, the
// autovacuum and autoanalyze runs so far, and the producers' commit p50
// and p99 over the window. Run only when named in -cases: it lasts
// variants × -soak-duration.
const Soak = "soak"

func init() { extraCases[Soak] = (*bench).soak }

// SoakConfig is the soak case's workload.
type SoakConfig struct {
	Duration          time.Duration
	Every             time.Duration
	OlderThan         time.Duration
	PartitionInterval time.Duration
	Rate              int // rows/s over all producers
	RowsPerTx         int
	Variants          string // comma-separated: partitioned-none, plain-mark, plain-none, partitioned-mark
}

// Flags registers the soak flags on fs.
func (c *SoakConfig) Flags(fs *flag.FlagSet) {
	fs.DurationVar(&c.Duration, "soak-duration", time.Hour, "soak: how long each variant runs")
	fs.DurationVar(&c.Every, "soak-every", 5*time.Minute, "soak: prune, then sample, this often")
	fs.DurationVar(&c.OlderThan, "soak-older-than", 5*time.Minute, "soak: prune --older-than")
	// With the interval equal to -soak-every and -soak-older-than, each
	// prune after the first drops the partition that ended one interval
	// ago, so the table holds the same span at every sample.
	fs.DurationVar(&c.PartitionInterval, "soak-partition-interval", 5*time.Minute, "soak: migrate --partition-interval of the partitioned variants (at least 5m)")
	fs.IntVar(&c.Rate, "soak-rate", 2000, "soak: rows per second over all producers (open loop)")
	fs.IntVar(&c.RowsPerTx, "soak-rows-per-tx", 10, "soak: rows per producer transaction")
	fs.StringVar(&c.Variants, "soak-variants", "partitioned-none,plain-mark", "soak: variants, run one after another: {plain,partitioned}-{mark,none}")
}

// SoakSample is one variant's state at one prune.
type SoakSample struct {
	Variant      string  `json:"variant"`
	Minute       float64 `json:"minute"`
	TableBytes   int64   `json:"table_bytes"`
	Partitions   int     `json:"partitions"`
	LiveTuples   int64   `json:"live_tuples"`
	DeadTuples   int64   `json:"dead_tuples"`
	Autovacuums  int64   `json:"autovacuums"`
	Autoanalyzes int64   `json:"autoanalyzes"`
	Commits      int     `json:"commits"`
	CommitP50ms  float64 `json:"commit_p50_ms"`
	CommitP99ms  float64 `json:"commit_p99_ms"`
	PruneSeconds float64 `json:"prune_seconds"`
	Pruned       string  `json:"pruned"` // prune's first line of output
	SlotLagBytes int64   `json:"slot_lag_bytes"`
}

func (b *bench) soak(ctx context.Context, rep *Report) error {
	c := b.cfg.Soak
	if c.Duration <= 0 || c.Every <= 0 || c.Rate < 1 || c.RowsPerTx < 1 {
		return errors.New("-soak-duration, -soak-every, -soak-rate and -soak-rows-per-tx must be positive")
	}
	for _, v := range strings.Split(c.Variants, ",") {
		table, policy, ok := strings.Cut(strings.TrimSpace(v), "-")
		if !ok || (table != "plain" && table != "partitioned") || (policy != "mark" && policy != "none") {
			return fmt.Errorf("-soak-variants: %q: want {plain,partitioned}-{mark,none}", v)
		}
		samples, err := b.soakVariant(ctx, v, table == "partitioned", policy)
		rep.Soak = append(rep.Soak, samples...)
		if err != nil {
			return fmt.Errorf("%s %s: %w", Soak, v, err)
		}
	}
	fmt.Fprint(b.cfg.Out, renderSoak(rep.Soak))
	return nil
}

func (b *bench) soakVariant(ctx context.Context, variant string, partitioned bool, policy string) ([]SoakSample, error) {
	c := b.cfg.Soak
	name := "soak_" + strings.ReplaceAll(variant, "-", "_")
	url, err := b.s.createDB(ctx, name)
	if err != nil {
		return nil, err
	}
	defer func() { _ = b.s.dropDB(context.Background(), name) }()
	stream := strings.ToUpper(name)
	defer b.s.deleteStream(context.Background(), stream)
	common := []string{"--database-url", url, "--on-publish", policy}
	mig := append([]string{"migrate"}, common...)
	if partitioned {
		mig = append(mig, "--partition-interval", c.PartitionInterval.String())
	}
	if out, err := exec.CommandContext(ctx, b.cfg.RelayBin, mig...).CombinedOutput(); err != nil {
		return nil, fmt.Errorf("migrate: %w: %s", err, out)
	}
	relay, err := startProc("relay", filepath.Join(b.dir, name+"-relay.log"), b.cfg.RelayBin,
		append(append([]string{"run"}, common...), "--nats-url", b.s.nats.URL(), "--stream", stream,
			"--subject-prefix", name+".", "--log-format", "json")...)
	if err != nil {
		return nil, err
	}
	defer func() { _ = relay.stop() }()
	if _, err := b.s.walsenderPID(ctx, name, "outbox_relay", time.Minute); err != nil {
		return nil, fmt.Errorf("relay not streaming: %w (log %s)", err, relay.log)
	}
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	if partitioned {
		// Start just after a partition begins: a soak that starts s into
		// an interval holds s more than -soak-older-than after each drop,
		// and its first sample, before any drop, would be that much
		// smaller than the rest.
		iv := c.PartitionInterval
		wait := iv - time.Duration(time.Now().UnixNano())%iv + 2*time.Second
		b.cfg.logf("%s %s: waiting %s for the next partition to begin", Soak, variant, wait.Round(time.Second))
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(wait):
		}
	}
	w := &commitWindow{}
	lctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	const producers = 4
	txPerSec := float64(c.Rate) / float64(c.RowsPerTx) / producers
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := soakProduce(lctx, pool, p, txPerSec, c.RowsPerTx, b.payload, w); err != nil && lctx.Err() == nil {
				errs <- fmt.Errorf("producer %d: %w", p, err)
			}
		}()
	}
	defer func() { stop(); wg.Wait() }()

	var out []SoakSample
	start := time.Now()
	tick := time.NewTicker(c.Every)
	defer tick.Stop()
	for time.Since(start) < c.Duration {
		select {
		case <-ctx.Done():
			return out, ctx.Err()
		case err := <-errs:
			return out, err
		case <-tick.C:
		}
		if relay.exited() {
			return out, fmt.Errorf("relay exited: %v (log %s)", relay.err, relay.log)
		}
		t0 := time.Now()
		pruneOut, err := exec.CommandContext(ctx, b.cfg.RelayBin, append([]string{"prune", "--older-than", c.OlderThan.String()}, common...)...).CombinedOutput()
		if err != nil {
			return out, fmt.Errorf("prune: %w: %s", err, pruneOut)
		}
		s := SoakSample{Variant: variant, Minute: time.Since(start).Minutes(), PruneSeconds: time.Since(t0).Seconds(),
			Pruned: strings.SplitN(strings.TrimSpace(string(pruneOut)), "\n", 2)[0]}
		s.Commits, s.CommitP50ms, s.CommitP99ms = w.take()
		if err := soakStats(ctx, pool, &s); err != nil {
			return out, err
		}
		b.cfg.logf("%s %s: minute %.0f: %d MB in %d relation(s), %d live, %d dead, %d autovacuums, commit p99 %.1f ms; %s",
			Soak, variant, s.Minute, s.TableBytes>>20, s.Partitions, s.LiveTuples, s.DeadTuples, s.Autovacuums, s.CommitP99ms, s.Pruned)
		out = append(out, s)
	}
	return out, nil
}

// soakProduce commits transactions of rows rows at txPerSec, open loop: a
// late transaction does not push the schedule back.
func soakProduce(ctx context.Context, pool *pgxpool.Pool, p int, txPerSec float64, rows int, payload string, w *commitWindow) error {
	r := rand.New(rand.NewPCG(uint64(p), 23))
	next := time.Now().Add(time.Duration(r.Float64() * float64(time.Second) / txPerSec))
	ids := make([]string, rows)
	for n := 0; ; n++ {
		if d := time.Until(next); d > 0 {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(d):
			}
		}
		next = next.Add(time.Duration(float64(time.Second) / txPerSec))
		for i := range ids {
			ids[i] = fmt.Sprintf("s%d-%d-%d", p, n, i)
		}
		t0 := time.Now()
		if _, err := pool.Exec(ctx, `INSERT INTO outbox (work_id, kind, payload)
			SELECT id, 'soak', jsonb_build_object('pad', $2::text) FROM unnest($1::text[]) id`, ids, payload); err != nil {
			return err
		}
		w.add(time.Since(t0))
	}
}

// commitWindow collects the producers' commit times between two samples.
type commitWindow struct {
	mu sync.Mutex
	d  []time.Duration
}

func (w *commitWindow) add(d time.Duration) {
	w.mu.Lock()
	w.d = append(w.d, d)
	w.mu.Unlock()
}

func (w *commitWindow) take() (n int, p50, p99 float64) {
	w.mu.Lock()
	d := w.d
	w.d = nil
	w.mu.Unlock()
	if len(d) == 0 {
		return 0, 0, 0
	}
	slices.Sort(d)
	ms := func(q float64) float64 { return float64(d[min(len(d)-1, int(q*float64(len(d))))]) / 1e6 }
	return len(d), ms(0.50), ms(0.99)
}

// soakStats reads the table's size and vacuum figures over the table and
// every partition (pg_partition_tree of a plain table is empty: then the
// table itself).
func soakStats(ctx context.Context, pool *pgxpool.Pool, s *SoakSample) error {
	err := pool.QueryRow(ctx, `WITH t AS (SELECT relid FROM pg_partition_tree('outbox') WHERE isleaf
			UNION ALL SELECT 'outbox'::regclass WHERE NOT EXISTS (SELECT 1 FROM pg_partition_tree('outbox')))
		SELECT (SELECT coalesce(sum(pg_total_relation_size(relid)), 0)::bigint FROM t),
			(SELECT count(*) FROM t),
			coalesce(sum(n_live_tup), 0)::bigint, coalesce(sum(n_dead_tup), 0)::bigint,
			coalesce(sum(autovacuum_count), 0)::bigint, coalesce(sum(autoanalyze_count), 0)::bigint,
			coalesce((SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'outbox_relay'), 0)
		FROM pg_stat_user_tables WHERE relid IN (SELECT relid FROM t)`).
		Scan(&s.TableBytes, &s.Partitions, &s.LiveTuples, &s.DeadTuples, &s.Autovacuums, &s.Autoanalyzes, &s.SlotLagBytes)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("read the table's figures: %w", err)
	}
	return nil
}

// renderSoak prints one line per sample, and per variant how far size and
// p99 moved from its first sample (the target for partitioned none:
// within ±10%, dead tuples near zero).
func renderSoak(samples []SoakSample) string {
	var sb strings.Builder
	sb.WriteString("\nsoak (issue 23): at each prune\n")
	fmt.Fprintf(&sb, "| variant | minute | table MB | relations | live | dead | autovacuums | commits | commit p50 ms | commit p99 ms | prune s | pruned |\n")
	fmt.Fprintf(&sb, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
	first := map[string]SoakSample{}
	worst := map[string][2]float64{}
	for _, s := range samples {
		fmt.Fprintf(&sb, "| %s | %.0f | %.1f | %d | %d | %d | %d | %d | %.2f | %.2f | %.1f | %s |\n", s.Variant, s.Minute,
			float64(s.TableBytes)/(1<<20), s.Partitions, s.LiveTuples, s.DeadTuples, s.Autovacuums, s.Commits, s.CommitP50ms, s.CommitP99ms, s.PruneSeconds, s.Pruned)
		f, ok := first[s.Variant]
		if !ok {
			first[s.Variant] = s
			continue
		}
		rel := func(a, b float64) float64 {
			if b == 0 {
				return 0
			}
			return (a - b) / b * 100
		}
		w := worst[s.Variant]
		w[0] = max(w[0], abs(rel(float64(s.TableBytes), float64(f.TableBytes))))
		w[1] = max(w[1], abs(rel(s.CommitP99ms, f.CommitP99ms)))
		worst[s.Variant] = w
	}
	for v, w := range worst {
		fmt.Fprintf(&sb, "%s: size moved at most %.1f%% and commit p99 %.1f%% from the first sample\n", v, w[0], w[1])
	}
	return sb.String()
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}
