-- name: admin_dlq_match
-- The operator's DLQ filter, a condition on `d`: every filter is a parameter that is NULL when
-- not given, so one statement serves every combination. Times are the database clock: `since`
-- and `until` are either a time or seconds before now(). `grep` is a plain substring (no
-- wildcards): case-insensitive in the exception and the headers, exact bytes in the payload
-- (the payload may not be text). Filled into the statements below in place of `match`.
(%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))
AND (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
AND (%(reason)s::text IS NULL OR d.failure_reason = %(reason)s::text)
AND (%(since_at)s::timestamptz IS NULL OR d.failed_at >= %(since_at)s::timestamptz)
AND (%(since_ago)s::float8 IS NULL
     OR d.failed_at >= now() - make_interval(secs => %(since_ago)s::float8))
AND (%(until_at)s::timestamptz IS NULL OR d.failed_at < %(until_at)s::timestamptz)
AND (%(until_ago)s::float8 IS NULL
     OR d.failed_at < now() - make_interval(secs => %(until_ago)s::float8))
AND (%(grep)s::text IS NULL
     OR strpos(lower(coalesce(d.last_exception, '')), lower(%(grep)s::text)) > 0
     OR strpos(lower(coalesce(d.headers::text, '')), lower(%(grep)s::text)) > 0
     OR position(convert_to(%(grep)s::text, 'UTF8') IN d.payload) > 0)

-- name: admin_dlq_match_cause
-- The DLQ filter with a cause (migration 0009's normalised `last_exception`, as a group of
-- `admin_dlq_causes` shows it): a range of the cause index. Used in place of `admin_dlq_match`
-- only when a cause is given, so that without one no statement names the cause function, which
-- a DLQ migrated by an older release does not have.
{admin_dlq_match} AND {dlq_cause_fn}(d.last_exception) = %(cause)s::text

-- name: admin_dlq_causes
-- The DLQ's rows by cause, most rows first, from the counts migration 0009's triggers keep:
-- a few rows per cause read, whatever the DLQ's size. Only a queue, reason or cause filter
-- can be answered so (`admin_dlq_causes_scan` takes the others). `last_failed_at` is one
-- backward probe of the cause index per group: the newest row of the cause (of the queue and
-- reason asked for, read newest first until one matches).
SELECT g.cause, g.row_count, g.queues, g.reasons,
       (SELECT d.failed_at FROM {dlq} AS d
        WHERE {dlq_cause_fn}(d.last_exception) = g.cause
          AND (%(queue)s::text IS NULL OR d.queue = %(queue)s::text)
          AND (%(reason)s::text IS NULL OR d.failure_reason = %(reason)s::text)
        ORDER BY {dlq_cause_fn}(d.last_exception) DESC, d.id DESC
        LIMIT 1)
FROM (
    SELECT c.cause, sum(c.row_count)::bigint AS row_count,
           array_agg(DISTINCT c.queue::text) AS queues,
           array_agg(DISTINCT c.failure_reason::text) AS reasons
    FROM {dlq_causes} AS c
    WHERE (%(queue)s::text IS NULL OR c.queue = %(queue)s::text)
      AND (%(reason)s::text IS NULL OR c.failure_reason = %(reason)s::text)
      AND (%(cause)s::text IS NULL OR c.cause = %(cause)s::text)
    GROUP BY c.cause
    ORDER BY 2 DESC, c.cause
    LIMIT %(limit)s
) AS g
ORDER BY g.row_count DESC, g.cause

-- name: admin_dlq_causes_kept
-- Whether migration 0009's counts table exists, asked before reading it where its absence is
-- no error (`stats` on a DLQ migrated by an older release): a failed read would abort the
-- caller's transaction.
SELECT to_regclass(%(table)s) IS NOT NULL

-- name: admin_dlq_causes_scan
-- The rows a time, text or id filter matches, grouped by cause as they are read: what the
-- kept counts cannot answer. Costs the rows matched (a window of the last hour reads the
-- last hour's rows, through the (queue, failed_at) index when a queue is given).
SELECT {dlq_cause_fn}(d.last_exception), count(*)::bigint,
       array_agg(DISTINCT d.queue::text), array_agg(DISTINCT d.failure_reason::text),
       max(d.failed_at)
FROM {dlq} AS d
WHERE {match}
GROUP BY 1
ORDER BY 2 DESC, 1
LIMIT %(limit)s

-- name: admin_dlq_list
-- Newest first, from the primary key backwards; `before` (an id, NULL for the newest) is the
-- keyset of the next page, so page 1000 costs what page 1 does. Only the exception's first
-- line: the whole text (up to 8 KiB) is for `show`.
-- A `created_at` no client can load (an `invalid_row` dead-lettered with it: ±infinity, BC, year
-- 10000 on) comes back NULL rather than failing the whole listing.
SELECT d.id, d.original_id, d.queue, d.failure_reason, d.deliveries_count,
       CASE WHEN d.created_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
            THEN d.created_at END,
       d.failed_at, octet_length(d.payload)::bigint, d.headers,
       split_part(coalesce(d.last_exception, ''), E'\n', 1)
FROM {dlq} AS d
WHERE {match} AND (%(before)s::bigint IS NULL OR d.id < %(before)s::bigint)
ORDER BY d.id DESC
LIMIT %(limit)s

-- name: admin_dlq_show
-- `created_at` as in `admin_dlq_list`. The payload whole, or its first `cap` bytes (a page
-- need not carry 10 MB to show what a message was), with its whole size.
SELECT d.id, d.original_id, d.queue, d.failure_reason, d.deliveries_count,
       CASE WHEN d.created_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
            THEN d.created_at END,
       d.failed_at,
       CASE WHEN %(cap)s::integer IS NULL THEN d.payload
            ELSE substring(d.payload FROM 1 FOR %(cap)s::integer) END,
       d.headers, d.last_exception, d.timer_id, octet_length(d.payload)::bigint
FROM {dlq} AS d
WHERE d.id = %(id)s

-- name: admin_dlq_payload
-- One row's payload, whole: the download of a payload too big to show.
SELECT d.payload FROM {dlq} AS d WHERE d.id = %(id)s

-- name: admin_dlq_summary
-- What a replay or purge with this filter would touch, by queue and reason; `max(id)` bounds
-- the operation to the rows counted here, so rows failing meanwhile are left for later.
-- `upto` (NULL: none) counts only ids up to a bound taken before: the recount of a preview.
SELECT d.queue, d.failure_reason, count(*)::bigint, min(d.failed_at), max(d.failed_at),
       max(d.id)
FROM {dlq} AS d
WHERE {match} AND (%(upto)s::bigint IS NULL OR d.id <= %(upto)s::bigint)
GROUP BY d.queue, d.failure_reason
ORDER BY d.queue, d.failure_reason

-- name: admin_snapshot_xmax
-- The first transaction id not yet started when this statement's snapshot was taken: every
-- transaction that could still commit a row the count did not see has a lower one (or had
-- already taken its id, see `admin.dlq.dlq_preview`).
SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint

-- name: admin_horizon_passed
-- Whether every transaction below `xmax` has ended (committed or rolled back): the oldest
-- transaction still running is at or past it.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= %(xmax)s::bigint

-- name: admin_now
-- The database clock, which relative times (`2h` ago) are measured on.
SELECT now()

-- name: admin_dlq_count
-- At most `cap` rows matching the filter, counted: exact below the cap, milliseconds whatever
-- the DLQ's size. Past it the caller EXPLAINs this statement for the planner's estimate.
SELECT count(*)::bigint FROM (
    SELECT 1 FROM {dlq} AS d WHERE {match} LIMIT %(cap)s
) AS capped

-- name: admin_dlq_unfit
-- What of a DLQ row the outbox's values check (migration 0006) refuses, as one line; NULL when
-- nothing. Only two values can be refused, since a replay writes fresh counters and due times:
-- a `created_at` a client cannot load (±infinity, BC, year 10000 on, as dead-lettered from an
-- `invalid_row`) and headers that are not a JSON object. The replay normalises both (this line
-- is the note it leaves in the row's headers); `dlq replay` reports the rows by id beforehand.
nullif(concat_ws('; ',
    CASE WHEN d.created_at NOT BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
         THEN 'created_at ' || d.created_at || ' replaced by the time of the replay' END,
    CASE WHEN jsonb_typeof(d.headers) <> 'object'
         THEN 'headers a JSON ' || jsonb_typeof(d.headers) || ', kept under original_headers' END
), '')

-- name: admin_dlq_unfit_rows
-- The rows a replay with this filter and bound will normalise (`admin_dlq_unfit`, filled in
-- by its name like every block named in braces), the first `limit` by id, with how many there
-- are in all.
SELECT d.id, {admin_dlq_unfit}, count(*) OVER ()
FROM {dlq} AS d
WHERE d.id <= %(upto)s AND {match} AND {admin_dlq_unfit} IS NOT NULL
ORDER BY d.id
LIMIT %(limit)s

-- name: admin_dlq_replay
-- One batch of a replay, one statement and so one transaction: the DELETE feeds the INSERT, so
-- a batch is either moved whole or not at all, and a killed replay neither loses nor repeats a
-- row (run it again: what was moved is no longer in the DLQ). Keyset on id (`after`, `upto`).
-- The new row keeps payload, headers and created_at; it gets fresh counters, a due time of
-- now() + delay, and the headers `replayed_from` (the DLQ row's id) and `replay_count`. A
-- timer id is kept unless a live timer of the same id (or an earlier row of this batch) holds
-- it: the unique timer index would otherwise fail the whole batch. For the same reason a value
-- the outbox's values check refuses (`admin_dlq_unfit`) is normalised rather than copied: a
-- created_at no client can load becomes now(), headers that are not an object are kept under
-- `original_headers`, and the header `replay_normalised` says what was changed. One NOTIFY per
-- queue that got due rows; `wake` is read in the final SELECT because an unreferenced CTE never
-- runs.
WITH picked AS (
    SELECT d.id FROM {dlq} AS d
    WHERE d.id > %(after)s AND d.id <= %(upto)s AND {match}
    ORDER BY d.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    DELETE FROM {dlq} AS d USING picked
    WHERE d.id = picked.id
    RETURNING d.id, d.queue, d.payload, d.headers, d.created_at, d.timer_id, {admin_dlq_unfit} AS unfit
), target AS (
    SELECT m.*, coalesce(%(to_queue)s::text, m.queue) AS dest,
           row_number() OVER (PARTITION BY coalesce(%(to_queue)s::text, m.queue), m.timer_id
                              ORDER BY m.id) AS nth
    FROM moved AS m
), ins AS (
    INSERT INTO {outbox} (queue, payload, headers, created_at, next_attempt_at, timer_id)
    SELECT t.dest, t.payload,
           CASE WHEN t.headers IS NULL THEN '{{}}'::jsonb
                WHEN jsonb_typeof(t.headers) = 'object' THEN t.headers
                ELSE jsonb_build_object('original_headers', t.headers) END
           || jsonb_build_object(
               'replayed_from', t.id,
               'replay_count',
               CASE WHEN jsonb_typeof(t.headers -> 'replay_count') = 'number'
                    THEN (t.headers ->> 'replay_count')::numeric + 1 ELSE 1 END)
           || CASE WHEN t.unfit IS NULL THEN '{{}}'::jsonb
                   ELSE jsonb_build_object('replay_normalised', t.unfit) END,
           CASE WHEN t.created_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
                THEN t.created_at ELSE now() END,
           now() + make_interval(secs => %(delay)s::float8),
           CASE WHEN t.nth = 1 AND NOT EXISTS (
                    SELECT 1 FROM {outbox} AS o WHERE o.queue = t.dest AND o.timer_id = t.timer_id)
                THEN t.timer_id END
    FROM target AS t
    ORDER BY t.id
    RETURNING queue, next_attempt_at
), wake AS (
    SELECT pg_notify(%(channel)s, w.queue)
    FROM (SELECT DISTINCT queue FROM ins WHERE next_attempt_at <= now()) AS w
)
SELECT (SELECT max(id) FROM moved), (SELECT count(*) FROM ins)::bigint,
       (SELECT count(*) FROM wake)::bigint

-- name: admin_dlq_purge
-- One batch of a purge, keyset on id like the replay.
WITH picked AS (
    SELECT d.id FROM {dlq} AS d
    WHERE d.id > %(after)s AND d.id <= %(upto)s AND {match}
    ORDER BY d.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {dlq} AS d USING picked WHERE d.id = picked.id RETURNING d.id
)
SELECT max(id), count(*)::bigint FROM gone

-- name: outbox_queues
-- The queues with rows in the outbox, read as a loose index scan: one index probe per queue on
-- each partial index (pending, leased) instead of a scan of every row. The planner needs the
-- partial indexes' predicates spelled out to use them. A queue whose rows were all marked
-- `key_blocked` cannot exist: a marked row waits behind older rows of its queue and key.
WITH RECURSIVE pending AS (
    (SELECT queue FROM {outbox} WHERE acquired_token IS NULL AND NOT key_blocked
     ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT o.queue FROM {outbox} AS o
            WHERE o.acquired_token IS NULL AND NOT o.key_blocked AND o.queue > p.queue
            ORDER BY o.queue LIMIT 1)
    FROM pending AS p WHERE p.queue IS NOT NULL
), leased AS (
    (SELECT queue FROM {outbox} WHERE acquired_token IS NOT NULL ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT o.queue FROM {outbox} AS o
            WHERE o.acquired_token IS NOT NULL AND o.queue > l.queue ORDER BY o.queue LIMIT 1)
    FROM leased AS l WHERE l.queue IS NOT NULL
)
SELECT queue::text FROM pending WHERE queue IS NOT NULL
UNION
SELECT queue::text FROM leased WHERE queue IS NOT NULL

-- name: dlq_queues
-- The queues with DLQ rows: a loose index scan of the (queue, failed_at) index.
WITH RECURSIVE q AS (
    (SELECT queue FROM {dlq} ORDER BY queue LIMIT 1)
    UNION ALL
    SELECT (SELECT d.queue FROM {dlq} AS d WHERE d.queue > q.queue ORDER BY d.queue LIMIT 1)
    FROM q WHERE q.queue IS NOT NULL
)
SELECT queue::text FROM q WHERE queue IS NOT NULL

-- name: admin_count
-- At most `cap` matching rows of one queue counted: what an index range scan reads in
-- milliseconds. A count that reaches the cap is replaced by the planner's estimate (the same
-- statement under EXPLAIN), so `stats` stays fast on a table of millions of rows. The table is
-- the outbox or the DLQ, the condition one of the admin_is_* blocks.
SELECT count(*)::bigint FROM (
    SELECT 1 FROM {table} WHERE queue = %(queue)s AND {condition} LIMIT %(cap)s
) AS capped

-- name: admin_explain
-- The planner's view of a statement: its estimated rows and cost, without running it.
EXPLAIN (FORMAT JSON) {statement}

-- name: admin_is_ready
-- Due rows nobody holds: a range of the pending index. Rows deep in an ordering key's line
-- (`key_blocked`, migration 0008) are not in it and count as waiting (admin_is_waiting).
acquired_token IS NULL AND NOT key_blocked AND next_attempt_at <= now()

-- name: admin_is_scheduled
-- Rows due later (delayed publishes and retries waiting for their time): the pending index.
acquired_token IS NULL AND NOT key_blocked AND next_attempt_at > now()

-- name: admin_is_waiting
-- Rows deep in an ordering key's line, behind a whole window of older rows of their key: the
-- blocked index.
key_blocked

-- name: admin_is_leased
-- Claimed rows, in flight: the lease index.
acquired_token IS NOT NULL

-- name: admin_is_expired
-- Leases past their expiry (database clock): a range of the lease index. The next claim takes
-- them over.
acquired_token IS NOT NULL AND lease_expires_at < now()

-- name: admin_is_retrying
-- Rows whose handler already failed at least once. No index covers attempts_count, so this
-- one is estimated on a large queue.
attempts_count > 0

-- name: admin_is_dead
-- DLQ rows of one reason that failed within the window (NULL: ever); only ever EXPLAINed, for
-- the estimate when admin_dlq_newest could not read every row of the window.
failure_reason = %(reason)s
AND (%(window)s::float8 IS NULL OR failed_at >= now() - make_interval(secs => %(window)s::float8))

-- name: admin_dlq_newest
-- The newest `cap` DLQ rows of one queue (a backward range of the (queue, failed_at) index),
-- counted by reason for the last hour, the last day and all of them. With `oldest` (seconds
-- since the oldest row read failed) the caller knows which windows the rows read cover.
SELECT failure_reason::text,
       count(*) FILTER (WHERE failed_at >= now() - interval '1 hour')::bigint,
       count(*) FILTER (WHERE failed_at >= now() - interval '1 day')::bigint,
       count(*)::bigint,
       extract(epoch FROM now() - min(min(failed_at)) OVER ())::float8
FROM (
    SELECT failure_reason, failed_at FROM {dlq}
    WHERE queue = %(queue)s
    ORDER BY failed_at DESC
    LIMIT %(cap)s
) AS newest
GROUP BY failure_reason
ORDER BY failure_reason

-- name: admin_oldest_ready
-- Seconds since the oldest ready row of one queue became due (0 when none): the first entry of
-- the pending index's range. A row due at -infinity (another writer's; the next claim
-- dead-letters it) is skipped: its age is no number, and the subtraction would fail.
SELECT coalesce(extract(epoch FROM now() - min(next_attempt_at)), 0)::float8
FROM {outbox}
WHERE queue = %(queue)s AND acquired_token IS NULL AND NOT key_blocked
  AND next_attempt_at <= now() AND next_attempt_at > '-infinity'::timestamptz

-- name: admin_stall
-- What says whether one queue is stalled with nobody working on it, from the database alone:
-- seconds since its oldest claimable row became due (0 when none), and whether any of its rows
-- is under a live lease. Claimable as the claim sees it: a keyed row held back by an older row
-- of its key waits by design and does not count (as in `next_due`), so the walk of the pending
-- index stops at the first row a farm would take. A due time before the year 1 (-infinity
-- included: another writer's row) counts from that bound, so it reads as very old instead of
-- failing the subtraction. A live lease is one not yet expired (or from before migration 0004,
-- which sets no expiry), under any token but the set-aside one: a row parked because nothing
-- could load it is nobody's work.
SELECT coalesce((
           SELECT extract(epoch FROM now() - greatest(c.next_attempt_at,
                                                      '0001-01-02 00:00:00+00'::timestamptz))
           FROM {outbox} AS c
           WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
             AND c.next_attempt_at <= now()
             AND (c.ordering_key IS NULL OR NOT EXISTS (
                 SELECT 1 FROM {outbox} AS older
                 WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key
                   AND older.id < c.id))
           ORDER BY c.next_attempt_at
           LIMIT 1), 0)::float8,
       EXISTS (
           SELECT 1 FROM {outbox}
           WHERE queue = %(queue)s AND acquired_token IS NOT NULL
             AND acquired_token <> %(aside)s::uuid
             AND (lease_expires_at IS NULL OR lease_expires_at >= now()))

-- name: admin_probe_limits
-- The bounds of `doctor`'s claim probe, for its transaction only (set_config's `true`: SET
-- LOCAL): it may not wait for a lock (SKIP LOCKED already passes the farm's row locks; this
-- covers a table lock such as a migration's) nor run long, whatever the table holds.
SELECT set_config('lock_timeout', %(lock_timeout)s, true),
       set_config('statement_timeout', %(statement_timeout)s, true)

-- name: dlq_expire_queue
-- DLQ retention, one batch of one queue: the oldest rows past the retention, found on the
-- (queue, failed_at) index so a pass costs the rows it deletes, not the size of the DLQ.
-- SKIP LOCKED: an operator's replay or purge holding a row is not waited for.
WITH old AS (
    SELECT id FROM {dlq}
    WHERE queue = %(queue)s AND failed_at < now() - make_interval(secs => %(age)s::float8)
    ORDER BY failed_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {dlq} AS d USING old WHERE d.id = old.id RETURNING d.id
)
SELECT count(*)::bigint FROM gone

-- name: admin_server
-- The server-wide settings `doctor` looks at. pg_notification_queue_usage() is the share of
-- the NOTIFY queue in use: a LISTENing session that stops reading holds it, and a full queue
-- makes every NOTIFY, so every publish, fail.
SELECT current_setting('server_version_num')::int, current_setting('server_version'),
       current_user::text, current_database()::text,
       current_setting('track_counts')::bool, current_setting('autovacuum')::bool,
       pg_notification_queue_usage()::float8

-- name: admin_table_health
-- Size, live and dead row versions (from the statistics, so zero with track_counts off),
-- seconds since the last VACUUM of any kind, and whether autovacuum is off for this table
-- alone. No row: no such table.
SELECT pg_total_relation_size(c.oid)::bigint,
       coalesce(s.n_live_tup, 0)::bigint,
       coalesce(s.n_dead_tup, 0)::bigint,
       extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8,
       coalesce(c.reloptions, '{{}}'::text[]) @> ARRAY['autovacuum_enabled=false']
FROM pg_class AS c
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
WHERE c.oid = to_regclass(%(table)s)

-- name: admin_xmin_holder
-- Who holds back the xmin horizon of this database, oldest first: a session's open snapshot
-- (a long or idle-in-transaction transaction), a prepared transaction, or a replication slot.
-- VACUUM cannot remove row versions deleted after that point: on an outbox, which deletes every
-- row it delivers, dead rows pile up for as long as it is held. Seconds are NULL for a slot.
SELECT kind, who, seconds, xid_age
FROM (
    SELECT 'session' AS kind,
           'pid ' || pid || ' (' || coalesce(usename::text, '-') || ', '
               || coalesce(nullif(application_name, ''), '-') || ', '
               || coalesce(state, '-') || ')' AS who,
           extract(epoch FROM now() - coalesce(xact_start, query_start))::float8 AS seconds,
           age(backend_xmin)::bigint AS xid_age
    FROM pg_stat_activity
    WHERE datname = current_database() AND backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    UNION ALL
    SELECT 'prepared transaction', gid || ' (owner ' || owner || ')',
           extract(epoch FROM now() - prepared)::float8, age(transaction)::bigint
    FROM pg_prepared_xacts
    WHERE database = current_database()
    UNION ALL
    SELECT 'replication slot', slot_name::text, NULL,
           greatest(age(xmin), age(catalog_xmin))::bigint
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL OR catalog_xmin IS NOT NULL
) AS holders
ORDER BY xid_age DESC
LIMIT 1

-- name: admin_queue_state
-- A row of `outbox_farm_queues` as the operator's tools show it (`q`), filled into the
-- statements below. `paused` is paused now: a pause whose `paused_until` has passed is over, on
-- the database's clock, the one every farm judges it by; its `paused_until` then reads NULL.
-- The columns of 0012 (limits, breaker) are read through the row's JSON image, which has them or
-- not: a database migrated to 0011 but not 0012 still shows its pauses (the limits' statements
-- say to migrate). The breaker as the runtime keeps it (`breaker_*` in control.sql): failures
-- counted in a row, and while open, since when, why, and when its next probe may run.
q.queue::text,
q.paused AND (q.paused_until IS NULL OR q.paused_until > now()) AS paused,
CASE WHEN q.paused AND q.paused_until > now() THEN q.paused_until END AS paused_until,
q.reason, q.changed_by, q.changed_at,
(to_jsonb(q) ->> 'rate_count')::int AS rate_count,
(to_jsonb(q) ->> 'rate_seconds')::float8 AS rate_seconds,
(to_jsonb(q) ->> 'max_running')::int AS max_running,
coalesce((to_jsonb(q) ->> 'breaker_failures')::int, 0) AS breaker_failures,
(to_jsonb(q) ->> 'breaker_open_since')::timestamptz AS breaker_open_since,
to_jsonb(q) ->> 'breaker_reason' AS breaker_reason,
(to_jsonb(q) ->> 'breaker_probe_at')::timestamptz AS breaker_probe_at,
(to_jsonb(q) ->> 'key_max_running')::int AS key_max_running

-- name: admin_queue_controls_kept
-- Whether the controls table exists (migration 0011), asked before reading it where its
-- absence is no error (`stats` on a database migrated by an older release): a failed read
-- would abort the caller's transaction. Unqualified, as the migration made it and the farms
-- read it: on the search path.
SELECT to_regclass('outbox_farm_queues') IS NOT NULL

-- name: admin_queue_states
-- The controls of one outbox's queues, by queue; `queue` NULL: every queue with a row.
SELECT {admin_queue_state}
FROM outbox_farm_queues AS q
WHERE q.target = %(target)s AND (%(queue)s::text IS NULL OR q.queue = %(queue)s::text)
ORDER BY q.queue

-- name: admin_queue_pause
-- Pause a queue, until `until` (a time) or for `seconds` from now (database clock), or until
-- resumed when both are NULL; a pause in force is replaced (a new end, reason and author).
-- A pause that would end already is refused by matching nothing (the caller says so): the
-- check is on the database's clock, the one the farms end the pause by.
INSERT INTO outbox_farm_queues AS q (target, queue, paused, paused_until, reason, changed_by,
                                     changed_at)
SELECT %(target)s, %(queue)s, true, e.until, %(reason)s, %(by)s, now()
FROM (SELECT coalesce(%(until)s::timestamptz,
                      now() + make_interval(secs => %(seconds)s::float8)) AS until) AS e
WHERE e.until IS NULL OR e.until > now()
ON CONFLICT (target, queue) DO UPDATE
SET paused = true, paused_until = excluded.paused_until, reason = excluded.reason,
    changed_by = excluded.changed_by, changed_at = excluded.changed_at
RETURNING {admin_queue_state}

-- name: admin_queue_resume
-- End a queue's pause. Only a queue with a row has anything to end: no row is made for one
-- that has none. The reason goes with the pause; the row keeps who resumed it and when.
UPDATE outbox_farm_queues AS q
SET paused = false, paused_until = NULL, reason = NULL, changed_by = %(by)s, changed_at = now()
WHERE q.target = %(target)s AND q.queue = %(queue)s
RETURNING {admin_queue_state}

-- name: admin_queue_limit
-- Set or clear a queue's farm-wide limits (migration 0012), leaving the pause as it is. Each
-- limit is changed only when its `set_` flag is true (NULL values then clear it). A changed
-- rate empties `tokens` (NULL: a full bucket of the new rate), so the new rate applies from
-- now rather than from a bucket sized for the old one.
INSERT INTO outbox_farm_queues AS q (target, queue, rate_count, rate_seconds, max_running,
                                     changed_by, changed_at)
VALUES (%(target)s, %(queue)s, %(rate_count)s::int, %(rate_seconds)s::float8,
        %(max_running)s::int, %(by)s, now())
ON CONFLICT (target, queue) DO UPDATE
SET rate_count = CASE WHEN %(set_rate)s THEN excluded.rate_count ELSE q.rate_count END,
    rate_seconds = CASE WHEN %(set_rate)s THEN excluded.rate_seconds ELSE q.rate_seconds END,
    tokens = CASE WHEN %(set_rate)s THEN NULL ELSE q.tokens END,
    tokens_at = CASE WHEN %(set_rate)s THEN NULL ELSE q.tokens_at END,
    max_running = CASE WHEN %(set_max)s THEN excluded.max_running ELSE q.max_running END,
    changed_by = excluded.changed_by, changed_at = excluded.changed_at
RETURNING {admin_queue_state}

-- name: admin_queue_key_limit
-- Set or clear a queue's per-key running limit (migration 0014), in the transaction of
-- `admin_queue_limit`, which made the row. `needs` names the outbox's `fair_key` (and reads no
-- row): an outbox not migrated to 0014 fails here, saying to migrate, rather than every claim
-- of the queue failing on the farms.
WITH needs AS (SELECT o.fair_key FROM {outbox} AS o LIMIT 0)
UPDATE outbox_farm_queues AS q
SET key_max_running = %(key_max_running)s::int
WHERE q.target = %(target)s AND q.queue = %(queue)s
RETURNING {admin_queue_state}

-- name: admin_queue_close_breaker
-- An operator closes a queue's open breaker now, as a probe's success would (`breaker_close`):
-- the count of failures starts again, and every farm claims the queue at the NOTIFY the caller
-- sends in the same transaction. Only an open breaker is closed; one that is not open matches
-- nothing and nothing is changed (the caller says so). `was_*`: the breaker as it was, read
-- under the row's lock, so a probe closing it at the same instant is not closed twice.
WITH was AS (
    SELECT w.target, w.queue, w.breaker_open_since, w.breaker_reason
    FROM outbox_farm_queues AS w
    WHERE w.target = %(target)s AND w.queue = %(queue)s AND w.breaker_open_since IS NOT NULL
    FOR UPDATE
)
UPDATE outbox_farm_queues AS q
SET breaker_open_since = NULL, breaker_probe_at = NULL, breaker_reason = NULL,
    breaker_failures = 0, changed_by = %(by)s, changed_at = now()
FROM was
WHERE q.target = was.target AND q.queue = was.queue AND q.breaker_open_since IS NOT NULL
RETURNING {admin_queue_state}, was.breaker_open_since AS was_open_since,
          was.breaker_reason AS was_reason
