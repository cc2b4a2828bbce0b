package relay

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outbox-relay/outbox-relay/replication"
)

// The slot's restart_lsn is where the next session's walsender starts
// decoding: every record after it, of every table and database, is read
// again before the first new commit. PostgreSQL moves it only when the
// walsender decodes a running-transactions record and the relay then
// confirms past it, and only to the record before the oldest transaction
// open at that record (under load, usually the record before). The server
// writes one every 15 s while WAL is written and at checkpoints; a relay
// restarted before it passes two of them decodes the earlier sessions' WAL
// again, round after round (issue 21: 23, 131, 214 MB). The relay writes
// the record itself: on PostgreSQL 16+ with pg_log_standby_snapshot()
// (granted by migrate --print-grants), while streaming when the slot holds
// more than restartLagTarget behind its confirmed position, and on a clean
// stop until restart_lsn has passed the position the stop began at. On 15
// (or without the grant) only the stop does, by creating a temporary
// logical slot, which writes the records with the REPLICATION attribute
// the relay has anyway; while streaming there the slot follows the
// server's own records (docs/deploy.md).

// Defaults of the restart position's upkeep.
const (
	// DefaultRestartCheck is how often a streaming relay compares the
	// slot's restart_lsn with its confirmed position: one read of
	// pg_replication_slots (shared memory, no table), and a record only
	// when the slot lags.
	DefaultRestartCheck = 10 * time.Second
	// restartLagTarget: WAL is removed a segment (16 MB by default) at a
	// time, so a restart_lsn less than that behind frees nothing, and each
	// record costs the walsender a snapshot file and the slot an fsync.
	restartLagTarget = 16 << 20
	// maxStopRecords bounds the records a stop writes: each one moves
	// restart_lsn to the one before it at best, and a transaction open
	// across them all (a long one anywhere in the database) holds it
	// wherever it is.
	maxStopRecords = 4
	// stopPassShare: the stop spends at most this share of
	// --drain-timeout streaming past its records; the rest is the drain's.
	stopPassShare = 2
)

// restartKeeper writes running-transactions records for one session.
type restartKeeper struct {
	r *Relay
	// record writes one (or more) and returns a position past it.
	record func(ctx context.Context) (replication.LSN, error)
	// streaming: also while streaming (keep), not only on a clean stop.
	streaming bool
}

// newRestartKeeper chooses how this session writes running-transactions
// records, and says once per process what follows when it cannot use
// pg_log_standby_snapshot().
func (r *Relay) newRestartKeeper(ctx context.Context) *restartKeeper {
	s, err := replication.ReadSnapshotSupport(ctx, r.pool)
	if err != nil {
		r.log.Warn().Err(err).Msg("could not read whether pg_log_standby_snapshot() may be called; not writing running-transactions records this session")
		return nil
	}
	if s.Allowed {
		return &restartKeeper{r: r, streaming: true, record: func(ctx context.Context) (replication.LSN, error) {
			return replication.LogStandbySnapshot(ctx, r.pool)
		}}
	}
	if r.snapshotNoteLogged.CompareAndSwap(false, true) {
		if s.Exists {
			r.log.Warn().Msg("the role may not execute pg_log_standby_snapshot(): while streaming, the slot's restart position follows only the server's own running-transactions records (every 15 s while busy), and a clean stop writes them by creating a temporary slot. " +
				"As a superuser: GRANT EXECUTE ON FUNCTION pg_catalog.pg_log_standby_snapshot() TO <relay role> (outbox-relay migrate --print-grants)")
		} else {
			r.log.Info().Msg("PostgreSQL 15 has no pg_log_standby_snapshot() (16+): while streaming, the slot's restart position follows the server's own running-transactions records (every 15 s while busy, and checkpoints); a clean stop writes them by creating a temporary slot")
		}
	}
	return &restartKeeper{r: r, record: r.recordByTemporarySlot}
}

// recordByTemporarySlot writes running-transactions records by creating
// (and dropping) a temporary logical slot, on a connection of its own that
// is closed afterwards: a temporary slot lives as long as its session, and
// one left behind on a pooled connection would hold WAL for hours.
func (r *Relay) recordByTemporarySlot(ctx context.Context) (replication.LSN, error) {
	conn, err := r.temporarySlotConn(ctx)
	if err != nil {
		return 0, err
	}
	// Closed in the background: a creation cancelled by ctx leaves the
	// connection busy, and a close that waits for it would hold the stop
	// past --drain-timeout (seen once under load: a 10.6 s stop). The
	// server drops the temporary slot when the session ends, or when the
	// creation fails at its statement_timeout.
	defer func() {
		go func() {
			cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = conn.Close(cctx)
		}()
	}()
	name := r.cfg.Slot
	if len(name) > 63-len(tempSlotSuffix) {
		name = name[:63-len(tempSlotSuffix)]
	}
	wait := tempSlotWait
	if d, ok := ctx.Deadline(); ok {
		wait = min(wait, time.Until(d))
	}
	return replication.LogSnapshotByTemporarySlot(ctx, conn, name+tempSlotSuffix, wait)
}

