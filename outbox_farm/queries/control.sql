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
-- `key_max_running` (migration 0014) is read the same way.
SELECT q.queue, q.paused AND (q.paused_until IS NULL OR q.paused_until > now()) AS paused,
       q.paused_until, q.reason,
       (j ->> 'rate_count')::int AS rate_count, (j ->> 'rate_seconds')::float8 AS rate_seconds,
       (j ->> 'max_running')::int AS max_running,
       coalesce((j ->> 'breaker_failures')::int, 0) AS breaker_failures,
       (j ->> 'breaker_open_since')::timestamptz AS breaker_open_since,
       extract(epoch FROM (j ->> 'breaker_probe_at')::timestamptz - now())::float8 AS probe_in,
       j ->> 'breaker_reason' AS breaker_reason,
       (j ->> 'key_max_running')::int AS key_max_running
FROM outbox_farm_queues AS q, to_jsonb(q) AS j
WHERE q.target = %(target)s
  AND ((q.paused AND (q.paused_until IS NULL OR q.paused_until > now()))
       OR j ->> 'rate_count' IS NOT NULL OR j ->> 'max_running' IS NOT NULL
       OR j ->> 'key_max_running' IS NOT NULL
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
-- (a tenth of a second of the rate, two tokens at least: `limits.BURST_SECONDS` and
-- `BURST_LEAST`); a bucket never
-- written (NULL) is full. Refilled to `clock_timestamp()`, read after the lock, not `now()`,
-- which is when the transaction began and may be long before the lock was granted.
-- `room`: `max_running` less the rows of the queue leased now (from their claim until their
-- outcome is written, so never fewer than the handlers running), counted up to the limit on
-- the lease index. A lease past its expiry is not counted: a process killed while holding rows
-- gives its part of the budget back when its leases expire, as the rows themselves come back.
-- Rows set aside under the nil token are not running either. NULL: no such limit.
-- `key_max`: the per-key running limit (migration 0014, read through the row's JSON image so a
-- table without the column limits nothing per key); not NULL, the claim is `claim_fair`.
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
       ) AS room,
       (to_jsonb(q) ->> 'key_max_running')::int AS key_max
FROM outbox_farm_queues AS q,
     LATERAL (SELECT q.rate_count / q.rate_seconds AS per_second,
                     greatest(%(burst_least)s::float8,
                              q.rate_count / q.rate_seconds * %(burst_seconds)s) AS size) AS b
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

