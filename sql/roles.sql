-- Least-privilege roles for outbox-relay on {{.Table}}.
-- Printed by `outbox-relay migrate --print-grants`; run it as the table's owner
-- (or a superuser) after `outbox-relay migrate`, for example:
--   outbox-relay migrate --print-grants | psql "$OWNER_DATABASE_URL"
-- Roles are created without passwords; set them out of band
-- (ALTER ROLE ... PASSWORD, or your secret manager), never in a file.
-- Safe to run again: existing roles are kept, grants are idempotent.

-- The relay: streams the slot (REPLICATION), marks or deletes rows, records
-- its slot and the backfill marker. It needs no ownership: migrate (run as
-- the owner) creates the table and the publication beforehand.
DO $do$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = {{.RelayLit}}) THEN
        CREATE ROLE {{.Relay}} LOGIN REPLICATION;
    ELSE
        ALTER ROLE {{.Relay}} LOGIN REPLICATION;
    END IF;
END $do$;
GRANT USAGE ON SCHEMA {{.Schema}} TO {{.Relay}};
GRANT SELECT, UPDATE, DELETE ON {{.Table}} TO {{.Relay}};
GRANT SELECT, INSERT, UPDATE ON {{.Companion "slots"}} TO {{.Relay}};

-- The producer: the application role that writes the outbox row in its own
-- transaction. INSERT, and SELECT of the columns package outbox compares when
-- a work_id is enqueued twice (RETURNING and the conflict check).
DO $do$ BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = {{.ProducerLit}}) THEN
        CREATE ROLE {{.Producer}} LOGIN;
    END IF;
END $do$;
GRANT USAGE ON SCHEMA {{.Schema}} TO {{.Producer}};
GRANT INSERT ON {{.Table}} TO {{.Producer}};
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
