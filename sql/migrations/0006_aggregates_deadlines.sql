-- outbox-relay: no-transaction
-- Order of work per aggregate (G12) and business deadlines (G13).
--
-- Statement by statement, each idempotent (internal/store/migrate.go has the
-- rules): on a populated table the index is built CONCURRENTLY and the
-- state check validated on its own, and neither blocks producers. (Applied
-- before issue 21 as one transaction that held the table's lock through
-- both; installs that have it keep it, and the result is the same.)
--
-- aggregate_type, aggregate_id: the business object a row's work belongs to;
-- aggregate_seq: the row's position in that object's sequence (1, 2, 3, ...),
-- assigned in the producer's transaction by <table>_next_seq(type, id) (or taken
-- from the business row's own version). All three or none: a row without
-- them is unordered.
ALTER TABLE {{.Table}}
    ADD COLUMN IF NOT EXISTS aggregate_type text,
    ADD COLUMN IF NOT EXISTS aggregate_id   text,
    ADD COLUMN IF NOT EXISTS aggregate_seq  bigint,
    -- The row is never published after this (decided on the database clock);
    -- it ends 'expired' instead.
    ADD COLUMN IF NOT EXISTS expires_at     timestamptz,
    DROP CONSTRAINT IF EXISTS {{.Name "aggregate_check"}},
    ADD CONSTRAINT {{.Name "aggregate_check"}} CHECK (
        (aggregate_type IS NULL) = (aggregate_id IS NULL)
        AND (aggregate_type IS NULL) = (aggregate_seq IS NULL)
        AND (aggregate_seq IS NULL OR aggregate_seq > 0)
        AND (aggregate_type IS NULL OR (aggregate_type <> '' AND aggregate_id <> ''
            AND octet_length(aggregate_type) <= 256 AND octet_length(aggregate_id) <= 1024
            AND aggregate_type !~ E'[\\x01-\\x1f\\x7f]' AND aggregate_type !~ E'^ | $'
            AND aggregate_id !~ E'[\\x01-\\x1f\\x7f]' AND aggregate_id !~ E'^ | $'))
    ) NOT VALID;

-- 'expired': a terminal state for rows whose deadline passed before they
-- were published. Swapped in one statement, so the table is never without
-- the check, and NOT VALID, so the swap is a catalog change; the validation
-- then reads the table under a lock producers do not wait for. Rows already
-- there passed the narrower check this replaces, so it finds none on a
-- table migrate created; on a table made by hand it may, and then migrate
-- fails naming them (the constraint stays NOT VALID).
ALTER TABLE {{.Table}}
    DROP CONSTRAINT IF EXISTS {{.Name "state_check"}},
    ADD CONSTRAINT {{.Name "state_check"}}
        CHECK (state IN ('ready', 'scheduled', 'running', 'published', 'failed', 'cancelled', 'expired')) NOT VALID;
ALTER TABLE {{.Table}} VALIDATE CONSTRAINT {{.Name "state_check"}};

-- One row per position of an aggregate. Partial: unordered rows do not pay
-- for it, and the CDC path's marks change none of its columns (HOT).
-- On a partitioned table a unique index must hold created_at, which would
-- make it unique per partition only: there it is a plain index, and a
-- position taken twice (an explicit Sequence used twice) is not refused
-- (docs/consumers.md).
CREATE {{if not .Partitioned}}UNIQUE {{end}}INDEX CONCURRENTLY IF NOT EXISTS {{.Name "aggregate_idx"}} ON {{.Table}} (aggregate_type, aggregate_id, aggregate_seq)
    WHERE aggregate_type IS NOT NULL;

-- The counter behind the sequence: one row per aggregate. Producers of one
-- aggregate serialize on its row (the aggregate's own transaction
-- protocol); different aggregates never wait on each other.
CREATE TABLE IF NOT EXISTS {{.Companion "aggregates"}} (
    aggregate_type text   NOT NULL,
    aggregate_id   text   NOT NULL,
    last_seq       bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- next_seq(type, id) takes the aggregate's next sequence in the caller's
-- transaction: a rollback gives it back with everything else. SECURITY
-- DEFINER so a producer needs EXECUTE only, not the counter table.
CREATE OR REPLACE FUNCTION {{.Companion "next_seq"}}(p_type text, p_id text) RETURNS bigint
    LANGUAGE sql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    INSERT INTO {{.Companion "aggregates"}} AS a (aggregate_type, aggregate_id, last_seq)
    VALUES (p_type, p_id, 1)
    ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_seq = a.last_seq + 1
    RETURNING a.last_seq
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "next_seq"}}(text, text) FROM PUBLIC;

-- A redrive of a row whose deadline passed gives it a new one or none, and
-- says which in its history row ('new: <time>', 'none'; NULL: unchanged).
ALTER TABLE {{.Companion "redrives"}} ADD COLUMN IF NOT EXISTS deadline text;

-- give_back_seq(type, id, seq) returns a sequence taken by a transaction
-- whose insert then found its work_id taken (a concurrent repeat), so the
-- aggregate keeps no gap. It only acts while seq is still the last one
-- handed out, which the caller's lock on the counter row guarantees.
CREATE OR REPLACE FUNCTION {{.Companion "give_back_seq"}}(p_type text, p_id text, p_seq bigint) RETURNS void
    LANGUAGE sql VOLATILE STRICT SECURITY DEFINER
    SET search_path = pg_catalog, pg_temp
AS $fn$
    UPDATE {{.Companion "aggregates"}} SET last_seq = last_seq - 1
    WHERE aggregate_type = p_type AND aggregate_id = p_id AND last_seq = p_seq
$fn$;
REVOKE ALL ON FUNCTION {{.Companion "give_back_seq"}}(text, text, bigint) FROM PUBLIC;
