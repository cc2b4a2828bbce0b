-- The partition keeper holds the DEFAULT partition's lock for catalog
-- changes only (issue 30, item 8), and a round's first call drops a guard
-- an unfinished round left. 0017's function, replaced: a database migrated
-- with 0017 gets this one (CREATE OR REPLACE keeps its owner and grants).
-- On a plain table this migration does nothing.
{{- if .Partitioned}}
--
-- What changed from 0017: every due partition is first made as a table of
-- its own with its indexes (INCLUDING INDEXES: ATTACH adopts them instead
-- of building them) and a CHECK of its bounds, and only then attached; the
-- ACCESS EXCLUSIVE lock ATTACH takes on the DEFAULT partition, held to the
-- commit, no longer covers the creation of tables and indexes (about 30 ms
-- a partition). Under a guard, one partition is attached a call (the
-- caller calls again while the guard is there), and the guard goes once
-- none under it is left. The first call of a round (store.AddPartitions
-- sets outbox_relay.fresh_round) drops any guard: it was left by a round
-- that did not finish.
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
    parts  text[];
    los    timestamptz[];
    more   boolean := false;
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
    -- step; so does any guard at the first call of a round (the caller
    -- sets outbox_relay.fresh_round for it, store.AddPartitions): it was
    -- left by a round that did not finish (a process killed between its
    -- calls, a lost connection), and no later call of that round would
    -- drop it before its range comes due and it refuses producers' rows.
    IF gvalid IS NOT NULL AND (coalesce(current_setting('outbox_relay.fresh_round', true), '') = 'on' OR gfrom IS NULL OR gfrom < first + make_interval(secs => 2 * step)) THEN
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
    -- Every partition is first made as a table of its own, with its
    -- indexes (INCLUDING INDEXES: ATTACH then adopts them instead of
    -- building them) and a CHECK of its bounds; only then are they all
    -- attached, one statement each: the ACCESS EXCLUSIVE lock ATTACH takes
    -- on the DEFAULT partition, held to the commit, covers catalog changes
    -- only, not the creation of tables and indexes (which held it about
    -- 30 ms a partition).
    parts := ARRAY[]::text[];
    los := ARRAY[]::timestamptz[];
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
            -- One a call under the guard, which stays (the caller calls
            -- again while it is there): an ATTACH holds the DEFAULT
            -- partition's lock for about 10 ms to the commit, and those of
            -- one call would add up.
            IF i >= 2 AND coalesce(array_length(parts, 1), 0) >= 1 THEN
                more := true;
                EXIT;
            END IF;
        END IF;
        EXECUTE format('CREATE TABLE %I.%I (LIKE %I.%I INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING GENERATED INCLUDING STORAGE INCLUDING INDEXES) WITH (fillfactor = 50)',
            sch, part, sch, tbl);
        EXECUTE format('ALTER TABLE %I.%I ADD CONSTRAINT %I CHECK (created_at >= %L AND created_at < %L)',
            sch, part, left(part, 56) || '_bounds', lo, hi);
        parts := parts || part;
        los := los || lo;
    END LOOP;
    FOR i IN 1..coalesce(array_length(parts, 1), 0) LOOP
        EXECUTE format('ALTER TABLE %I.%I ATTACH PARTITION %I.%I FOR VALUES FROM (%L) TO (%L)',
            sch, tbl, sch, parts[i], los[i], los[i] + make_interval(secs => step));
        created := created || parts[i];
    END LOOP;
    -- The guard goes once no partition under it is left to attach.
    IF gvalid IS TRUE AND NOT more THEN
        EXECUTE format('ALTER TABLE %I.%I DROP CONSTRAINT %I', sch, dflt, guard);
        UPDATE {{.Companion "partitioning"}} SET guard_from = NULL, guard_to = NULL;
    END IF;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "add_partitions"}}() FROM PUBLIC;
{{- end}}
