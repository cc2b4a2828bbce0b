-- A work ID and a kind travel as NATS header values (Nats-Msg-Id,
-- Outbox-Kind), and a header cannot carry everything a text column can: the
-- client trims leading and trailing whitespace and turns CR and LF into
-- spaces, and the broker deduplicates on what arrives. 'col-x', 'col-x ' and
-- E'col-x\n' would be stored as one message, and three rows marked published
-- with its sequence. Refuse such values at insert, with the rules the relay
-- and package outbox apply (internal/wire): 1 to 1024 bytes for a work ID, 1
-- to 256 for a kind, no control characters, no space at either end.
--
-- A subject in the server's own namespaces ($JS.API..., $SYS..., _INBOX...)
-- would make the relay call the server's API or answer another client's
-- request; a row may only publish into a stream.
--
-- NOT VALID: rows already in the table are not checked (the relay refuses
-- each one as it comes, and it ends failed with the reason). After cleaning
-- them up, `ALTER TABLE ... VALIDATE CONSTRAINT` makes the check complete.
ALTER TABLE {{.Table}}
    ADD CONSTRAINT {{.Name "work_id_wire_check"}} CHECK (
        octet_length(work_id) <= 1024
        AND work_id !~ E'[\\x01-\\x1f\\x7f]'
        AND work_id !~ E'^ | $'
    ) NOT VALID,
    ADD CONSTRAINT {{.Name "kind_wire_check"}} CHECK (
        octet_length(kind) <= 256
        AND kind !~ E'[\\x01-\\x1f\\x7f]'
        AND kind !~ E'^ | $'
    ) NOT VALID,
    ADD CONSTRAINT {{.Name "subject_wire_check"}} CHECK (
        subject IS NULL OR subject !~ E'^(\\$|_INBOX(\\.|$))'
    ) NOT VALID;
