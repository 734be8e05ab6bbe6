-- target: outbox
-- Priorities: `publish(..., priority=N)` (N from 0, the default, to 32767): among the due rows
-- of a queue, higher first. The claim's `ranked` branch takes up to three quarters of each
-- claim from the index below, highest priority first; the rest of the claim is taken in plain
-- due order whatever the priority, so rows of priority 0 keep moving under any load of higher
-- ones (see `claim` in queries/runtime.sql).
--
-- The index holds only rows above 0, so a queue that uses no priority keeps it empty: its
-- claims pay one probe of an empty index, its publishes and acks no index entry at all. Its
-- order, priority first and due time second, is the claim's, so the claim reads the rows it
-- takes and no sort; rows above 0 not yet due are stepped over in the index (a few index
-- entries each, no table read). It has the pending index's predicate, so a row leaves it when
-- claimed or marked `key_blocked` as it leaves the pending index.
--
-- Expand-only. Adding a NOT NULL column with a constant default rewrites nothing; building the
-- index reads the table once and holds off writes meanwhile (a plain CREATE INDEX: migrations
-- run in a transaction), seconds per few million rows. A farm of the release before never
-- writes the column (its rows are 0) and claims as it did, over the pending index, which is
-- unchanged. A farm of this release started before this migration asks the catalog before its
-- first claim and claims as the release before did, until it finds the column; its publish
-- with a priority fails saying to run `outbox-farm migrate`. No CHECK bounds the column (adding
-- one would read the table under an exclusive lock): a value below 0 that another writer
-- stores is not in the index, and the row is claimed as one of priority 0.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS priority smallint NOT NULL DEFAULT 0;

CREATE INDEX IF NOT EXISTS {priority_idx} ON {outbox} (queue, priority DESC, next_attempt_at)
    WHERE acquired_token IS NULL AND NOT key_blocked AND priority > 0;
