-- Every redrive or cancel appends one row here: who, when, why, and what the
-- row looked like before (its state, attempts, generation and last error), so
-- a dead letter's history survives the next attempt overwriting the row.
CREATE TABLE IF NOT EXISTS {{.Companion "redrives"}} (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    work_id          text        NOT NULL,
    action           text        NOT NULL CHECK (action IN ('redrive', 'cancel')),
    at               timestamptz NOT NULL DEFAULT clock_timestamp(),
    by               text        NOT NULL,
    reason           text        NOT NULL CHECK (reason <> ''),
    previous_state   text        NOT NULL,
    previous_attempts integer    NOT NULL,
    previous_generation bigint   NOT NULL,
    previous_error   text
);

CREATE INDEX IF NOT EXISTS {{.Name "redrives_work_id_idx"}} ON {{.Companion "redrives"}} (work_id);
