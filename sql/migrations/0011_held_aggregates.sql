-- The held set of ordering per aggregate (G12), readable without reading the
-- table (G16). An aggregate is held while one of its rows is with the poller
-- ('scheduled', 'running') or dead-lettered ('failed'). The statements that
-- ask (the relay's held-set refresh every second while one is held, the
-- ordered claim per candidate, the hand-back check, the blocked-aggregates
-- count) scanned the table or an aggregate's whole published history.
--
-- No index here mentions state, published_at, stream_seq, stream_name or
-- last_error: the CDC path's mark (ready -> published) changes those, and a
-- change to any column an index reads, in its key or in its predicate, makes
-- the update non-HOT (a new entry in every index; measured in
-- TestCDCMarksStayHOT: an index on state turns about every mark non-HOT).
--
-- Rows with the poller: poll_at is set exactly for 'scheduled' and 'running'
-- rows (0001) and a mark never changes it, so a partial index on it holds
-- the aggregates' rows with the poller and nothing else. work_id is
-- included so the held set is read from the index alone (an index-only
-- scan): the planner cannot know that few of the poller's rows have an
-- aggregate (it multiplies the two NULL fractions), and with the heap to
-- visit either way it preferred walking poll_idx, every delayed row of the
-- backlog, to this index.
CREATE INDEX IF NOT EXISTS {{.Name "aggregate_held_idx"}} ON {{.Table}} (aggregate_type, aggregate_id, aggregate_seq) INCLUDE (work_id)
    WHERE poll_at IS NOT NULL AND aggregate_type IS NOT NULL;

-- The deadline sweep (ExpireDue) reads the rows with the poller whose
-- deadline passed, in deadline order, rather than every row with the poller.
CREATE INDEX IF NOT EXISTS {{.Name "expires_idx"}} ON {{.Table}} (expires_at)
    WHERE poll_at IS NOT NULL AND expires_at IS NOT NULL;

-- Dead letters: no column a mark leaves alone tells a 'failed' row from a
-- 'ready' one, so they are listed here, one row per row of the outbox in
-- state 'failed' (with an aggregate or not), kept by the triggers below in
-- the transaction that moves the row. Rows reach and leave 'failed' rarely
-- (a dead letter, its redrive or cancel), and the triggers' WHEN clauses are
-- evaluated without calling the function: a mark, a claim or an insert in
-- any other state pays one comparison. Readers join each entry back to the
-- outbox row by its key and check the row's state there: the table is the
-- truth, an entry the outbox no longer confirms is ignored.
CREATE TABLE IF NOT EXISTS {{.Companion "dead_letters"}} (
    work_id        text   PRIMARY KEY,
    aggregate_type text,
    aggregate_id   text,
    aggregate_seq  bigint
);

CREATE INDEX IF NOT EXISTS {{.Name "dead_letters_agg_idx"}} ON {{.Companion "dead_letters"}} (aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_type IS NOT NULL;

-- SECURITY DEFINER: the relay, the operator and producers change rows of the
-- outbox and need no privilege on the list.
CREATE OR REPLACE FUNCTION {{.Companion "track_dead_letters"}}() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        TRUNCATE {{.Companion "dead_letters"}};
        RETURN NULL;
    END IF;
    IF TG_OP IN ('UPDATE', 'DELETE') THEN
        DELETE FROM {{.Companion "dead_letters"}} WHERE work_id = OLD.work_id;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.state = 'failed' THEN
        INSERT INTO {{.Companion "dead_letters"}} AS d (work_id, aggregate_type, aggregate_id, aggregate_seq)
        VALUES (NEW.work_id, NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_seq)
        ON CONFLICT (work_id) DO UPDATE SET aggregate_type = EXCLUDED.aggregate_type,
            aggregate_id = EXCLUDED.aggregate_id, aggregate_seq = EXCLUDED.aggregate_seq;
    END IF;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "track_dead_letters"}}() FROM PUBLIC;

CREATE OR REPLACE TRIGGER {{.Name "dead_letters_insert"}}
    AFTER INSERT ON {{.Table}}
    FOR EACH ROW WHEN (NEW.state = 'failed')
    EXECUTE FUNCTION {{.Companion "track_dead_letters"}}();

CREATE OR REPLACE TRIGGER {{.Name "dead_letters_update"}}
    AFTER UPDATE ON {{.Table}}
    FOR EACH ROW WHEN ((OLD.state = 'failed' OR NEW.state = 'failed')
        AND (OLD.state, OLD.work_id, OLD.aggregate_type, OLD.aggregate_id, OLD.aggregate_seq)
            IS DISTINCT FROM (NEW.state, NEW.work_id, NEW.aggregate_type, NEW.aggregate_id, NEW.aggregate_seq))
    EXECUTE FUNCTION {{.Companion "track_dead_letters"}}();

CREATE OR REPLACE TRIGGER {{.Name "dead_letters_delete"}}
    AFTER DELETE ON {{.Table}}
    FOR EACH ROW WHEN (OLD.state = 'failed')
    EXECUTE FUNCTION {{.Companion "track_dead_letters"}}();

CREATE OR REPLACE TRIGGER {{.Name "dead_letters_trunc"}}
    AFTER TRUNCATE ON {{.Table}}
    FOR EACH STATEMENT
    EXECUTE FUNCTION {{.Companion "track_dead_letters"}}();

-- The dead letters from before this migration, read once: a scan of the
-- whole table, which may run in a transaction of its own after the one that
-- creates the triggers (it needs no lock beyond a read's). After the
-- triggers, so a row that fails meanwhile is listed by its trigger (a
-- conflict here leaves that entry); one that leaves 'failed' meanwhile may
-- be listed from this read's snapshot, and readers ignore it.
INSERT INTO {{.Companion "dead_letters"}} (work_id, aggregate_type, aggregate_id, aggregate_seq)
    SELECT work_id, aggregate_type, aggregate_id, aggregate_seq FROM {{.Table}} WHERE state = 'failed'
    ON CONFLICT (work_id) DO NOTHING;
