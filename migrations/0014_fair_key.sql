-- target: outbox
-- Fair shares per key: `publish(..., fair_key="tenant-a")` names the tenant (a customer, any
-- group) a row belongs to, and `outbox-farm queue limit QUEUE --per-key-running N` keeps at
-- most N rows of each fair key of the queue running at once, across every process and host,
-- so one tenant's backlog of 100,000 rows cannot hold back a row of another tenant published
-- after it (see `claim_fair` in queries/control.sql).
--
-- The index holds only the free rows that have a fair key, in the order the fair claim walks
-- them: one key after the next (a loose index scan: one probe per key with rows waiting), and
-- within a key in due order. A queue that uses no fair key keeps it empty: its publishes and
-- acks write no entry, its claims never read it. It has the pending index's predicate, so a
-- row leaves it when claimed or marked `key_blocked` as it leaves the pending index. A key's
-- leased rows are counted on the lease index (migration 0004): they are at most the queue's
-- running rows, so no index of their own is needed.
--
-- `key_max_running` (in `outbox_farm_queues`, one table for every outbox: see 0011 and 0012)
-- is the limit; NULL: none. Set beside the queue's other limits, under the same row lock.
--
-- Expand-only. A nullable column without a default rewrites nothing; building the index reads
-- the table once and holds off writes meanwhile (a plain CREATE INDEX: migrations run in a
-- transaction), seconds per few million rows. A farm of an earlier release ignores both
-- columns (its claims take rows whatever their key); a producer of this release asks the
-- catalog before its first publish with a fair key and refuses one, saying to run
-- `outbox-farm migrate`, while the table has no such column.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS fair_key text;

CREATE INDEX IF NOT EXISTS {fair_idx} ON {outbox} (queue, fair_key, next_attempt_at)
    WHERE acquired_token IS NULL AND NOT key_blocked AND fair_key IS NOT NULL;

ALTER TABLE outbox_farm_queues ADD COLUMN IF NOT EXISTS key_max_running integer;

DO $$
BEGIN
    ALTER TABLE outbox_farm_queues ADD CONSTRAINT outbox_farm_queues_key_limit_check
        CHECK (key_max_running IS NULL OR key_max_running > 0);
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
