-- The stream that stored a published row's message, beside its stream_seq:
-- a sequence names a message only together with its stream, and a relay may
-- publish into several (--allow-stream). Set by both paths on every publish
-- (the ack's stream, which is always the one the relay expected: any other
-- is refused); NULL on rows published before this migration and on rows
-- never published.
ALTER TABLE {{.Table}} ADD COLUMN IF NOT EXISTS stream_name text;
