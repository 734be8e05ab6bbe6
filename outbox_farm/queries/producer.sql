-- name: key_blocked_column
-- A fragment of the publish statements' column lists: the column of migration 0008. It and the
-- two fragments below are what a publish on a table without that column leaves out (the
-- producer writes the rows an older schema accepts until `outbox-farm migrate` adds it).
, key_blocked

-- name: key_blocked_at_publish
-- A fragment of the publish statements: a keyed row is marked `key_blocked` when a whole window
-- of older rows of its key is already waiting (migration 0008), and stays out of the pending
-- index until the deletions before it bring it within the window. Reading the window costs a
-- keyed row at most `KEY_WINDOW` entries of the ordering index, an unkeyed row one empty probe.
, (SELECT count(*) FROM (SELECT FROM {outbox} AS older
                       WHERE older.queue = %(queue)s::varchar
                         AND older.ordering_key = %(ordering_key)s::varchar
                       LIMIT {key_window}) AS w) >= {key_window}

-- name: key_blocked_in_batch
-- `key_blocked_at_publish` for a row of `publish_batch`: its place in its key's line also
-- counts the batch's rows of that key before it.
, b.ordering_key IS NOT NULL
  AND (SELECT count(*) FROM (SELECT FROM {outbox} AS older
                             WHERE older.queue = %(queue)s::varchar
                               AND older.ordering_key = b.ordering_key
                             LIMIT {key_window}) AS w)
      + row_number() OVER (PARTITION BY b.ordering_key ORDER BY b.n) > {key_window}

