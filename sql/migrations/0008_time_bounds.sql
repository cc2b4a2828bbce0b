-- A producer's times must be ones every path, command and page can read the
-- same way: available_at, expires_at and created_at between 0001-01-01 and
-- 9999-12-31 (UTC), what RFC 3339 (Outbox-Expires-At) can write. Refused
-- at insert: 'infinity' and '-infinity' (a pgx client cannot even read them
-- into a time), and years past 9999 (no RFC 3339 form; the inbox would call
-- the header malformed). Package outbox applies the same rule in Enqueue.
--
-- A trigger on INSERT, not a CHECK: a NOT VALID CHECK skips the rows already
-- in the table only until they are next updated, and every move of a row
-- is an update (the CDC path's settle, a claim, the deadline sweep, cancel).
-- An old row with 'infinity' would then make each of those statements fail
-- with a check violation, the whole batch with it, and cancel could not free
-- the aggregate behind it. Old rows are handled where they are read (the
-- relay rejects a deadline it cannot write, the sweep and the operator
-- commands accept infinite values). The WHEN clause is evaluated without
-- calling the function, and an AFTER row trigger leaves COPY's batching on:
-- a valid insert pays one comparison per column.
CREATE OR REPLACE FUNCTION {{.Companion "refuse_times"}}() RETURNS trigger
    LANGUAGE plpgsql
    SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    col text;
    val timestamptz;
BEGIN
    FOREACH col IN ARRAY ARRAY['available_at', 'expires_at', 'created_at'] LOOP
        val := CASE col WHEN 'available_at' THEN NEW.available_at WHEN 'expires_at' THEN NEW.expires_at ELSE NEW.created_at END;
        IF val IS NOT NULL AND NOT (val >= '0001-01-01 00:00:00+00' AND val < '10000-01-01 00:00:00+00') THEN
            RAISE EXCEPTION 'outbox row %: % % is out of range', NEW.work_id, col, val::text
                USING ERRCODE = 'check_violation',
                      DETAIL = 'A time must be finite and between 0001-01-01 and 9999-12-31 (UTC): what RFC 3339, and so Outbox-Expires-At, can carry.',
                      HINT = 'For no deadline leave expires_at NULL; for "deliver now" leave available_at to its default.';
        END IF;
    END LOOP;
    RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "refuse_times"}}() FROM PUBLIC;

CREATE TRIGGER {{.Name "times_check"}}
    AFTER INSERT ON {{.Table}}
    FOR EACH ROW
    WHEN (NOT (NEW.available_at >= '0001-01-01 00:00:00+00' AND NEW.available_at < '10000-01-01 00:00:00+00'
        AND (NEW.expires_at IS NULL OR (NEW.expires_at >= '0001-01-01 00:00:00+00' AND NEW.expires_at < '10000-01-01 00:00:00+00'))
        AND (NEW.created_at >= '0001-01-01 00:00:00+00' AND NEW.created_at < '10000-01-01 00:00:00+00')))
    EXECUTE FUNCTION {{.Companion "refuse_times"}}();
