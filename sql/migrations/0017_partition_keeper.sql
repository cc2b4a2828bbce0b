-- The partition keeper, without blocking producers (issue 30, item 8). On a
-- plain table this migration does nothing.
{{- if .Partitioned}}
--
-- guard_from and guard_to record the range of a guard: a CHECK on the
-- DEFAULT partition that no row of it falls in [guard_from, guard_to),
-- which lets ATTACH PARTITION skip its scan of the DEFAULT partition.
ALTER TABLE {{.Companion "partitioning"}}
    ADD COLUMN IF NOT EXISTS guard_from timestamptz,
    ADD COLUMN IF NOT EXISTS guard_to   timestamptz;

-- Creates the partitions from the current interval to `ahead` intervals
-- past it that do not exist yet, and the DEFAULT partition, attaches back
-- the partitions left detached, and says what it created and how many rows
-- the DEFAULT partition holds (counted up to 1,000,000). SECURITY DEFINER:
-- only the table's owner may create its partitions, and the relay, which
-- calls this every minute, does not own it.
--
-- One caller at a time: a second instance that finds the transaction lock
-- taken does nothing this round. Each partition is made as a table of its
-- own, with a CHECK of its bounds, and then attached: ATTACH PARTITION
-- takes SHARE UPDATE EXCLUSIVE on the table (producers' INSERTs go on),
-- where CREATE TABLE ... PARTITION OF took ACCESS EXCLUSIVE. It takes
-- ACCESS EXCLUSIVE on the DEFAULT partition, which every statement reading
-- the table through its root needs (package outbox's repeat check, the
-- relay's settles), and scans it for rows of the new range. While the
-- DEFAULT partition holds rows that scan is avoided in steps, one per
-- call, each its own transaction (store.AddPartitions calls again while a
-- guard is in place):
--   1. a guard, CHECK (created_at < guard_from OR created_at >= guard_to),
--      is added NOT VALID (a catalog change) over the missing intervals
--      that start two intervals or more from now, so that no producer's row
--      can be refused by it;
--   2. it is validated (SHARE UPDATE EXCLUSIVE: the scan blocks no one);
--      rows in its range make it fail, and it is dropped (those intervals
--      are held: they get no partition, as before);
--   3. the partitions in its range are attached, without a scan, and the
--      guard is dropped.
-- A guard left by an interrupted round is dropped once its range starts
-- less than two intervals from now, before it could refuse a row. The
-- current and next intervals, when missing while the DEFAULT partition
-- holds rows (a restart after a long stop), are attached with the scan.
CREATE OR REPLACE FUNCTION {{.Companion "add_partitions"}}(OUT created text[], OUT default_rows bigint)
    LANGUAGE plpgsql VOLATILE SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    sch    constant text := {{.SchemaLit}};
    tbl    constant text := {{.NameLit}};
    dflt   constant text := left({{.NameLit}} || '_default', 63);
    guard  constant text := left({{.NameLit}}, 50) || '_default_guard';
    step   bigint;
    n      integer;
    fmt    text;
    first  timestamptz;
    lo     timestamptz;
    hi     timestamptz;
    gfrom  timestamptz;
    gto    timestamptz;
    part   text;
    held   boolean;
    busy   boolean;
    gvalid boolean;
    orphan text;
    digits text;
BEGIN
    created := ARRAY[]::text[];
    SELECT p.interval_seconds, p.ahead, p.guard_from, p.guard_to INTO STRICT step, n, gfrom, gto FROM {{.Companion "partitioning"}} p;
    fmt := CASE WHEN step % 86400 = 0 THEN 'YYYYMMDD' WHEN step % 3600 = 0 THEN 'YYYYMMDDHH24' ELSE 'YYYYMMDDHH24MI' END;
    IF to_regclass(format('%I.%I', sch, dflt)) IS NULL THEN
        EXECUTE format('CREATE TABLE %I.%I PARTITION OF %I.%I DEFAULT WITH (fillfactor = 50)', sch, dflt, sch, tbl);
        created := created || dflt;
    END IF;
    -- Another caller is at work: this one reports the planner's estimate
    -- of the DEFAULT partition's rows rather than scan it, which would
    -- hold up that caller's requests for its lock, and every statement
    -- queued behind them.
    IF NOT pg_try_advisory_xact_lock(hashtextextended('outbox-relay partitions ' || {{.QualifiedLit}}, 0)) THEN
        SELECT greatest(c.reltuples, 0)::bigint INTO default_rows FROM pg_class c WHERE c.oid = format('%I.%I', sch, dflt)::regclass;
        RETURN;
    END IF;
    -- Counted before any lock that statements reading the table wait for.
    EXECUTE format('SELECT count(*) FROM (SELECT 1 FROM %I.%I LIMIT 1000000) d', sch, dflt) INTO default_rows;
    SELECT c.convalidated INTO gvalid FROM pg_constraint c
        WHERE c.conrelid = format('%I.%I', sch, dflt)::regclass AND c.conname = guard;
    first := to_timestamp(floor(extract(epoch FROM clock_timestamp()) / step) * step);
    -- A guard that could soon refuse a producer's row goes, whatever its
    -- step.
    IF gvalid IS NOT NULL AND (gfrom IS NULL OR gfrom < first + make_interval(secs => 2 * step)) THEN
        EXECUTE format('ALTER TABLE %I.%I DROP CONSTRAINT %I', sch, dflt, guard);
        UPDATE {{.Companion "partitioning"}} SET guard_from = NULL, guard_to = NULL;
        gvalid := NULL;
    END IF;
    -- Step 2: validate the guard added by the last call.
    IF gvalid = false THEN
        BEGIN
            EXECUTE format('ALTER TABLE %I.%I VALIDATE CONSTRAINT %I', sch, dflt, guard);
        EXCEPTION WHEN check_violation THEN
            EXECUTE format('ALTER TABLE %I.%I DROP CONSTRAINT %I', sch, dflt, guard);
            UPDATE {{.Companion "partitioning"}} SET guard_from = NULL, guard_to = NULL;
        END;
        RETURN;
    END IF;
    -- Partitions left detached (an interrupted prune of an earlier
    -- version, a detach by hand) are attached back: their rows belong in
    -- the table. Prune drops them when they hold nothing to keep.
    FOR orphan IN
        SELECT c.relname::text FROM pg_class c
        WHERE c.relnamespace = sch::regnamespace AND c.relkind = 'r' AND NOT c.relispartition
          AND starts_with(c.relname::text, tbl || '_p')
          AND substr(c.relname::text, length(tbl) + 3) ~ '^[0-9]{8}([0-9]{2}([0-9]{2})?)?$'
    LOOP
        digits := substr(orphan, length(tbl) + 3);
        lo := (to_timestamp(digits, left('YYYYMMDDHH24MI', CASE length(digits) WHEN 8 THEN 8 WHEN 10 THEN 12 ELSE 14 END))::timestamp) AT TIME ZONE 'UTC';
        BEGIN
            EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
                sch, tbl, sch, orphan, lo, lo + make_interval(secs => step));
            created := created || orphan;
        EXCEPTION WHEN OTHERS THEN
            RAISE WARNING 'partition % of %.% is left detached and could not be attached back: %', orphan, sch, tbl, SQLERRM;
        END;
    END LOOP;
    busy := default_rows > 0;
    -- Step 1: while the DEFAULT partition holds rows, guard the first run
    -- of missing intervals from two ahead that it holds no rows of.
    IF busy AND gvalid IS NULL THEN
        gfrom := NULL;
        FOR i IN 2..n LOOP
            lo := first + make_interval(secs => i * step);
            hi := lo + make_interval(secs => step);
            part := tbl || '_p' || to_char(lo AT TIME ZONE 'UTC', fmt);
            IF to_regclass(format('%I.%I', sch, part)) IS NOT NULL THEN
                EXIT WHEN gfrom IS NOT NULL;
                CONTINUE;
            END IF;
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I.%I WHERE created_at >= $1 AND created_at < $2)', sch, dflt)
                INTO held USING lo, hi;
            IF held THEN
                EXIT WHEN gfrom IS NOT NULL;
                CONTINUE;
            END IF;
            gfrom := coalesce(gfrom, lo);
            gto := hi;
        END LOOP;
        IF gfrom IS NOT NULL THEN
            EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (created_at < %L OR created_at >= %L) NOT VALID',
                sch, dflt, guard, gfrom, gto);
            UPDATE {{.Companion "partitioning"}} SET guard_from = gfrom, guard_to = gto;
            RETURN;
        END IF;
    END IF;
    -- Step 3 (and the only step while the DEFAULT partition is empty).
    FOR i IN 0..n LOOP
        lo := first + make_interval(secs => i * step);
        hi := lo + make_interval(secs => step);
        part := tbl || '_p' || to_char(lo AT TIME ZONE 'UTC', fmt);
        CONTINUE WHEN to_regclass(format('%I.%I', sch, part)) IS NOT NULL;
        IF busy THEN
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM %I.%I WHERE created_at >= $1 AND created_at < $2)', sch, dflt)
                INTO held USING lo, hi;
            CONTINUE WHEN held;
            -- From two ahead, only under a valid guard (the next call
            -- makes one); the current and next intervals with the scan.
            CONTINUE WHEN i >= 2 AND NOT (gvalid IS TRUE AND lo >= gfrom AND hi <= gto);
        END IF;
        EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED INCLUDING STORAGE) WITH (fillfactor = 50)',
            sch, part, sch, tbl);
        EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (created_at >= %L AND created_at < %L)',
            sch, part, left(part, 56) || '_bounds', lo, hi);
        EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
            sch, tbl, sch, part, lo, hi);
        created := created || part;
    END LOOP;
    IF gvalid IS TRUE THEN
        EXECUTE format('ALTER TABLE %I.%I DROP CONSTRAINT %I', sch, dflt, guard);
        UPDATE {{.Companion "partitioning"}} SET guard_from = NULL, guard_to = NULL;
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "add_partitions"}}() FROM PUBLIC;
{{- end}}
