-- name: control_changed
-- Sent inside the operator's transaction, so every farm reloads once the change commits (and
-- not at all when it rolls back). On the farm's own channel: see `db.control`.
SELECT pg_notify({notify_channel}, %(payload)s)

-- name: control_load
-- The queues of one outbox with a control in force: paused now, or limited. A `paused_until`
-- already past is no pause, judged on the database's clock (one clock for every farm of every
-- host); the soonest end of a pause still running comes back with it, so the watcher reloads at
-- that instant. The limits' columns (migration 0012) are read through the row's JSON image,
-- which has them or not: a farm deployed before `migrate` applied 0012 still reads its pauses
-- (and limits nothing) instead of failing the load.
SELECT q.queue, q.paused AND (q.paused_until IS NULL OR q.paused_until > now()) AS paused,
       q.paused_until, q.reason,
       (j ->> 'rate_count')::int AS rate_count, (j ->> 'rate_seconds')::float8 AS rate_seconds,
       (j ->> 'max_running')::int AS max_running
FROM outbox_farm_queues AS q, to_jsonb(q) AS j
WHERE q.target = %(target)s
  AND ((q.paused AND (q.paused_until IS NULL OR q.paused_until > now()))
       OR j ->> 'rate_count' IS NOT NULL OR j ->> 'max_running' IS NOT NULL)

-- name: limit_lock
-- The first statement of a limited queue's claim (see `limit_allowance`): take the queue's row
-- of `outbox_farm_queues`, so the claims of that queue take turns across every process and
-- host, each from the budget the one before it left. Rows of other queues are not touched.
SELECT 1 FROM outbox_farm_queues WHERE target = %(target)s AND queue = %(queue)s FOR UPDATE

-- name: limit_allowance
-- The second statement, its snapshot taken after `limit_lock` was granted, so it sees every
-- claim that held the lock before it committed: what the queue's limits allow now.
-- `tokens`: the rate's bucket refilled by the time since it was last written, up to its size
-- (a tenth of a second of the rate, one at least: `limits.BURST_SECONDS`); a bucket never
-- written (NULL) is full. Refilled to `clock_timestamp()`, read after the lock, not `now()`,
-- which is when the transaction began and may be long before the lock was granted.
-- `room`: `max_running` less the rows of the queue leased now (from their claim until their
-- outcome is written, so never fewer than the handlers running), counted up to the limit on
-- the lease index. A lease past its expiry is not counted: a process killed while holding rows
-- gives its part of the budget back when its leases expire, as the rows themselves come back.
-- Rows set aside under the nil token are not running either. NULL: no such limit.
SELECT CASE WHEN q.rate_count IS NOT NULL THEN
            least(b.size, coalesce(q.tokens + b.per_second * greatest(
                extract(epoch FROM clock_timestamp() - q.tokens_at)::float8, 0), b.size))
       END AS tokens,
       b.per_second, b.size, clock_timestamp() AS at,
       q.max_running - (
           SELECT count(*) FROM (
               SELECT 1 FROM {outbox} AS o
               WHERE o.queue = q.queue AND o.acquired_token IS NOT NULL
                 AND o.lease_expires_at > now() AND o.acquired_token <> %(aside)s
               LIMIT q.max_running) AS leased
       ) AS room
FROM outbox_farm_queues AS q,
     LATERAL (SELECT q.rate_count / q.rate_seconds AS per_second,
                     greatest(1.0, q.rate_count / q.rate_seconds * %(burst_seconds)s) AS size) AS b
WHERE q.target = %(target)s AND q.queue = %(queue)s

-- name: limit_spend
-- The last statement: what the claim took, out of the bucket `limit_allowance` refilled.
UPDATE outbox_farm_queues SET tokens = %(left)s, tokens_at = %(at)s
WHERE target = %(target)s AND queue = %(queue)s
