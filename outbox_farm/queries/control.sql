-- name: control_changed
-- Sent inside the operator's transaction, so every farm reloads once the change commits (and
-- not at all when it rolls back). On the farm's own channel: see `db.control`.
SELECT pg_notify({notify_channel}, %(payload)s)

-- name: control_load
-- The queues of one outbox with a control in force: paused now, limited, or with a breaker that
-- is open or counting failures. A `paused_until` already past is no pause, judged on the
-- database's clock (one clock for every farm of every host); the soonest end of a pause still
-- running comes back with it, so the watcher reloads at that instant. The columns of migration
-- 0012 are read through the row's JSON image, which has them or not: a farm deployed before
-- `migrate` applied 0012 still reads its pauses (and limits nothing) instead of failing the
-- load. `probe_in`: seconds until an open breaker's next probe may run (the database's clock).
SELECT q.queue, q.paused AND (q.paused_until IS NULL OR q.paused_until > now()) AS paused,
       q.paused_until, q.reason,
       (j ->> 'rate_count')::int AS rate_count, (j ->> 'rate_seconds')::float8 AS rate_seconds,
       (j ->> 'max_running')::int AS max_running,
       coalesce((j ->> 'breaker_failures')::int, 0) AS breaker_failures,
       (j ->> 'breaker_open_since')::timestamptz AS breaker_open_since,
       extract(epoch FROM (j ->> 'breaker_probe_at')::timestamptz - now())::float8 AS probe_in,
       j ->> 'breaker_reason' AS breaker_reason
FROM outbox_farm_queues AS q, to_jsonb(q) AS j
WHERE q.target = %(target)s
  AND ((q.paused AND (q.paused_until IS NULL OR q.paused_until > now()))
       OR j ->> 'rate_count' IS NOT NULL OR j ->> 'max_running' IS NOT NULL
       OR j ->> 'breaker_open_since' IS NOT NULL OR (j ->> 'breaker_failures')::int > 0)

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

-- name: breaker_failed
-- A failure of a handler of a queue with a breaker (`Breaker`), counted across every process
-- and host in the queue's row, under its lock, so that exactly the `threshold`-th failure in a
-- row opens the breaker (`down`: a failure that says the downstream is down opens it at once).
-- Opening it sets the time of its first probe and wakes every farm (NOTIFY at commit), which
-- reloads its controls and holds the queue. `opened`: this failure opened it; `open`: it is
-- open now (was already, when not `opened`: this failure ran beside the ones that opened it,
-- and its row keeps its attempts). The failures of an open breaker are not counted.
WITH counted AS (
    INSERT INTO outbox_farm_queues AS q
        (target, queue, breaker_failures, breaker_open_since, breaker_probe_at, breaker_reason)
    SELECT %(target)s, %(queue)s, 1, CASE WHEN o.opens THEN now() END,
           CASE WHEN o.opens THEN now() + make_interval(secs => %(every)s::float8) END,
           CASE WHEN o.opens THEN %(reason)s::text END
    FROM (SELECT %(down)s::bool OR 1 >= %(threshold)s::int AS opens) AS o
    ON CONFLICT (target, queue) DO UPDATE SET
        breaker_failures = CASE WHEN q.breaker_open_since IS NULL
                                THEN q.breaker_failures + 1 ELSE q.breaker_failures END,
        breaker_open_since = CASE
            WHEN q.breaker_open_since IS NOT NULL THEN q.breaker_open_since
            WHEN %(down)s::bool OR q.breaker_failures + 1 >= %(threshold)s::int THEN now() END,
        breaker_probe_at = CASE
            WHEN q.breaker_open_since IS NOT NULL THEN q.breaker_probe_at
            WHEN %(down)s::bool OR q.breaker_failures + 1 >= %(threshold)s::int
            THEN now() + make_interval(secs => %(every)s::float8) END,
        breaker_reason = CASE
            WHEN q.breaker_open_since IS NOT NULL THEN q.breaker_reason
            WHEN %(down)s::bool OR q.breaker_failures + 1 >= %(threshold)s::int THEN %(reason)s::text END
    RETURNING q.breaker_open_since IS NOT NULL AND q.breaker_open_since = now() AS opened,
              q.breaker_open_since IS NOT NULL AS open
), wake AS (
    SELECT pg_notify({notify_channel}, %(payload)s) FROM counted WHERE opened
)
SELECT opened, open FROM counted, (SELECT count(*) FROM wake) AS woken

-- name: breaker_reset
-- A success of a handler of a queue whose breaker counted failures: the count starts again (a
-- breaker opens on failures in a row). Only a process that knows of failures counted sends it.
UPDATE outbox_farm_queues SET breaker_failures = 0
WHERE target = %(target)s AND queue = %(queue)s AND breaker_failures > 0
  AND breaker_open_since IS NULL

-- name: breaker_probe
-- The right to run the next probe of an open breaker: one process of one host wins it each
-- interval (the row's lock decides), and the probe after it may run `every` seconds later.
UPDATE outbox_farm_queues SET breaker_probe_at = now() + make_interval(secs => %(every)s::float8)
WHERE target = %(target)s AND queue = %(queue)s AND breaker_open_since IS NOT NULL
  AND breaker_probe_at <= now()
RETURNING 1

-- name: breaker_close
-- A success while the breaker is open (a probe's, or a row's that ran beside the failures that
-- opened it): the downstream answers again. Every farm claims the queue again at the NOTIFY.
WITH closed AS (
    UPDATE outbox_farm_queues
    SET breaker_open_since = NULL, breaker_probe_at = NULL, breaker_reason = NULL,
        breaker_failures = 0
    WHERE target = %(target)s AND queue = %(queue)s AND breaker_open_since IS NOT NULL
    RETURNING queue
), wake AS (
    SELECT pg_notify({notify_channel}, %(payload)s) FROM closed
)
SELECT count(*)::int FROM closed, (SELECT count(*) FROM wake) AS woken
