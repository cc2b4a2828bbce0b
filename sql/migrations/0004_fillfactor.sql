-- Room on every page for the new version of each row the relay marks
-- published: the mark changes no indexed column, so with free space on the
-- same page it is a HOT update (no new index entry, and the old version is
-- pruned in place). Applies to pages written from now on.
ALTER TABLE {{.Table}} SET (fillfactor = 70);
