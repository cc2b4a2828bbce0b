-- Room on every page for the new version of each row the relay marks
-- published: the mark changes no indexed column, so with free space on the
-- same page it is a HOT update (no new index entry, and the old version is
-- pruned in place). Applies to pages written from now on.
-- A partitioned table has no pages of its own and takes no storage
-- parameter: each partition is created with fillfactor 50 (0014).
{{if not .Partitioned}}ALTER TABLE {{.Table}} SET (fillfactor = 70);{{end}}