-- name: priority_column
-- A fragment of the publish statements' column lists: the column of migration 0013. It and
-- `priority_value` are written only for a row published with a priority above 0: a row of 0
-- (the column's default) is written by the statement of the release before, on any schema.
, priority

-- name: priority_value
-- The value of `priority_column`, the same for every row of a `publish_batch`.
, %(priority)s::smallint

-- name: priority_extend
-- A fragment of `publish_extend`: the moved timer takes the new priority. An `extend` without
-- a priority (the statement without these fragments) keeps the timer's.
, priority = excluded.priority

-- name: fair_column
-- A fragment of the publish statements' column lists: the column of migration 0014. It and
-- `fair_value` are written only for a row published with a fair key: every other row is
-- written by the statement without them, on any schema, at the cost it had.
, fair_key

-- name: fair_value
-- The value of `fair_column`, the same for every row of a `publish_batch`.
, %(fair_key)s::text

-- name: fair_extend
-- A fragment of `publish_extend`: the moved timer takes the new fair key.
, fair_key = excluded.fair_key

-- name: publish
-- One row, and its wake-up, in one statement and one round trip. The NOTIFY is sent only when
-- the row is already due; Postgres folds identical notifications of one transaction into one.
WITH ins AS (
    INSERT INTO {outbox} AS o (queue, payload, headers, next_attempt_at, ordering_key
                               {key_blocked_column} {priority_column} {fair_column})
    VALUES (%(queue)s, %(payload)s, %(headers)s,
            coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
            %(ordering_key)s
            {key_blocked_at_publish} {priority_value} {fair_value})
    RETURNING o.id, o.next_attempt_at
)
SELECT ins.id,
       CASE WHEN %(notify)s AND ins.next_attempt_at <= now()
            THEN pg_notify(%(channel)s, %(queue)s)::text END
FROM ins

-- name: publish_timer
-- A timer publish with the `ignore` policy: a live timer with the same id wins, nothing is
-- inserted, no id is returned and no NOTIFY is sent.
WITH ins AS (
    INSERT INTO {outbox} AS o (queue, payload, headers, next_attempt_at, timer_id, ordering_key
                               {key_blocked_column} {priority_column} {fair_column})
    VALUES (%(queue)s, %(payload)s, %(headers)s,
            coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
            %(timer_id)s, %(ordering_key)s
            {key_blocked_at_publish} {priority_value} {fair_value})
    ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO NOTHING
    RETURNING o.id, o.next_attempt_at
)
SELECT ins.id,
       CASE WHEN %(notify)s AND ins.next_attempt_at <= now()
            THEN pg_notify(%(channel)s, %(queue)s)::text END
FROM ins

-- name: publish_extend
-- A timer publish with the `extend` policy: a pending timer with the same id is moved to the
-- new due time and takes the new body (and a priority given with it). A timer whose handler is
-- running (leased) is left alone, and the publish returns no id, so a running handler's ack
-- cannot delete a newer timer.
WITH ins AS (
    INSERT INTO {outbox} AS o (queue, payload, headers, next_attempt_at, timer_id, ordering_key
                               {key_blocked_column} {priority_column} {fair_column})
    VALUES (%(queue)s, %(payload)s, %(headers)s,
            coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
            %(timer_id)s, %(ordering_key)s
            {key_blocked_at_publish} {priority_value} {fair_value})
    ON CONFLICT (queue, timer_id) WHERE timer_id IS NOT NULL DO UPDATE
        SET payload = excluded.payload,
            headers = excluded.headers,
            next_attempt_at = excluded.next_attempt_at
            {priority_extend} {fair_extend}
        WHERE o.acquired_token IS NULL
    RETURNING o.id, o.next_attempt_at
)
SELECT ins.id,
       CASE WHEN %(notify)s AND ins.next_attempt_at <= now()
            THEN pg_notify(%(channel)s, %(queue)s)::text END
FROM ins

-- name: publish_batch
-- Many bodies of one queue in one statement over arrays; WITH ORDINALITY keeps the returned
-- ids in the order of the bodies (so rows of one ordering key run in that order). A NULL
-- `ordering_keys` array is padded with NULLs by unnest: no key for any row. One NOTIFY for the
-- whole batch when any row is due.
WITH ins AS (
    INSERT INTO {outbox} (queue, payload, headers, next_attempt_at, ordering_key
                          {key_blocked_column} {priority_column} {fair_column})
    SELECT %(queue)s, b.payload, b.headers,
           coalesce(%(at)s::timestamptz, now() + make_interval(secs => %(delay)s::float8)),
           b.ordering_key
           {key_blocked_in_batch} {priority_value} {fair_value}
    FROM unnest(%(payloads)b::bytea[], %(headers)b::jsonb[], %(ordering_keys)b::text[])
         WITH ORDINALITY AS b(payload, headers, ordering_key, n)
    ORDER BY b.n
    RETURNING id, next_attempt_at
), wake AS (
    SELECT pg_notify(%(channel)s, %(queue)s)
    WHERE %(notify)s AND EXISTS (SELECT 1 FROM ins WHERE next_attempt_at <= now())
)
SELECT ins.id, (SELECT count(*) FROM wake) FROM ins ORDER BY ins.id

-- name: cancel_timer
-- Only a timer that is not running can be cancelled; a leased one finishes its delivery.
DELETE FROM {outbox}
WHERE queue = %(queue)s AND timer_id = %(timer_id)s AND acquired_token IS NULL
RETURNING id

-- name: publish_schema
-- Whether the outbox table has `key_blocked` (migration 0008), `priority` (migration 0013), and
-- `fair_key` (migration 0014):
-- asked by the producer on a connection's first publish, so that it writes the rows the schema
-- it finds accepts. No row when the table does not exist (the publish then fails as it would
-- have). The table's name comes as quoted text (`to_regclass`), so nothing is composed here.
SELECT EXISTS (SELECT FROM pg_attribute AS a
               WHERE a.attrelid = t.oid AND a.attname = 'key_blocked' AND NOT a.attisdropped),
       EXISTS (SELECT FROM pg_attribute AS a
               WHERE a.attrelid = t.oid AND a.attname = 'priority' AND NOT a.attisdropped),
       EXISTS (SELECT FROM pg_attribute AS a
               WHERE a.attrelid = t.oid AND a.attname = 'fair_key' AND NOT a.attisdropped)
FROM (SELECT to_regclass(%(table)s) AS oid) AS t
WHERE t.oid IS NOT NULL
