-- outbox-relay: no-transaction
-- (Each statement on its own, so that the index below is built
-- CONCURRENTLY: on a table that already exists and holds rows, a plain
-- CREATE INDEX would block every INSERT while it builds. Both statements
-- are idempotent; internal/store/migrate.go has the rules.)
--
-- The outbox table. Applications insert rows in the same transaction as the
-- business change; the relay streams the committed INSERTs from a logical
-- replication slot and falls back to a leased-claim poller for retries.
CREATE TABLE IF NOT EXISTS {{.Table}} (
    work_id          text        NOT NULL CHECK (work_id <> ''),
    kind             text        NOT NULL CHECK (kind <> ''),
    subject          text,
    payload          {{.PayloadType}} NOT NULL,
    headers          jsonb       CHECK (headers IS NULL OR jsonb_typeof(headers) = 'object'),
    state            text        NOT NULL DEFAULT 'ready'
                     CHECK (state IN ('ready', 'scheduled', 'running', 'published', 'failed', 'cancelled')),
    created_at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts         integer     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    claim_generation bigint      NOT NULL DEFAULT 0,
    claimed_by       text,
    lease_until      timestamptz,
    published_at     timestamptz,
    stream_seq       bigint,
    last_error       text,
    redriven_at      timestamptz,
    redriven_by      text,
    redrive_reason   text,
    -- The poller's index key. It is derived from state and available_at, so
    -- producers never set it, and it stays NULL for ready and published rows:
    -- the CDC path's ready -> published marks change no indexed value and can
    -- be HOT updates. lease_until is deliberately not part of it, so lease
    -- renewals are HOT too.
    poll_at          timestamptz GENERATED ALWAYS AS (
                         CASE WHEN state IN ('scheduled', 'running') THEN available_at END
                     ) STORED,
    CONSTRAINT {{.Name "lease_check"}} CHECK (
        (state = 'running') = (claimed_by IS NOT NULL AND lease_until IS NOT NULL)
    ),
{{- if .Partitioned}}
    -- Partitioned by created_at (migrate --partition-interval): a primary
    -- key must hold the partition key, so work_id alone is not unique here;
    -- package outbox finds repeats across the partitions instead
    -- (docs/consumers.md). The partitions come with 0014.
    PRIMARY KEY (work_id, created_at)
) PARTITION BY RANGE (created_at);
{{- else}}
    PRIMARY KEY (work_id)
);
{{- end}}

-- Serves exactly the poller's claim: scheduled or running rows by due time.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "poll_idx"}} ON {{.Table}} (poll_at) WHERE poll_at IS NOT NULL;
