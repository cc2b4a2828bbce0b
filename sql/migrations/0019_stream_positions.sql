-- Positions, not times (issue 41, G18). Every read of the stream starts at a
-- stream sequence recorded before the publishes it has to find, so that no
-- read depends on the clocks of PostgreSQL, the relay and the broker
-- agreeing, and a restart reads back only what can replay.
--
-- <table>_slots: with the confirmation bound the relay already records
-- (0016), the position its messages were stored after: every message of a
-- transaction committed at or past position_lsn is in stream
-- position_stream (created at position_created: a stream created again
-- starts its sequences over) at a sequence past position_seq. A session
-- whose slot starts at or past position_lsn reads back from position_seq.
-- The pair recorded before it stays as position_prev_*: a relay stopped
-- between recording a pair and confirming it starts from the one before.
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_lsn pg_lsn;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_seq bigint;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_prev_lsn pg_lsn;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_prev_seq bigint;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_stream text;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS position_created timestamptz;

-- lookup_seq: on a row the poller claimed, the own stream's sequence that
-- any message of this row published since was stored after (set at the
-- first claim that may publish it, kept across reclaims, reschedules and
-- redrives). A row claimed again with lookup_seq set may have been stored
-- by an earlier claim the table does not know the outcome of (an expired
-- lease, an uncertain ack, a loss the broker reported): it is looked up
-- from there before it is sent again. NULL: no publish of the row can be
-- stored without the table knowing. Not indexed, so the marks stay HOT.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS lookup_seq bigint;
