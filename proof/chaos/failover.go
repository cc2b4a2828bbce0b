package chaos

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/outbox-relay/outbox-relay/internal/testenv"
)

// FaultPGFailover (opt-in: Config.Failover, -failover) promotes the
// physical standby: it is cut off from the primary for 1 s to MaxHold, so
// it lags, then the primary is killed (-m immediate) and the standby
// promoted. The relays have a multi-host URL (target_session_attrs=
// read-write) through their proxies and --standby-slot naming the
// standby's slot, the producers a multi-host URL straight to the servers;
// both follow the promotion on their own. The run goes on against the new
// primary without a standby (devenv makes standbys of an original primary
// only), so a run fails over once and later pg-failover turns are skipped;
// every other PostgreSQL fault targets the new primary.
const FaultPGFailover = "pg-failover"

// standbySlot is the standby's physical slot on the primary: what the
// relays' --standby-slot names.
const standbySlot = "chaos_standby"

// Failover is one measured promotion.
type Failover struct {
	PGVersion int `json:"pg_version"`
	// CutOffSeconds is how long the standby was cut off before the kill;
	// LagBytes how far its slot was behind the primary's WAL at the kill.
	CutOffSeconds float64 `json:"cut_off_seconds"`
	LagBytes      int64   `json:"standby_lag_bytes"`
	// SlotSynced: on 17+, the relay's failover slot was synced to the
	// standby (and persisted) before the cut; false means the promotion
	// went the new-slot-plus-backfill way.
	SlotSynced bool `json:"slot_synced,omitempty"`
	// SlotPath is what the relay did on the new primary: "survived" (the
	// synced failover slot), "new slot" (created again, with a backfill).
	SlotPath string `json:"slot_path"`
	// TakenBack are rows the old primary committed (the witness saw them or
	// a producer's commit returned) that the new one does not hold; Joined
	// are held rows no witness reported: the old one had not read them yet,
	// or they committed on the new primary before its witness existed.
	TakenBack int `json:"taken_back_rows"`
	Joined    int `json:"joined_from_table"`
	// PromoteSeconds is from the kill until the standby accepts writes,
	// StreamingSeconds from then until a relay streams the slot on it.
	PromoteSeconds   float64 `json:"kill_to_promoted_seconds"`
	StreamingSeconds float64 `json:"promoted_to_streaming_seconds"`
	OK               bool    `json:"ok"`
}

func (r *runner) failover() bool { return slices.Contains(r.cfg.Faults, FaultPGFailover) }

// pgServers are the servers the relay's multi-host URL names, in order.
func (r *runner) pgServers() []*testenv.Postgres {
	if r.standby != nil {
		return []*testenv.Postgres{r.pg, r.standby}
	}
	return []*testenv.Postgres{r.pg}
}

// allPG is every server of the run, a standby before its primary and the
// killed primaries last.
func (r *runner) allPG() []*testenv.Postgres {
	var out []*testenv.Postgres
	if r.standby != nil {
		out = append(out, r.standby)
	}
	if r.pg != nil {
		out = append(out, r.pg)
	}
	return append(out, r.former...)
}

func multiHostURL(hosts []string) string {
	return fmt.Sprintf("postgres://postgres@%s/%s?sslmode=disable&target_session_attrs=read-write", strings.Join(hosts, ","), dbName)
}

// loadURL is the producers' database: the primary, or with pg-failover both
// servers the way an application that follows a promotion names them.
func (r *runner) loadURL() string {
	if !r.failover() {
		return r.db()
	}
	var hosts []string
	for _, s := range r.pgServers() {
		hosts = append(hosts, fmt.Sprintf("127.0.0.1:%d", s.Port()))
	}
	return multiHostURL(hosts)
}

