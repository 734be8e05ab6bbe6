-- target: outbox
-- A hot ordering key's backlog leaves the pending index. A keyed row is claimable only while
-- no older row of its key is left, and until now every row behind the head of a key sat in the
-- pending index: while the head ran, each claim and each next-due query stepped over all of
-- them (one ordering-index probe apiece). With 2,000 rows of one key that was 5 ms a claim and
-- 8 ms a next-due query, in every process each NOTIFY woke, and the key moved 45 rows a second.
--
-- `key_blocked` marks the rows of a key that have a whole window of older rows of their key
-- before them (the window: 8 rows; the farm's publish statements count them). Marked rows are
-- not in the pending index, so the walk behind a running head is at most the window long.
-- Deleting a keyed row (the farm's ack, dead-letter move and transactional ack) unmarks the
-- first marked row of its key, whose place in line just moved up by one. Keys with no more
-- rows waiting than the window (most keys, most of the time) are never marked, and their rows
-- cost one probe of the small blocked index when deleted. The mark decides no order: the claim
-- still takes a keyed row only while no older row of its key is left. A row left marked at the
-- head of its key (its producer's transaction stayed open while the rows before it were
-- deleted; an operator deleted rows by hand) is unmarked by the fetchers within seconds.
-- Rows written by other writers are never marked, and only skipped the old way.
--
-- Adding a NOT NULL column with a constant default rewrites nothing; the CHECK reads the table
-- once (every row holds false). The pending index is rebuilt under its name without the
-- marked rows: a plain CREATE INDEX (migrations run in a transaction) holds off writes while
-- it reads the table, seconds per few million rows. Migrate at a quiet moment, and restart
-- the farm right after: an older farm's claim cannot use the new index and scans the table.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS key_blocked boolean NOT NULL DEFAULT false;

-- Only a keyed row can wait for an older one; an unkeyed row marked by another writer would
-- never be claimed.
ALTER TABLE {outbox} DROP CONSTRAINT IF EXISTS {blocked_ck};
ALTER TABLE {outbox} ADD CONSTRAINT {blocked_ck}
    CHECK (ordering_key IS NOT NULL OR NOT key_blocked);

-- The old index is looked up in the table's own schema, as in 0004.
SELECT set_config('outbox_farm.search_path', current_setting('search_path'), true);
SELECT set_config('search_path', quote_ident(n.nspname), true)
FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
WHERE t.oid = pg_typeof(NULL::{outbox});
DROP INDEX IF EXISTS {pending_idx};
SELECT set_config('search_path', current_setting('outbox_farm.search_path'), true);

CREATE INDEX {pending_idx} ON {outbox} (queue, next_attempt_at)
    WHERE acquired_token IS NULL AND NOT key_blocked;

-- The marked rows by key: the first of a key, found on each keyed deletion, and the fetchers'
-- look for stranded ones, read one entry per key.
CREATE INDEX IF NOT EXISTS {blocked_idx} ON {outbox} (queue, ordering_key, id)
    WHERE key_blocked;
