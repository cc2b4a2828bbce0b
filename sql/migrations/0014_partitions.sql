-- The partitions of a table created with `migrate --partition-interval`
-- (DESIGN.md, Partitioned table); on a plain table this migration does
-- nothing.
{{- if .Partitioned}}
--
-- The interval is recorded here, once, for the relay and prune to read:
-- partitions are ranges [lo, lo + interval) of created_at, aligned to the
-- Unix epoch in UTC (a 1d interval starts each partition at 00:00 UTC), and
-- named <table>_pYYYYMMDD (whole days), _pYYYYMMDDHH (whole hours) or
-- _pYYYYMMDDHHMI. ahead is how many intervals past the current one are kept
-- created: at least a day and an interval (below an hour, 25 intervals;
-- store.PartitionsAhead), so that a relay stopped for a day leaves
-- producers partitions to insert into (the operator may raise it: UPDATE
-- <table>_partitioning SET ahead = ...). Intervals from 5 minutes; 0015
-- relaxes the CHECK of tables made when the floor was an hour.
CREATE TABLE IF NOT EXISTS {{.Companion "partitioning"}} (
    singleton        boolean     PRIMARY KEY DEFAULT true CHECK (singleton),
    interval_seconds bigint      NOT NULL CHECK (interval_seconds >= 300 AND interval_seconds % 60 = 0),
    ahead            integer     NOT NULL CHECK (ahead >= 2),
    recorded_at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
INSERT INTO {{.Companion "partitioning"}} (interval_seconds, ahead)
    VALUES ({{.IntervalSeconds}}, {{.Ahead}}) ON CONFLICT (singleton) DO NOTHING;

-- Creates the partitions from the current interval to `ahead` intervals
-- past it that do not exist yet, and the DEFAULT partition, and says what
-- it created and how many rows the DEFAULT partition holds (counted up to
-- 1,000,000). SECURITY DEFINER: only the table's owner may create its
-- partitions, and the relay, which calls this every minute, does not own
-- it. The DEFAULT partition is the safety net: a row whose partition was
-- never made (the relay and migrate both stopped for longer than `ahead`
-- intervals) lands there instead of failing the producer's transaction.
-- An interval whose rows are already in the DEFAULT partition gets no
-- partition of its own (creating it would fail on those rows); prune never
-- drops the DEFAULT partition.
--
-- CREATE TABLE ... PARTITION OF takes ACCESS EXCLUSIVE on the table for the
-- catalog change: the caller bounds the wait with lock_timeout (migrate's
-- --lock-timeout; the relay's one second), and a call that gave up is
-- repeated a minute later, long before the partition is needed.
CREATE OR REPLACE FUNCTION {{.Companion "add_partitions"}}(OUT created text[], OUT default_rows bigint)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    sch   constant text := {{.SchemaLit}};
    tbl   constant text := {{.NameLit}};
    dflt  constant text := left({{.NameLit}} || '_default', 63);
    step  bigint;
    n     integer;
    fmt   text;
    first timestamptz;
    lo    timestamptz;
    hi    timestamptz;
    part  text;
    held  boolean;
BEGIN
    created := ARRAY[]::text[];
    SELECT p.interval_seconds, p.ahead INTO STRICT step, n FROM {{.Companion "partitioning"}} p;
    fmt := CASE WHEN step % 86400 = 0 THEN 'YYYYMMDD' WHEN step % 3600 = 0 THEN 'YYYYMMDDHH24' ELSE 'YYYYMMDDHH24MI' END;
    IF to_regclass(format('%I.%I', sch, dflt)) IS NULL THEN
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I DEFAULT WITH (fillfactor = 50)', sch, dflt, sch, tbl);
        created := created || dflt;
    END IF;
    first := to_timestamp(floor(extract(epoch FROM clock_timestamp()) / step) * step);
    FOR i IN 0..n LOOP
        lo := first + make_interval(secs => i * step);
        hi := lo + make_interval(secs => step);
        part := tbl || '_p' || to_char(lo AT TIME ZONE 'UTC', fmt);
        CONTINUE WHEN to_regclass(format('%I.%I', sch, part)) IS NOT NULL;
        EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I.%I WHERE created_at >= $1 AND created_at < $2)', sch, dflt)
            INTO held USING lo, hi;
        CONTINUE WHEN held;
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I FOR VALUES FROM (%L) TO (%L) WITH (fillfactor = 50)',
            sch, part, sch, tbl, lo, hi);
        created := created || part;
    END LOOP;
    EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %I.%I LIMIT 1000000) d', sch, dflt) INTO default_rows;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "add_partitions"}}() FROM PUBLIC;

-- Repeats (docs/consumers.md): a partitioned table cannot have a unique
-- index on work_id alone, so package outbox inserts a row only where this
-- returns true, in the same statement. It waits for the transaction lock
-- of (table, work_id), which every enqueue of that work_id takes and holds
-- until its transaction ends, then looks for the work_id in every
-- partition. In READ COMMITTED each statement of a VOLATILE function takes
-- a new snapshot, so the look happens after the lock was granted and sees a
-- row that a concurrent enqueue committed while this one waited; a
-- concurrent enqueue that rolled back left nothing to see. Two hashes, not
-- one: the two-key advisory locks are a space of their own, apart from
-- migrate's one-key lock. In REPEATABLE READ the look uses the
-- transaction's snapshot, which cannot see a repeat committed after it:
-- when the lock had to be waited for, the function fails with a
-- serialization failure (40001), as a unique index would, and the caller
-- retries. SECURITY DEFINER: it reads work_id, which the producer may read
-- anyway (sql/roles.sql).
CREATE OR REPLACE FUNCTION {{.Companion "work_id_free"}}(p_work_id text) RETURNS boolean
    LANGUAGE plpgsql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext({{.QualifiedLit}}), hashtext(p_work_id)) THEN
        PERFORM pg_advisory_xact_lock(hashtext({{.QualifiedLit}}), hashtext(p_work_id));
        IF current_setting('transaction_isolation') = 'repeatable read' THEN
            RAISE EXCEPTION 'could not serialize access due to a concurrent enqueue of work_id %', p_work_id
                USING ERRCODE = 'serialization_failure';
        END IF;
    END IF;
    RETURN NOT EXISTS (SELECT 1 FROM {{.Table}} WHERE work_id = p_work_id);
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "work_id_free"}}(text) FROM PUBLIC;

SELECT {{.Companion "add_partitions"}}();
{{- end}}