func (r *runner) failoverFault(ctx context.Context, kind, label string) error {
	if r.standby == nil {
		r.skip(kind, "already failed over: no standby left to promote")
		return nil
	}
	old, sb := r.pg, r.standby
	f := Failover{PGVersion: old.Version(), SlotPath: "new slot"}
	if f.PGVersion >= 17 {
		// Promoting before the failover slot reached the standby tests the
		// fallback (new slot, backfill) again, not the survival path.
		f.SlotSynced = r.waitSlotSynced(ctx, sb, 90*time.Second)
		if !f.SlotSynced {
			r.logf("fault %s: the relay's failover slot is not synced to the standby after 90s; promoting anyway (new slot expected)", label)
		}
	}
	created, err := r.slotCreatedCount(ctx)
	if err != nil {
		return err
	}
	r.count(kind)
	cut := r.between(time.Second, r.cfg.MaxHold)
	f.CutOffSeconds = cut.Seconds()
	r.logf("fault %s: standby cut off for %v, then the primary killed (-m immediate) and the standby promoted", label, cut)
	if err := sb.CutOff(); err != nil {
		return err
	}
	r.pause(ctx, cut)
	if err := r.withDB(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, `SELECT coalesce((pg_current_wal_lsn() - restart_lsn)::bigint, -1) FROM pg_replication_slots WHERE slot_name = $1`, standbySlot).Scan(&f.LagBytes)
	}); err != nil {
		r.logf("fault %s: standby lag: %v", label, err)
	}
	// The old primary's last rows that the witness can still learn of;
	// what commits after this read and is taken back is known only from
	// the producers' acknowledgements.
	wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	_ = r.catchUpWitness(wctx)
	cancel()

	// The witness's history ends with the old primary: nothing may read it
	// until the new primary's history has replaced it in the ledger.
	r.witnessMu.Lock()
	t0 := time.Now()
	if err := old.KillImmediate(); err != nil {
		r.witnessMu.Unlock()
		return err
	}
	r.former = append(r.former, old)
	if err := sb.Promote(); err != nil {
		r.witnessMu.Unlock()
		return err
	}
	promoted := time.Now()
	f.PromoteSeconds = promoted.Sub(t0).Seconds()
	// Read now, every commit the old primary acknowledged is in it and
	// none the new one acknowledges after its witness's consistent point
	// is, so Promote counts exactly the acknowledged commits taken back.
	acked := r.load.ackedIDs()
	r.pg, r.standby = sb, nil
	r.setDB(sb.URL(dbName))
	err = r.replaceWitness(ctx, &f, acked)
	r.witnessMu.Unlock()
	if err != nil {
		return err
	}
	r.logf("fault %s: promoted after %.2fs (standby %d bytes behind at the kill); %d rows taken back by the promotion, %d held rows no witness reported",
		label, f.PromoteSeconds, f.LagBytes, f.TakenBack, f.Joined)

	limit := 2 * time.Minute
	for time.Since(promoted) < limit && ctx.Err() == nil {
		s, err := r.readSlot(ctx)
		if err != nil {
			return err
		}
		if s.exists && s.pid != 0 {
			f.OK = true
			break
		}
		time.Sleep(25 * time.Millisecond)
	}
	f.StreamingSeconds = time.Since(promoted).Seconds()
	if after, err := r.slotCreatedCount(ctx); err == nil && after == created {
		f.SlotPath = "survived"
	}
	r.mu.Lock()
	r.failovers = append(r.failovers, f)
	r.mu.Unlock()
	if f.OK && f.TakenBack > 0 {
		r.bit(kind)
	}
	r.logf("fault %s: a relay streams the slot on the new primary %.2fs after the promotion (ok %v, slot %s)", label, f.StreamingSeconds, f.OK, f.SlotPath)
	if !f.OK {
		return nil
	}
	// The first observation of G3 on the new history.
	return r.g3Check(ctx, label, 0)
}

// replaceWitness gives the ledger the new primary's history. The old
// witness (a test_decoding slot on the killed primary) is gone on every
// version: on 15 no logical slot survives a promotion, and on 17 making it
// a failover slot would not do either, because it read rows the promotion
// took back, a synced copy lags the standby's WAL and is not synced at all
// while the standby is cut off. So on both versions the new primary's table
// is the truth for what committed before the promotion: a new witness is
// created on the new primary through the replication protocol with an
// exported snapshot, the table is read in that snapshot (exactly the rows
// committed before the witness's consistent point) and every later commit
// reaches the witness. Rows the ledger knew that the table lacks were taken
// back; held rows it did not know join with the consistent point as their
// end LSN (see Ledger.Promote).
// Called with witnessMu held.
func (r *runner) replaceWitness(ctx context.Context, f *Failover, acked []string) error {
	deadline := time.Now().Add(time.Minute)
	for {
		held, at, err := r.snapshotWitness(ctx)
		if err == nil {
			r.witness = WitnessParser{}
			f.TakenBack, f.Joined = r.ledger.Promote(held, at, acked)
			return nil
		}
		if ctx.Err() != nil || time.Now().After(deadline) {
			return fmt.Errorf("witness on the new primary: %w", err)
		}
		r.logf("witness on the new primary: %v (retrying)", err)
		time.Sleep(500 * time.Millisecond)
	}
}

