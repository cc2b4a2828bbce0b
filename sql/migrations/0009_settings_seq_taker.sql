-- The settings every instance of a table shares (DESIGN.md, Several
-- instances). Ordering per aggregate (G12) keeps its held state in the table,
-- but the rule that honours it was only a process flag: one instance started
-- without --ordering aggregate claimed and published a held aggregate's later
-- rows before the earlier one. The first instance records its --ordering and
-- --on-publish here; every later one compares at start and refuses to run
-- with different ones. `outbox-relay migrate --record-settings` changes the
-- record (docs/upgrading.md, "Changing --ordering or --on-publish").
--
-- One row per table: the key is a constant. on_publish admits 'none' (G17) so
-- that policy needs no migration of this table when it comes.
CREATE TABLE IF NOT EXISTS {{.Companion "settings"}} (
    singleton   boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    ordering    text        NOT NULL CHECK (ordering IN ('none', 'aggregate')),
    on_publish  text        NOT NULL CHECK (on_publish IN ('mark', 'delete', 'none')),
    recorded_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    recorded_by text        NOT NULL
);

-- Only the transaction that took a sequence may give it back (issue 20).
-- give_back_seq is SECURITY DEFINER and the producer role may call it; it
-- acted whenever p_seq was the aggregate's last number, so any producer could
-- lower any aggregate's counter: the next enqueue then took a number a row
-- already has (a duplicate key for every later enqueue of the aggregate), or,
-- once that row was deleted or pruned, a number receivers had already seen.
--
-- next_seq now records the taking transaction (its top-level id, which a
-- savepoint does not change) beside the number, and give_back_seq acts only
-- for that transaction, only on its last number, and only while no row has
-- that number. The counter row stays locked by the taker until it ends, and a
-- transaction id is never reused, so no other transaction can match. A give
-- back forgets the taker: the number below belongs to an earlier transaction.
ALTER TABLE {{.Companion "aggregates"}} ADD COLUMN IF NOT EXISTS last_xid xid8;

CREATE OR REPLACE FUNCTION {{.Companion "next_seq"}}(p_type text, p_id text) RETURNS bigint
    LANGUAGE sql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    INSERT INTO {{.Companion "aggregates"}} AS a (aggregate_type, aggregate_id, last_seq, last_xid)
    VALUES (p_type, p_id, 1, pg_current_xact_id())
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = a.last_seq + 1, last_xid = pg_current_xact_id()
    RETURNING a.last_seq
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "next_seq"}}(text, text) FROM PUBLIC;

CREATE OR REPLACE FUNCTION {{.Companion "give_back_seq"}}(p_type text, p_id text, p_seq bigint) RETURNS void
    LANGUAGE sql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    UPDATE {{.Companion "aggregates"}} SET last_seq = last_seq - 1, last_xid = NULL
    WHERE aggregate_type = p_type AND aggregate_id = p_id AND last_seq = p_seq
      AND last_xid = pg_current_xact_id()
      AND NOT EXISTS (SELECT 1 FROM {{.Table}} o
                      WHERE o.aggregate_type = p_type AND o.aggregate_id = p_id AND o.aggregate_seq = p_seq)
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "give_back_seq"}}(text, text, bigint) FROM PUBLIC;
