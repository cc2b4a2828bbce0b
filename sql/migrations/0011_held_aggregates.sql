-- outbox-relay: no-transaction
-- The held set of ordering per aggregate (G12), readable without reading the
-- table (G16). An aggregate is held while one of its rows is with the poller
-- ('scheduled', 'running') or dead-lettered ('failed'). The statements that
-- ask (the relay's held-set refresh every second while one is held, the
-- ordered claim per candidate, the hand-back check, the blocked-aggregates
-- count) scanned the table or an aggregate's whole published history.
-- Dead letters are found through the parked column and dead_letter_idx
-- (0012). Indexes built CONCURRENTLY (internal/store/migrate.go's rules).
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
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "aggregate_held_idx"}} ON {{.Table}} (aggregate_type, aggregate_id, aggregate_seq) INCLUDE (work_id)
    WHERE poll_at IS NOT NULL AND aggregate_type IS NOT NULL;

-- The deadline sweep (ExpireDue) reads the rows with the poller whose
-- deadline passed, in deadline order, rather than every row with the poller.
CREATE INDEX CONCURRENTLY IF NOT EXISTS {{.Name "expires_idx"}} ON {{.Table}} (expires_at)
    WHERE poll_at IS NOT NULL AND expires_at IS NOT NULL;
