-- name: testing_drain_state
-- What a test's drain waits on, for its queues: rows someone holds (a handler is running, or
-- its outcome is not written yet), and the seconds (database clock) until the next row a claim
-- could take. A keyed row held back by an older row of its key is not claimable however due it
-- is, as in `next_due`: counting it would make a drain wait for a row that cannot run.
-- A row set aside (the nil token) is nobody's to finish: it is not waited for. Due times are
-- compared as epochs, so a row due at ±infinity reads as due now or never, not as an error.
SELECT held, CASE WHEN d IS NOT NULL THEN greatest(least(d, 1e9), -1e9) END::float8, total
FROM (
    SELECT count(*) FILTER (WHERE c.acquired_token IS NOT NULL
                              AND c.acquired_token <> '00000000-0000-0000-0000-000000000000')
               AS held,
           extract(epoch FROM min(c.next_attempt_at) FILTER (
               WHERE c.acquired_token IS NULL
                 AND (c.ordering_key IS NULL OR NOT EXISTS (
                     SELECT 1 FROM {outbox} AS older
                     WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key
                       AND older.id < c.id)))) - extract(epoch FROM now()) AS d,
           count(*) AS total
    FROM {outbox} AS c
    WHERE c.queue = ANY(%(queues)s)
) AS state

-- name: testing_advance
-- A test's clock moves forward by %(seconds)s: every row of its queues nobody holds becomes
-- due that much sooner, and its past attempts happened that much earlier, so a retry strategy
-- that looks at the time since the first attempt sees the time pass too. Rows someone holds
-- are left alone: their lease is real time. `created_at` stays: it is part of a relayed
-- message's stable id, which must not change between a send and its re-send. Rows whose due
-- time is not a loadable one (another writer's, due now or never: the claim dead-letters them)
-- are left alone too: moved, they would break the table's values check.
UPDATE {outbox}
SET next_attempt_at = next_attempt_at - make_interval(secs => %(seconds)s),
    first_attempt_at = first_attempt_at - make_interval(secs => %(seconds)s),
    last_attempt_at = last_attempt_at - make_interval(secs => %(seconds)s)
WHERE queue = ANY(%(queues)s) AND acquired_token IS NULL
  AND next_attempt_at BETWEEN '0001-01-03 00:00:00+00' AND '9999-12-30 00:00:00+00'
  AND created_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
  AND (headers IS NULL OR jsonb_typeof(headers) = 'object')

-- name: create_database
-- A scratch database for a test, optionally a copy of a migrated template (`CREATE DATABASE
-- ... TEMPLATE` copies files: far faster than migrating each one).
CREATE DATABASE {database}

-- name: create_database_from
CREATE DATABASE {database} TEMPLATE {template}

-- name: drop_database
-- WITH (FORCE): a test that failed may leave a connection open; it must not keep the
-- database alive (Postgres 13+).
DROP DATABASE IF EXISTS {database} WITH (FORCE)