-- name: claim_fair
-- The rows for `claim` of a queue with a per-key running limit (`key_max_running`, migration
-- 0014), locked and listed in the order to take them; `claim_ids` takes them. Both run inside
-- the limited claim's transaction after `limit_allowance`, so the claims of the queue take
-- turns and each counts the rows the one before it leased. (Two statements, not one: a single
-- one names the table so often that its text passes the driver's 4 KiB parse cache with long
-- table names, and would be parsed afresh on every claim.) Each fair key (a tenant) may have
-- at most `key_max` rows leased at once: a key with 100,000 due rows fills no more of a claim
-- than that, and a row of another key published after them is taken by the next claim.
-- `leased`: the leases of the queue per key, on the lease index (at most the queue's running
-- rows). Set-aside rows run nothing and count for nothing; an expired lease counts, as it is
-- taken again by this claim (`expired`, first) or still runs in the claimer that holds it. `keys`: the fair keys with due free rows, one probe of the fair index
-- each (a loose index scan: a key's backlog costs nothing, the number of keys waiting does).
-- `fair`: per key, its oldest due rows up to what the key has left, numbered; they are taken
-- round the keys (every key's first row, then every key's second, each round oldest first),
-- so a claim too small for every key serves the longest-waiting keys first.
-- Rows without a fair key are one key of their own, with the same limit (`nokey`): a queue's
-- untagged backlog holds back no tenant either. They are in the pending index only, among the
-- tenants' rows, so they are looked for among the queue's first `lookahead` due rows, not
-- behind the whole backlog (a walk that would cost every claim the backlog's length): in a
-- queue limited per key, give every row a fair key.
-- As in `claim`: SKIP LOCKED everywhere, a keyed row only as the oldest row of its ordering
-- key, expired leases taken again first. Not as in `claim`: priorities do not order a key's rows (the
-- fair index keeps due order); leases of a farm from before migration 0004 and rows due past
-- the year 9999 are left to a claim without the per-key limit.
WITH RECURSIVE leased AS MATERIALIZED (
    SELECT l.fair_key, count(*) AS n FROM {outbox} AS l
    WHERE l.queue = %(queue)s AND l.acquired_token IS NOT NULL AND l.acquired_token <> %(aside)s
    GROUP BY l.fair_key
), expired AS (
    SELECT c.id, c.ordering_key, 0 AS rank, c.lease_expires_at AS at FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NOT NULL AND c.lease_expires_at < now()
      AND c.acquired_token <> ALL(%(held)b::uuid[]) AND {fair_first_of_key}
    ORDER BY c.lease_expires_at LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
), keys AS (
    (SELECT c.fair_key FROM {outbox} AS c WHERE {fair_free} AND c.fair_key IS NOT NULL
     ORDER BY c.fair_key LIMIT 1)
    UNION ALL
    SELECT n.fair_key FROM keys AS k, LATERAL (
        SELECT c.fair_key FROM {outbox} AS c WHERE {fair_free} AND c.fair_key > k.fair_key
        ORDER BY c.fair_key LIMIT 1) AS n
), fair AS (
    SELECT r.* FROM keys AS k LEFT JOIN leased AS l ON l.fair_key = k.fair_key, LATERAL (
        SELECT c.id, c.ordering_key, row_number() OVER (ORDER BY c.next_attempt_at) AS rank,
               c.next_attempt_at AS at
        FROM (SELECT c.id, c.ordering_key, c.next_attempt_at FROM {outbox} AS c
              WHERE {fair_free} AND c.fair_key = k.fair_key AND {fair_first_of_key}
              ORDER BY c.next_attempt_at
              LIMIT least(greatest(%(key_max)s::int - coalesce(l.n, 0), 0), %(limit)s::int)
              FOR UPDATE OF c SKIP LOCKED) AS c) AS r
), nokey AS (
    SELECT c.id, c.ordering_key, row_number() OVER (ORDER BY c.next_attempt_at) AS rank,
           c.next_attempt_at AS at
    FROM (SELECT c.id, c.ordering_key, c.next_attempt_at FROM {outbox} AS c
          WHERE c.id = ANY(ARRAY(SELECT c.id FROM {outbox} AS c WHERE {fair_free}
                                 ORDER BY c.next_attempt_at LIMIT %(lookahead)s))
            AND {fair_free} AND c.fair_key IS NULL AND {fair_first_of_key}
          ORDER BY c.next_attempt_at
          LIMIT least(greatest(%(key_max)s::int
                               - coalesce((SELECT n FROM leased WHERE fair_key IS NULL), 0), 0),
                      %(limit)s::int)
          FOR UPDATE OF c SKIP LOCKED) AS c
)
SELECT t.id, t.ordering_key IS NOT NULL
FROM (SELECT * FROM expired UNION ALL SELECT * FROM fair UNION ALL SELECT * FROM nokey) AS t
ORDER BY t.rank, t.at
LIMIT %(limit)s

-- name: fair_free
-- A fragment of `claim_fair`: a due row of the queue nobody holds (the fair and pending
-- indexes' predicate).
c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
AND c.next_attempt_at <= now()

-- name: fair_first_of_key
-- A fragment of `claim_fair`: a row with an ordering key only while no older row of its key
-- is left (see `claim`).
(c.ordering_key IS NULL OR NOT EXISTS (
    SELECT 1 FROM {outbox} AS older
    WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key AND older.id < c.id))

-- name: claim_ids
-- The second statement of a fair claim: lease the rows `claim_fair` locked and listed, as
-- `claim` does (`take`). Commits without waiting for its WAL flush when no row has an ordering
-- key (`keyed` false), for the reasons `claim` gives.
WITH quick AS MATERIALIZED (
    SELECT set_config('synchronous_commit', 'off', true) WHERE NOT %(keyed)s::bool
), picked AS (
    SELECT t.id FROM unnest(%(ids)s::bigint[]) AS t(id) LEFT JOIN quick ON true
)
{take}
