-- Least-privilege roles for outbox-relay on {{.Table}}.
-- Printed by `outbox-relay migrate --print-grants`; run it as the table's owner
-- (or a superuser) after `outbox-relay migrate`, for example:
--   outbox-relay migrate --print-grants | psql "$OWNER_DATABASE_URL"
-- Roles are created without passwords; set them out of band
-- (ALTER ROLE ... PASSWORD, or your secret manager), never in a file.
-- Safe to run again: existing roles are kept, grants are idempotent, and a
-- run over an older version of this script narrows what it granted before.

-- The relay: streams the slot (REPLICATION), marks or deletes rows, records
-- its slot and the backfill marker. It needs no ownership: migrate (run as
-- the owner) creates the table and the publication beforehand.
-- On Amazon RDS and Aurora no login may give the REPLICATION attribute: the
-- rds_replication role stands for it there (docs/managed-postgresql.md).
DO $do$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = {{.RelayLit}}) THEN
        CREATE ROLE {{.Relay}} LOGIN;
    ELSE
        ALTER ROLE {{.Relay}} LOGIN;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'rds_replication') THEN
        GRANT rds_replication TO {{.Relay}};
        RAISE NOTICE 'Amazon RDS or Aurora: % is given rds_replication, which stands for REPLICATION there', {{.RelayLit}};
    ELSE
        ALTER ROLE {{.Relay}} REPLICATION;
    END IF;
END $do$;
GRANT USAGE ON SCHEMA {{.Schema}} TO {{.Relay}};
GRANT SELECT, UPDATE, DELETE ON {{.Table}} TO {{.Relay}};
GRANT SELECT, INSERT, UPDATE ON {{.Companion "slots"}} TO {{.Relay}};
-- Read only, for the History page of `run --console`, which runs on this
-- role: the table's rows already carry their last redrive's who and why.
-- Redrive and cancel write the history, which stays the operator's.
GRANT SELECT ON {{.Companion "redrives"}} TO {{.Relay}};
-- The first instance records the table's --ordering and --on-publish; every
-- later one reads them. Changing them is the owner's (migrate
-- --record-settings), so no UPDATE.
GRANT SELECT, INSERT ON {{.Companion "settings"}} TO {{.Relay}};
-- PostgreSQL 16+: the relay writes a running-transactions record when the
-- slot's restart position lags, and on a clean stop, so that a restart
-- decodes seconds of WAL again, not everything since the server's last such
-- record (docs/deploy.md, "Restarts and the slot's restart position").
-- pg_log_standby_snapshot() is superuser-only unless granted, and only a
-- superuser (or a role holding it WITH GRANT OPTION) can grant it: run by
-- the table's owner alone, this step warns and grants nothing, and the relay
-- runs without it. PostgreSQL 15 has no such function: nothing to grant.
DO $do$ BEGIN
    IF to_regprocedure('pg_catalog.pg_log_standby_snapshot()') IS NULL THEN
        NULL;
    ELSIF has_function_privilege('pg_catalog.pg_log_standby_snapshot()', 'EXECUTE WITH GRANT OPTION') THEN
        EXECUTE format('GRANT EXECUTE ON FUNCTION pg_catalog.pg_log_standby_snapshot() TO %I', {{.RelayLit}});
    ELSE
        RAISE WARNING 'not granted: EXECUTE ON FUNCTION pg_catalog.pg_log_standby_snapshot() TO %: only a superuser can grant it (run that GRANT as one); without it a restart of the relay decodes more WAL again', {{.RelayLit}};
    END IF;
END $do$;

-- The producer: the application role that writes the outbox row in its own
-- transaction. INSERT only on the columns a producer means to set; every
-- other column keeps its default. A table-wide INSERT would let it write a row
-- already 'published' (with a made-up stream_seq) or 'running' under a lease
-- that never ends, rows that are never delivered and that no operator command
-- can cancel, or one with a forged redrive audit. The REVOKE first makes
-- a re-run on an install that had the table-wide grant end in the same state
-- (revoking a table privilege also revokes it on every column).
DO $do$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = {{.ProducerLit}}) THEN
        CREATE ROLE {{.Producer}} LOGIN;
    END IF;
END $do$;
GRANT USAGE ON SCHEMA {{.Schema}} TO {{.Producer}};
REVOKE INSERT ON {{.Table}} FROM {{.Producer}};
-- available_at is the producer's: a ready row due later is delayed delivery.
-- The aggregate and its sequence order the work (G12), expires_at is the
-- business deadline (G13); next_seq() hands out the sequence (it runs as its
-- owner, so the counter table needs no grant).
GRANT INSERT (work_id, kind, subject, payload, headers, available_at,
              aggregate_type, aggregate_id, aggregate_seq, expires_at) ON {{.Table}} TO {{.Producer}};
GRANT EXECUTE ON FUNCTION {{.Companion "next_seq"}}(text, text) TO {{.Producer}};
GRANT EXECUTE ON FUNCTION {{.Companion "give_back_seq"}}(text, text, bigint) TO {{.Producer}};
-- SELECT of what package outbox reads back: work_id for RETURNING and the
-- conflict target, kind, subject and payload to tell a repeat of the same
-- intention from a conflicting one. That lets any producer read every row's
-- payload: producers that must not read each other's work need separate
-- outbox tables (docs/security.md, Security). Not state, attempts or
-- errors: those are the relay's and the operator's.
GRANT SELECT (work_id, kind, subject, payload) ON {{.Table}} TO {{.Producer}};

-- The operator: runs status, redrive, cancel and prune. No REPLICATION.
DO $do$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = {{.OperatorLit}}) THEN
        CREATE ROLE {{.Operator}} LOGIN;
    END IF;
END $do$;
GRANT USAGE ON SCHEMA {{.Schema}} TO {{.Operator}};
GRANT SELECT, UPDATE, DELETE ON {{.Table}} TO {{.Operator}};
GRANT SELECT, INSERT ON {{.Companion "redrives"}} TO {{.Operator}};
GRANT SELECT ON {{.Companion "slots"}} TO {{.Operator}};

-- A partitioned table (migrate --partition-interval). Statements through
-- the table need only the table's grants above, whichever partition holds
-- the row, and every statement of the relay, the producers and the
-- operator's commands goes through the table; no partition needs a grant of
-- its own. The relay reads the interval and creates partitions ahead with
-- <table>_add_partitions(), which runs as the table's owner; package outbox
-- finds repeats with <table>_work_id_free(). Dropping a partition takes
-- the table's owner: run `prune` of a partitioned table as the owner (the
-- operator role above cannot). On a plain table these objects do not exist
-- and nothing is granted.
DO $do$ BEGIN
    IF to_regclass({{.CompanionLit "partitioning"}}) IS NOT NULL THEN
        EXECUTE format('GRANT SELECT ON %s TO %I, %I', {{.CompanionLit "partitioning"}}, {{.RelayLit}}, {{.OperatorLit}});
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s() TO %I', {{.CompanionLit "add_partitions"}}, {{.RelayLit}});
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s(text) TO %I', {{.CompanionLit "work_id_free"}}, {{.ProducerLit}});
    END IF;
END $do$;
