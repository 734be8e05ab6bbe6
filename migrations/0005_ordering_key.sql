-- target: outbox
-- Per-key ordering: rows of one queue that share an `ordering_key` are handled one at a time,
-- oldest first. The claim takes a keyed row only while no older row of its queue and key is
-- left in the table; this index answers that question with one lookup per candidate, and
-- holds keyed rows only, so queues that never use keys pay nothing for it. Adding a nullable
-- column without a default rewrites nothing; building the index reads the table once.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS ordering_key varchar(255);

CREATE INDEX IF NOT EXISTS {ordering_idx} ON {outbox} (queue, ordering_key, id)
    WHERE ordering_key IS NOT NULL;
