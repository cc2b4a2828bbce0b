-- Whose slot and whose watermark (issue 30, items 2 to 4). A row of
-- <table>_slots is plain data: pg_dump copies it into another cluster, and
-- a slot of the same name can be dropped, re-created or advanced by hand
-- behind the relay's back. So the relay records what makes its slot and
-- its watermark its own, and trusts neither without it:
--
-- system_identifier, slot_lsn: the cluster (pg_control_system()) on which
-- the relay created the slot, and the slot's consistent point there. A
-- slot re-created under the same name has another consistent point; a
-- physical standby shares its primary's identifier, so a failover slot
-- synced to it stays the relay's after a promotion.
--
-- confirm_bound: the highest position the relay may have confirmed to that
-- slot, raised before each status update that goes past it
-- (replication.BoundSlack). A slot whose confirmed_flush_lsn is beyond it
-- was moved by someone else (pg_replication_slot_advance, or a re-creation
-- the relay did not do).
--
-- watermark_system_identifier, watermark_timeline: the cluster and the
-- timeline (pg_control_checkpoint()) on which the watermark was recorded. A
-- watermark counts only on the cluster that recorded it, on that timeline
-- or a later one (a promoted standby continues its primary's history), and
-- when its position exists there.
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS system_identifier bigint;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS slot_lsn pg_lsn;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS confirm_bound pg_lsn;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS watermark_system_identifier bigint;
ALTER TABLE {{.Companion "slots"}} ADD COLUMN IF NOT EXISTS watermark_timeline integer;

-- A watermark recorded before this migration is kept where its slot exists
-- in this database and has confirmed past it: then it was recorded here.
-- Any other (a copy restored from another cluster, whose slots a dump does
-- not carry) stays unstamped and is ignored: at worst the rows it covered
-- are handed over, and published, again after a slot loss.
UPDATE {{.Companion "slots"}} AS t
SET watermark_system_identifier = (SELECT system_identifier FROM pg_catalog.pg_control_system()),
    watermark_timeline = (SELECT timeline_id FROM pg_catalog.pg_control_checkpoint())
WHERE t.watermark_lsn IS NOT NULL AND t.watermark_system_identifier IS NULL
  AND EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots AS r
      WHERE r.slot_name = t.slot_name AND r.database = current_database() AND r.confirmed_flush_lsn >= t.watermark_lsn);

-- Likewise a slot record from before this migration is the relay's where
-- its slot exists in this database: it keeps being trusted, and the relay
-- records its position at its next start. A record without its slot here
-- is stamped when the relay creates one. Any record written later without
-- the identifier (inserted by hand) is not the relay's.
UPDATE {{.Companion "slots"}} AS t
SET system_identifier = (SELECT system_identifier FROM pg_catalog.pg_control_system())
WHERE t.system_identifier IS NULL
  AND EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots AS r
      WHERE r.slot_name = t.slot_name AND r.database = current_database());
