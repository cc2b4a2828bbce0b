-- Partition intervals from 5 minutes (store.MinPartitionInterval): a table
-- partitioned when the floor was an hour carries 0014's CHECK of 3600
-- seconds, which this replaces. A table made since has the new CHECK and
-- this changes nothing; on a plain table it does nothing.
{{- if .Partitioned}}
DO $do$
DECLARE
    con text;
BEGIN
    FOR con IN
        SELECT conname FROM pg_catalog.pg_constraint
        WHERE conrelid = to_regclass({{.CompanionLit "partitioning"}}) AND contype = 'c'
          AND pg_catalog.pg_get_constraintdef(oid) LIKE '%interval_seconds >= 3600%'
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', {{.CompanionLit "partitioning"}}, con);
        EXECUTE format('ALTER TABLE %s ADD CHECK (interval_seconds >= 300 AND interval_seconds %% 60 = 0)', {{.CompanionLit "partitioning"}});
    END LOOP;
END
$do$;
{{- end}}