// snapshotWitness creates the witness slot on the current primary and reads
// the work ids committed before its consistent point. On an error after the
// slot was made it drops the slot, so that a retry starts over.
func (r *runner) snapshotWitness(ctx context.Context) (map[string]bool, pglogrepl.LSN, error) {
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cfg, err := pgconn.ParseConfig(r.db())
	if err != nil {
		return nil, 0, err
	}
	cfg.RuntimeParams["replication"] = "database"
	rc, err := pgconn.ConnectConfig(cctx, cfg)
	if err != nil {
		return nil, 0, err
	}
	defer rc.Close(context.Background())
	// A failed earlier attempt may have left it.
	_ = r.withDB(cctx, func(c *pgx.Conn) error {
		_, err := c.Exec(cctx, `SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1`, witnessSlot)
		return err
	})
	res, err := pglogrepl.CreateReplicationSlot(cctx, rc, witnessSlot, "test_decoding",
		pglogrepl.CreateReplicationSlotOptions{SnapshotAction: "EXPORT_SNAPSHOT", Mode: pglogrepl.LogicalReplication})
	if err != nil {
		return nil, 0, fmt.Errorf("create slot %s: %w", witnessSlot, err)
	}
	at, err := pglogrepl.ParseLSN(res.ConsistentPoint)
	if err != nil {
		return nil, 0, err
	}
	// The snapshot lives while rc runs no other command.
	held := map[string]bool{}
	err = func() error {
		c, err := pgx.Connect(cctx, r.db())
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		tx, err := c.BeginTx(cctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return err
		}
		defer tx.Rollback(context.Background()) //nolint:errcheck // read-only
		if _, err := tx.Exec(cctx, `SET TRANSACTION SNAPSHOT '`+res.SnapshotName+`'`); err != nil {
			return fmt.Errorf("import snapshot %s: %w", res.SnapshotName, err)
		}
		rows, err := tx.Query(cctx, `SELECT work_id FROM outbox`)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, id := range ids {
			held[id] = true
		}
		return err
	}()
	if err != nil {
		_ = rc.Exec(cctx, "DROP_REPLICATION_SLOT "+witnessSlot).Close()
		return nil, 0, fmt.Errorf("read the table in the witness's snapshot: %w", err)
	}
	return held, at, nil
}

// waitSlotSynced waits until the relay's slot is on the standby as a
// persisted synced slot (what survives a promotion).
func (r *runner) waitSlotSynced(ctx context.Context, sb *testenv.Postgres, limit time.Duration) bool {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		ok, err := func() (bool, error) {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			c, err := pgx.Connect(cctx, sb.URL(dbName))
			if err != nil {
				return false, err
			}
			defer c.Close(context.Background())
			var ok bool
			err = c.QueryRow(cctx, `SELECT coalesce(bool_or(synced AND NOT temporary), false) FROM pg_replication_slots WHERE slot_name = $1`, slotName).Scan(&ok)
			return ok, err
		}()
		if ok && err == nil {
			return true
		}
		time.Sleep(250 * time.Millisecond)
	}
	return false
}

// slotCreatedCount is how often the relay created its slot, from its own
// record (outbox_slots), which replicates to the standby: unchanged across
// a promotion means the failover slot survived it.
func (r *runner) slotCreatedCount(ctx context.Context) (int64, error) {
	var n int64
	err := r.withDB(ctx, func(c *pgx.Conn) error {
		err := c.QueryRow(ctx, `SELECT created_count FROM outbox_slots WHERE slot_name = $1`, slotName).Scan(&n)
		if errors.Is(err, pgx.ErrNoRows) {
			n = 0
			return nil
		}
		return err
	})
	return n, err
}
