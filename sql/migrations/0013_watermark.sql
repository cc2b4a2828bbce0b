-- What --on-publish none needs (G17): the CDC path writes nothing for a row
-- it publishes, so whether a 'ready' row was published is derived from a
-- watermark the relay records in <table>_slots: a snapshot of the database
-- (pg_current_snapshot()) and the WAL insert position read after it, kept
-- once the slot's confirmed position has passed that position. Every
-- transaction the snapshot sees as finished committed before the position,
-- was streamed and settled: a 'ready' row whose transaction the watermark
-- sees is published. docs/design-watermark.md, "The watermark", gives the proof.
--
-- xact_id: the inserting transaction's top-level id, as a 64-bit xid8.
-- Not xmin: a row inserted inside a savepoint or a PL/pgSQL exception block
-- has a subtransaction's id as xmin, which pg_visible_in_snapshot cannot
-- judge (a snapshot lists top-level transactions only); xmin is also 32
-- bits (wraparound) and is replaced by FrozenTransactionId when the row is
-- frozen. A column with no default is added without rewriting the table;
-- the default then applies to new rows only. Rows from before this
-- migration keep NULL: the CDC path marks them 'published' as the mark
-- policy does, so they never look in flight forever.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS xact_id xid8;
ALTER TABLE {{.Table}} ALTER COLUMN xact_id SET DEFAULT pg_current_xact_id();

-- A producer that writes xact_id itself (a copy of rows from another table,
-- a careless or hostile INSERT) would otherwise claim any transaction's
-- coverage for its row. The insert trigger of 0012 (AFTER, so COPY keeps
-- its batched inserts) also puts the inserting transaction's id back; its
-- WHEN clause keeps the common insert, whose default is right, at one
-- comparison.
CREATE OR REPLACE FUNCTION {{.Companion "park"}}() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        NEW.parked := CASE WHEN NEW.state IN ('failed', 'cancelled', 'expired') THEN NEW.state END;
        RETURN NEW;
    END IF;
    EXECUTE format('UPDATE %I.%I SET parked = state, xact_id = pg_current_xact_id() WHERE work_id = $1', TG_TABLE_SCHEMA, TG_TABLE_NAME) USING NEW.work_id;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "park"}}() FROM PUBLIC;

CREATE OR REPLACE TRIGGER {{.Name "park_ins"}}
    AFTER INSERT ON {{.Table}}
    FOR EACH ROW
    WHEN (NEW.parked IS DISTINCT FROM (CASE WHEN NEW.state IN ('failed', 'cancelled', 'expired') THEN NEW.state END)
        OR NEW.xact_id IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION {{.Companion "park"}}();

-- The watermark, per slot: the newest one of any slot of the table is the
-- one that counts (a later snapshot sees everything an earlier one saw).
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS watermark_snapshot pg_snapshot;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS watermark_lsn pg_lsn;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS watermark_at timestamptz;
