-- outbox-relay: no-transaction
-- What the table metrics, the console, `status` and `prune` read, through an
-- index, so that their cost grows with the rows they show or delete, not
-- with the table (G16). None of these indexes may make the CDC path's mark
-- (ready -> published) a non-HOT update: PostgreSQL updates a row in place
-- (HOT) only when no column any index uses (key, expression or predicate)
-- changes value. The mark changes state, published_at, stream_seq and
-- stream_name, so no index here uses any of them: an index on state, or a
-- partial index WHERE state = ..., would make every mark write a new entry
-- into every index of the table (TestObserverIndexesKeepMarksHOT measures it).
--
-- The console's lists and prune walk rows in (created_at, work_id) order,
-- the keyset of their pages and batches. Neither column ever changes.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "created_idx"}} ON {{.Table}} (created_at, work_id);

-- parked: the state of a failed (dead-lettered), cancelled or expired row,
-- NULL in every other state. Those rows are few and are what an operator
-- looks at; ready and published look the same to it, so the mark leaves it
-- alone. Scheduled and running rows are found through poll_idx (poll_at).
-- A plain column, not a generated one: adding a stored generated column
-- rewrites the table under an exclusive lock.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS parked text;

-- Kept by the database, so that every writer (the relay's statements, the
-- operator's, a producer inserting a row already failed) gets it right. The
-- WHEN clauses are evaluated without calling the function: an update or
-- insert that leaves parked right (the mark, a claim, a producer's ready
-- row) pays one comparison. The insert trigger runs AFTER, which keeps
-- COPY's batched inserts (a BEFORE row trigger turns them off); it updates
-- the row it inserted, so it is SECURITY DEFINER: a producer needs INSERT
-- only.
CREATE OR REPLACE FUNCTION {{.Companion "park"}}() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        NEW.parked := CASE WHEN NEW.state IN ('failed', 'cancelled', 'expired') THEN NEW.state END;
        RETURN NEW;
    END IF;
    EXECUTE format('UPDATE %I.%I SET parked = state WHERE work_id = $1', TG_TABLE_SCHEMA, TG_TABLE_NAME) USING NEW.work_id;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "park"}}() FROM PUBLIC;

CREATE OR REPLACE TRIGGER {{.Name "park_upd"}}
    BEFORE UPDATE ON {{.Table}}
    FOR EACH ROW
    WHEN (NEW.parked IS DISTINCT FROM (CASE WHEN NEW.state IN ('failed', 'cancelled', 'expired') THEN NEW.state END))
    EXECUTE FUNCTION {{.Companion "park"}}();

CREATE OR REPLACE TRIGGER {{.Name "park_ins"}}
    AFTER INSERT ON {{.Table}}
    FOR EACH ROW
    WHEN (NEW.parked IS DISTINCT FROM (CASE WHEN NEW.state IN ('failed', 'cancelled', 'expired') THEN NEW.state END))
    EXECUTE FUNCTION {{.Companion "park"}}();

-- Rows parked before this migration. The update trigger sets the value.
UPDATE {{.Table}} SET parked = state WHERE state IN ('failed', 'cancelled', 'expired') AND parked IS NULL;

-- Counts, lists, recent failures and prune of parked rows: only those rows.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "parked_idx"}} ON {{.Table}} (parked, created_at, work_id) WHERE parked IS NOT NULL;

-- Dead letters of aggregates, for order per aggregate (G12): the held-set
-- refresh, the hand-back check and the ordered claim ask whether an
-- aggregate has a dead letter (below a sequence) through this index, never
-- through the aggregate's history. Its predicate is on parked, which a mark
-- never changes, so marks stay HOT.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "dead_letter_idx"}} ON {{.Table}} (aggregate_type, aggregate_id, aggregate_seq) INCLUDE (work_id)
    WHERE parked = 'failed' AND aggregate_type IS NOT NULL;
