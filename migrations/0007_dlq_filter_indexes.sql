-- target: dlq
-- The console's and `dlq list`'s filtered pages, newest first by id: "the rejected rows" and
-- "the rejected rows of queue q5". Without these the planner walks the primary key backwards
-- and discards every row of another reason or queue, which on a DLQ of a million rows costs
-- hundreds of milliseconds a page. Each index ends in id, so a page (and the next, keyset on
-- id) is one range read. The existing (queue, failed_at) index still serves "queue X only",
-- the time filters and retention.
--
-- A plain CREATE INDEX (migrations run in a transaction, which CONCURRENTLY cannot): it holds
-- off writes to the DLQ while it reads the table once, a second or two per million rows. The
-- farm's dead-lettering waits meanwhile; nothing is lost.
CREATE INDEX IF NOT EXISTS {dlq_reason_idx} ON {dlq} (failure_reason, id);
CREATE INDEX IF NOT EXISTS {dlq_queue_reason_idx} ON {dlq} (queue, failure_reason, id);

-- Which reasons each queue actually has. Queue and reason are far from independent (a queue
-- whose handler rejects rarely times out), and a planner that multiplies their frequencies
-- expects matches where there are none: for "LIMIT 50, newest first" it then prefers walking
-- the primary key, and reads the whole table to find nothing. The combined most-common-values
-- list tells it which pairs exist. Built by the ANALYZE below (it samples, a fraction of a
-- second on a million rows), kept up by autovacuum's.
CREATE STATISTICS IF NOT EXISTS {dlq_queue_reason_stats} (mcv) ON queue, failure_reason
    FROM {dlq};
ANALYZE {dlq};