// temporarySlotConn is a session of its own for a temporary slot: one
// taken from the pool, or, when the statements go to another URL than the
// slot (--replication-database-url: a pooler), one opened on the slot's:
// closing a client's connection to a pooler does not end the server's
// session, so the temporary slot would outlive it there.
func (r *Relay) temporarySlotConn(ctx context.Context) (*pgx.Conn, error) {
	if !r.cfg.SeparateReplication {
		c, err := r.pool.Acquire(ctx)
		if err != nil {
			return nil, fmt.Errorf("acquire a connection for a temporary slot: %w", err)
		}
		return c.Hijack(), nil
	}
	cfg, err := pgx.ParseConfig(r.cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("parse --replication-database-url: %w", err)
	}
	if r.cfg.Password != nil {
		if cfg.Password, err = r.cfg.Password(ctx, cfg.Host, cfg.Port, cfg.User); err != nil {
			return nil, fmt.Errorf("connect for a temporary slot: %w", err)
		}
	}
	if r.cfg.AppName != "" {
		cfg.RuntimeParams["application_name"] = r.cfg.AppName
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to %s:%d for a temporary slot: %w", cfg.Host, cfg.Port, err)
	}
	return conn, nil
}

const (
	tempSlotSuffix = "_restart"
	// tempSlotWait bounds the temporary slot's wait for the transactions
	// open at its first record.
	tempSlotWait = 2 * time.Second
)

// slot reads the slot's positions as the server has them.
func (k *restartKeeper) slot(ctx context.Context) (replication.SlotInfo, error) {
	return replication.LookupSlot(ctx, k.r.pool, k.r.cfg.Slot)
}

// keep writes a record whenever restart_lsn lags the confirmed position by
// more than restartLagTarget, until ctx ends. One record per check is
// enough over time: each moves restart_lsn up to the one before it.
func (k *restartKeeper) keep(ctx context.Context) {
	t := time.NewTicker(k.r.cfg.RestartCheck)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		si, err := k.slot(ctx)
		if err != nil || !si.Exists {
			continue
		}
		if si.ConfirmedFlush < si.RestartLSN+restartLagTarget {
			continue
		}
		if _, err := k.record(ctx); err != nil && ctx.Err() == nil {
			k.r.log.Warn().Err(err).Msg("could not write a running-transactions record; the slot's restart position may lag")
		}
	}
}

// pass runs on a clean stop while the relay still streams: it writes
// records until the server has the relay's confirmation past them and
// restart_lsn has passed where the WAL ended when the stop began, or ctx
// ends. The stream sends confirmations promptly meanwhile.
func (k *restartKeeper) pass(ctx context.Context, stream *replication.Stream) {
	stream.ConfirmPromptly()
	log := k.r.log
	started := time.Now()
	target, err := replication.WALInsertPosition(ctx, k.r.pool)
	if err != nil {
		if ctx.Err() == nil {
			log.Warn().Err(err).Msg("stopping: could not read the WAL position; not moving the slot's restart position")
		}
		return
	}
	var si replication.SlotInfo
	for i := 0; i < maxStopRecords; i++ {
		rec, err := k.record(ctx)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn().Err(err).Msg("stopping: could not write a running-transactions record; the next start decodes more WAL again")
			}
			return
		}
		// Polled: the server has the confirmation once its
		// confirmed_flush_lsn shows it, and only then moves restart_lsn.
		for {
			if si, err = k.slot(ctx); err == nil && si.ConfirmedFlush >= rec {
				break
			}
			select {
			case <-ctx.Done():
				log.Info().Str("restart_lsn", si.RestartLSN.String()).Str("target", target.String()).
					Msg("stopping: the slot's restart position did not pass the stop's position in time; the next start decodes the WAL after it again")
				return
			case <-time.After(promptPoll):
			}
		}
		if si.RestartLSN >= target {
			log.Info().Str("restart_lsn", si.RestartLSN.String()).Int("records", i+1).Dur("took", time.Since(started)).
				Msg("stopping: the slot's restart position passed the WAL written before the stop")
			return
		}
	}
	log.Info().Str("restart_lsn", si.RestartLSN.String()).Str("target", target.String()).
		Msg("stopping: the slot's restart position stays behind the stop's position (a transaction open across the records holds it)")
}

// promptPoll paces pass's reads of the slot.
const promptPoll = 10 * time.Millisecond
