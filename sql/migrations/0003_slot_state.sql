-- One row per replication slot the relay created for this table. The relay
-- sets backfill_pending before CREATE_REPLICATION_SLOT and clears it in the
-- same transaction that hands the rows committed before the slot's
-- consistent point to the poller (G9). A session that finds the slot with the
-- marker still set knows a crash (or a racing instance) interrupted that
-- handoff, and hands over every row still 'ready' instead: a duplicate is
-- dropped by its Nats-Msg-Id, a row committed while no slot existed is never
-- lost.
CREATE TABLE IF NOT EXISTS {{.Companion "slots"}} (
    slot_name           text        PRIMARY KEY,
    backfill_pending    boolean     NOT NULL DEFAULT false,
    pending_since       timestamptz,
    consistent_lsn      pg_lsn,
    backfilled_at       timestamptz,
    backfilled_rows     bigint,
    backfill_mode       text        CHECK (backfill_mode IN ('snapshot', 'all-ready')),
    created_count       integer     NOT NULL DEFAULT 0,
    invalidated_count   integer     NOT NULL DEFAULT 0,
    last_invalidated_at timestamptz
);
