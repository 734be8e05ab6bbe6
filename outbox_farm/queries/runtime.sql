-- name: claim
-- Index-served branches, each locking with SKIP LOCKED so concurrent fetchers never wait on
-- each other: rows whose lease expired (lease index; there is no separate reaper), then due
-- rows nobody holds (pending index, in due order). Every time is the database's clock. A
-- lease's expiry is the row's own `lease_expires_at`, set by the claim that took it and moved
-- on by that claimer's heartbeat, so runners with different lease_ttl settings agree on it.
-- Rows this runner still holds are never taken again, even when their lease ran out: `held` is
-- the tokens of its claims with rows still in hand (a handful, where their row ids would be
-- hundreds to send on every claim).
-- The `legacy` branch serves leases taken by a farm from before migration 0004, which sets no
-- expiry: they expire by this runner's lease_ttl, as they did then.
-- A row with an `ordering_key` is taken only while it is the oldest row of its queue and key
-- left in the table (one lookup in the ordering index): an older one running, waiting for a
-- retry or not yet due blocks it, across every process, until that one is deleted (acked or
-- dead-lettered). Rows without a key skip the lookup. Rows with a whole window of their key
-- before them are marked `key_blocked` and are not in the pending index (migration 0008), so
-- the walk behind a running head is at most the window long however deep the key's backlog.
-- The `far` branch takes the rows a producer scheduled beyond what any client can load
-- (`next_attempt_at` past year 9999, or +infinity): they would never fall due, so they are
-- claimed at once to be dead-lettered as invalid (one probe at the top of the pending index, and
-- only when the other branches left room).
-- `expired`, `legacy` and `far` are the sweep (`claim_sweep` and its two `claim_swept*`
-- fragments): the fetcher sends it with every claim that follows a full one, with the first
-- claim after `next_due` found something due that the last claim did not take, and at least
-- every two seconds (`Claim.sweep`), but not, in between, with the claims NOTIFYs wake on an
-- idle queue: the three branches, even skipped, cost that claim a sixth of its round trip
-- (measured: 0.61 against 0.53 ms a one-row claim), and the time an idle farm takes from a
-- commit to its handler is mostly that claim. An expired lease is due in `next_due`, so it is
-- swept as soon as the fetcher would have claimed it anyway.
-- Priorities (migration 0013): `ranked` takes due rows with a `priority` above 0, highest first,
-- then in due order, over the priority index, which holds only such rows. It is sent only for a
-- queue that has such rows (`db.claims` asks every second, `claim_ranks`): its planning alone
-- would cost every claim of a queue without priorities 7%. `ranked` takes at most three
-- quarters of the claim, rounded at random (`limit - floor(limit / 4 + random())`: a 4-row
-- claim keeps exactly 1 row, a 1-row claim keeps its row one time in four): the rest come from
-- `pending` in plain due order, whatever their priority, so rows of priority 0 keep moving
-- however many higher ones arrive. `pending` leaves out the rows `ranked` took: SKIP LOCKED
-- does not skip this statement's own locks, and a row taken twice would count twice against
-- the limit. A keyed row still waits for the older rows of its key, whatever its priority.
-- Without the three `claim_ranked*` fragments (a queue with no row above 0, a table that has
-- not had 0013) this is the statement of the release before it.
-- The UPDATE stamps one fresh lease token on the whole claim and counts the delivery. Both
-- counters are kept in [0, bigint max - 1) whatever another writer stored, so `+ 1` here and in
-- `retry` can never overflow (one such row would otherwise fail every claim of its queue).
-- RETURNING hands back only what the client can load (when every value loads, the common case,
-- `unloadable` costs four comparisons a row): a timestamp outside the years 1 to 9999
-- (an infinity, a BC date, year 10000 on; a day is kept clear of each end so any session time
-- zone still loads it) comes back NULL and `unloadable` names it (`field=value; ...`, which the
-- client words as a reason); the headers are loaded by the claim's own loader, which never
-- fails (a document that is not an object comes back marked), so one bad document fails only its
-- row. Such a row is dead-lettered as `invalid_row` (or set aside) by the fetcher instead of
-- failing the claim.
-- A claim that takes no keyed row commits without waiting for its WAL flush (`quick`: the
-- setting lasts for this statement's transaction). The flush was a third to a half of an idle
-- farm's commit-to-handler time. What it guarded is a lease, not a message: a server crash
-- that loses the claim (the last fraction of a second of WAL; a clean shutdown or restart
-- flushes it) leaves the row as it was before it, to be claimed and run again, its delivery
-- not counted; an ack, which does wait, flushes every claim written before it. A keyed row's
-- claim still waits: claimed again after such a crash, it could run beside its first run,
-- out of its key's one-at-a-time order.
WITH {claim_sweep}{claim_ranked}pending AS (
    SELECT c.id, c.ordering_key FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
      AND c.next_attempt_at <= now()
      {claim_after_ranked}
      AND (c.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {outbox} AS older
          WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key AND older.id < c.id))
    ORDER BY c.next_attempt_at
    LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
), chosen AS (
    {claim_swept}
    {claim_ranked_union}
    SELECT * FROM pending
    {claim_swept_far}
    LIMIT %(limit)s
), quick AS MATERIALIZED (
    SELECT set_config('synchronous_commit', 'off', true)
    WHERE NOT EXISTS (SELECT FROM chosen WHERE ordering_key IS NOT NULL)
), picked AS (
    SELECT chosen.id FROM chosen LEFT JOIN quick ON true
)
{take}

-- name: claim_sweep
-- A fragment of `claim`, sent with a sweep (see `claim`): rows whose lease expired, leases
-- from before migration 0004, and rows due beyond what a client can load.
expired AS (
    SELECT c.id, c.ordering_key FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NOT NULL AND c.lease_expires_at < now()
      AND c.acquired_token <> ALL(%(held)b::uuid[])
      AND (c.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {outbox} AS older
          WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key AND older.id < c.id))
    ORDER BY c.lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
), legacy AS (
    SELECT c.id, c.ordering_key FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NOT NULL AND c.lease_expires_at IS NULL
      AND c.acquired_at < now() - make_interval(secs => %(lease_ttl)s::float8)
    LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
), far AS (
    SELECT c.id, c.ordering_key FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
      AND c.next_attempt_at > '9999-12-30 00:00:00+00'::timestamptz
    LIMIT %(limit)s
    FOR UPDATE OF c SKIP LOCKED
),

-- name: claim_swept
-- A fragment of `claim`'s `chosen`: a sweep's expired leases first.
SELECT * FROM expired UNION ALL SELECT * FROM legacy UNION ALL

-- name: claim_swept_far
-- A fragment of `claim`'s `chosen`: a sweep's far rows last, only where the others left room.
UNION ALL SELECT * FROM far

-- name: claim_ranked
-- A fragment of `claim`: due rows of priority above 0, highest first, at most three quarters of
-- the claim (see `claim`). The index's order answers `ORDER BY`: no sort, however many rows.
ranked AS (
    SELECT c.id, c.ordering_key FROM {outbox} AS c
    WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
      AND c.priority > 0 AND c.next_attempt_at <= now()
      AND (c.ordering_key IS NULL OR NOT EXISTS (
          SELECT 1 FROM {outbox} AS older
          WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key AND older.id < c.id))
    ORDER BY c.priority DESC, c.next_attempt_at
    LIMIT %(limit)s::int - floor(%(limit)s::int / 4.0 + random())::int
    FOR UPDATE OF c SKIP LOCKED
),

-- name: claim_after_ranked
-- A fragment of `claim`'s `pending`: not the rows `ranked` already took.
AND c.id <> ALL(ARRAY(SELECT id FROM ranked))

-- name: claim_ranked_union
-- A fragment of `claim`'s `chosen`: the ranked rows before the plain due order.
SELECT * FROM ranked UNION ALL

-- name: claim_schema
-- Whether the outbox table has `priority` (migration 0013): asked by `db.claims` before a
-- table's first claim, so that a farm started before the migration claims without ranking
-- instead of failing. No row when the table does not exist. The table's name comes as quoted
-- text (`to_regclass`), so nothing is composed here.
SELECT EXISTS (SELECT FROM pg_attribute AS a
               WHERE a.attrelid = t.oid AND a.attname = 'priority' AND NOT a.attisdropped)
FROM (SELECT to_regclass(%(table)s) AS oid) AS t
WHERE t.oid IS NOT NULL

-- name: claim_ranks
-- Whether `queue` has a free row above priority 0 (due or not): `db.claims` sends `claim` with
-- its ranking fragments only while it has, and asks again every second. One probe of the
-- priority index (migration 0013), which holds only such rows.
SELECT EXISTS (SELECT FROM {outbox} AS c
               WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
                 AND c.priority > 0)

-- name: take
-- A fragment, the end of the claiming statements (`claim`, `ack_next`): lease the `picked`
-- rows under one fresh token and count a delivery on each (see `claim`). The ids are looked
-- up by primary key as an array, not joined: a table the planner believes empty (new, not yet
-- analyzed) could be scanned whole once per row picked. The farm's sessions refuse the one
-- whole scan this form could still get (`enable_seqscan`, see `db.pool`).
UPDATE {outbox} AS o
SET acquired_token = %(token)s, acquired_at = now(),
    lease_expires_at = now() + make_interval(secs => %(lease_ttl)s::float8),
    deliveries_count = least(greatest(o.deliveries_count, 0), 9223372036854775805) + 1,
    attempts_count = least(greatest(o.attempts_count, 0), 9223372036854775805)
FROM (VALUES ('0001-01-02 00:00:00+00'::timestamptz,
              '9999-12-30 00:00:00+00'::timestamptz)) AS b(lo, hi)
WHERE o.id = ANY(ARRAY(SELECT id FROM picked))
RETURNING o.id, o.payload, o.headers, o.deliveries_count, o.attempts_count,
          CASE WHEN o.created_at BETWEEN b.lo AND b.hi THEN o.created_at END AS created_at,
          CASE WHEN o.next_attempt_at BETWEEN b.lo AND b.hi
               THEN o.next_attempt_at END AS next_attempt_at,
          CASE WHEN o.first_attempt_at BETWEEN b.lo AND b.hi
               THEN o.first_attempt_at END AS first_attempt_at,
          o.timer_id, o.acquired_at, o.ordering_key,
          CASE WHEN o.created_at BETWEEN b.lo AND b.hi
                    AND o.next_attempt_at BETWEEN b.lo AND b.hi
                    AND (o.first_attempt_at IS NULL OR o.first_attempt_at BETWEEN b.lo AND b.hi)
                    AND (o.last_attempt_at IS NULL OR o.last_attempt_at BETWEEN b.lo AND b.hi)
               THEN NULL
               ELSE concat_ws('; ',
                   CASE WHEN o.created_at NOT BETWEEN b.lo AND b.hi
                        THEN 'created_at=' || o.created_at END,
                   CASE WHEN o.next_attempt_at NOT BETWEEN b.lo AND b.hi
                        THEN 'next_attempt_at=' || o.next_attempt_at END,
                   CASE WHEN o.first_attempt_at NOT BETWEEN b.lo AND b.hi
                        THEN 'first_attempt_at=' || o.first_attempt_at END,
                   CASE WHEN o.last_attempt_at NOT BETWEEN b.lo AND b.hi
                        THEN 'last_attempt_at=' || o.last_attempt_at END) END AS unloadable

-- name: next_due
-- Seconds (database clock) until this queue next has something to claim: the earliest pending
-- row or the earliest lease to expire. NULL when the queue is empty. Both minima are index
-- lookups on the partial indexes. (Leases from before migration 0004 carry no expiry and are
-- found by the poll.) A keyed row held back by an older row of its key is not claimable
-- however due it is: it does not count, or a fetcher would wake every millisecond for it; the
-- deletion that frees it sends a NOTIFY instead (`ack`, `dlq_move`). Marked rows are not
-- even looked at. A row another writer
-- dated ±infinity answers "now" or "not for ages" (±1e9 s) instead of failing every idle fetch;
-- a finite time costs one isfinite() more than the plain subtraction.
SELECT CASE WHEN NOT isfinite(t) THEN CASE WHEN t < now() THEN -1e9 ELSE 1e9 END
            ELSE extract(epoch FROM t - now()) END::float8
FROM (SELECT least(
    (SELECT min(c.next_attempt_at) FROM {outbox} AS c
      WHERE c.queue = %(queue)s AND c.acquired_token IS NULL AND NOT c.key_blocked
        AND (c.ordering_key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {outbox} AS older
            WHERE older.queue = c.queue AND older.ordering_key = c.ordering_key
              AND older.id < c.id))),
    (SELECT min(lease_expires_at) FROM {outbox}
      WHERE queue = %(queue)s AND acquired_token IS NOT NULL)
) AS t) AS due

-- name: moved_up
-- A fragment of the deleting statements (`ack`, `dlq_move`, `complete_in_transaction`), after
-- their `gone`: each keyed row deleted moves its key's line up one place, so the key's first
-- `key_blocked` row comes within the window and is unmarked (one probe of the blocked index,
-- which is empty unless some key is deep). The rows are looked up by primary key as an array:
-- joined to `gone`, a table the planner believes empty (new, not yet analyzed) was read whole.
moved_up AS (
    UPDATE {outbox} AS o SET key_blocked = false
    WHERE o.id = ANY(ARRAY(
        SELECT (SELECT b.id FROM {outbox} AS b
                WHERE b.queue = gone.queue AND b.ordering_key = gone.ordering_key
                  AND b.key_blocked
                ORDER BY b.id LIMIT 1)
        FROM gone WHERE gone.ordering_key IS NOT NULL))
)

-- name: free_stranded
-- Unmark the rows of a queue marked `key_blocked` that wait for nothing: the first marked row
-- of its key with no older row of the key left. The farm's deletions unmark a key's rows as its
-- line moves up, but a row marked by a publish whose transaction stayed open while the rows
-- before it were deleted, or a key whose rows an operator deleted by hand, is left marked at
-- the head. Only the first marked row of a key can be stranded, so the walk reads one entry per
-- key with marked rows (a loose scan of the blocked index; one probe when no key is deep).
-- Rows another process is unmarking are skipped, not waited for. Returns how many rows it
-- freed and wakes the fetchers (NOTIFY at commit).
WITH RECURSIVE firsts AS (
    (SELECT b.ordering_key, b.id FROM {outbox} AS b
     WHERE b.queue = %(queue)s AND b.key_blocked
     ORDER BY b.ordering_key, b.id LIMIT 1)
    UNION ALL
    SELECT n.ordering_key, n.id FROM firsts AS f, LATERAL (
        SELECT b.ordering_key, b.id FROM {outbox} AS b
        WHERE b.queue = %(queue)s AND b.key_blocked AND b.ordering_key > f.ordering_key
        ORDER BY b.ordering_key, b.id LIMIT 1) AS n
), stranded AS (
    SELECT o.id FROM {outbox} AS o JOIN firsts AS f ON o.id = f.id
    WHERE o.key_blocked
      AND NOT EXISTS (
          SELECT 1 FROM {outbox} AS older
          WHERE older.queue = o.queue AND older.ordering_key = o.ordering_key
            AND older.id < o.id)
    FOR UPDATE OF o SKIP LOCKED
), freed AS (
    UPDATE {outbox} AS o SET key_blocked = false
    FROM stranded WHERE o.id = stranded.id
    RETURNING o.id
), wake AS (
    SELECT pg_notify({notify_channel}, %(queue)s) WHERE EXISTS (SELECT 1 FROM freed)
)
SELECT count(*)::int FROM freed, (SELECT count(*) FROM wake) AS woken

-- name: ack
-- Success: delete the rows this runner still holds. Rows not returned were lost to a newer
-- lease (or are gone) and are reported as lease_lost. Deleting a keyed row may free the next
-- row of its key, which no fetcher is waiting for: one NOTIFY per queue wakes them (sent at
-- commit; unkeyed deletions send nothing), and moves its key's line up (`moved_up`).
--
-- Every write of a flush takes the same arguments: the rows' ids, and for each its lease token
-- as a position (from 1) in the short array of the flush's distinct tokens (a claim's rows
-- share one), so that no token is sent, nor read back, once per row. Each returns the
-- positions (from 0) of the rows it matched.
WITH {deleted}, wake AS (
    SELECT pg_notify({notify_channel}, queue)
    FROM (SELECT DISTINCT queue FROM gone WHERE ordering_key IS NOT NULL) AS freed
), {moved_up}
SELECT gone.n - 1 FROM gone, (SELECT count(*) FROM wake) AS woken

-- name: deleted
-- A fragment, the DELETE of `ack` and `ack_next`: the rows still held under their tokens.
gone AS (
    DELETE FROM {outbox} AS o
    USING unnest(%(ids)s::bigint[], %(slots)s::int[]) WITH ORDINALITY AS t(id, slot, n)
    WHERE o.id = t.id AND o.acquired_token = (%(tokens)b::uuid[])[t.slot]
    RETURNING t.n, o.id, o.queue, o.ordering_key
)

-- name: ack_next
-- The hand-over: `ack`, and in the same statement the claim of the next row of each key of
-- %(queue)s it deletes a row of, under the new lease %(token)s. That row becomes claimable only
-- with this deletion: taken here, it runs one round trip after the ack of the row before it,
-- instead of after a NOTIFY and a claim, and no other process is woken to find it taken. The
-- deleted rows are still visible to this statement, so the next row is the key's first row
-- not among them; it is taken while due, free and not locked, and for a key whose next row is
-- not taken (and for every other queue's keys) the NOTIFY goes out as from `ack`. One row
-- with the positions matched (`acked`, NULL when none), then the rows taken, each beside
-- them; no row taken: their columns are NULL.
WITH {deleted}, {moved_up}, heads AS (
    SELECT h.id FROM (SELECT DISTINCT ordering_key FROM gone
                      WHERE queue = %(queue)s AND ordering_key IS NOT NULL) AS k, LATERAL (
        SELECT c.id FROM {outbox} AS c
        WHERE c.queue = %(queue)s AND c.ordering_key = k.ordering_key
          AND c.id <> ALL(ARRAY(SELECT id FROM gone))
        ORDER BY c.id LIMIT 1) AS h
), picked AS (
    SELECT c.id FROM {outbox} AS c
    WHERE c.id = ANY(ARRAY(SELECT id FROM heads))
      AND c.acquired_token IS NULL AND NOT c.key_blocked AND c.next_attempt_at <= now()
    FOR UPDATE OF c SKIP LOCKED
), taken AS (
    {take}
), wake AS (
    SELECT pg_notify({notify_channel}, freed.queue)
    FROM (SELECT queue, count(DISTINCT ordering_key) AS keys FROM gone
          WHERE ordering_key IS NOT NULL GROUP BY queue) AS freed
    WHERE freed.queue <> %(queue)s OR freed.keys > (SELECT count(*) FROM taken)
)
SELECT acks.acked, taken.*
FROM (SELECT array_agg(n - 1) AS acked FROM gone) AS acks
LEFT JOIN taken ON true, (SELECT count(*) FROM wake) AS woken

-- name: retry
-- Handler ran and failed, try again later: count the attempt, set the next due time from the
-- database clock, and give up the lease so any process may take the row when it is due. A due
-- time is kept before the year 9999 (what a client can load, and the table's values check
-- admits) whatever delay the retry strategy chose.
UPDATE {outbox} AS o
SET next_attempt_at = least(now() + make_interval(secs => least(t.delay, 1e11)),
                            '9999-12-29 00:00:00+00'::timestamptz),
    attempts_count = o.attempts_count + t.ran,
    first_attempt_at = CASE WHEN t.ran > 0 THEN coalesce(o.first_attempt_at, t.started_at)
                            ELSE o.first_attempt_at END,
    last_attempt_at = CASE WHEN t.ran > 0 THEN t.started_at ELSE o.last_attempt_at END,
    acquired_token = NULL,
    acquired_at = NULL,
    lease_expires_at = NULL
FROM unnest(%(ids)s::bigint[], %(slots)s::int[], %(delays)b::float8[], %(ran)b::int[],
            %(started)b::timestamptz[]) WITH ORDINALITY AS t(id, slot, delay, ran, started_at, n)
WHERE o.id = t.id AND o.acquired_token = (%(tokens)b::uuid[])[t.slot]
RETURNING t.n - 1

-- name: release
-- Claimed but never handed to a handler (graceful stop, or its lease ran short while it
-- waited): clear the lease so another process takes the row at once, and take back the
-- delivery this claim counted.
UPDATE {outbox} AS o
SET acquired_token = NULL, acquired_at = NULL, lease_expires_at = NULL,
    deliveries_count = greatest(o.deliveries_count - 1, 0)
FROM unnest(%(ids)s::bigint[], %(slots)s::int[]) WITH ORDINALITY AS t(id, slot, n)
WHERE o.id = t.id AND o.acquired_token = (%(tokens)b::uuid[])[t.slot]
RETURNING t.n - 1

-- name: dlq_move
-- Terminal failure with a DLQ: the DELETE feeds the INSERT in one statement, so the row is
-- either archived and gone, or (the INSERT failed) still here under its lease. A lost lease
-- deletes nothing and therefore archives nothing. A keyed row's move wakes the fetchers and
-- moves its key's line up, as `ack` does: it may free the next row of its key.
WITH t AS (
    SELECT * FROM unnest(%(ids)s::bigint[], %(slots)s::int[], %(reasons)b::text[],
                         %(exceptions)b::text[]) WITH ORDINALITY AS t(id, slot, reason, exc, n)
), gone AS (
    DELETE FROM {outbox} AS o
    USING t
    WHERE o.id = t.id AND o.acquired_token = (%(tokens)b::uuid[])[t.slot]
    RETURNING o.id, o.queue, o.payload, o.headers, o.deliveries_count, o.created_at,
              o.timer_id, t.reason, t.exc, t.n, o.ordering_key
), moved AS (
    INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, created_at,
                       failure_reason, last_exception, timer_id)
    SELECT id, queue, payload, headers, deliveries_count, created_at, reason, exc, timer_id
    FROM gone
    RETURNING original_id
), wake AS (
    SELECT pg_notify({notify_channel}, queue)
    FROM (SELECT DISTINCT queue FROM gone WHERE ordering_key IS NOT NULL) AS freed
), {moved_up}
SELECT gone.n - 1
FROM gone JOIN moved ON moved.original_id = gone.id, (SELECT count(*) FROM wake) AS woken

-- name: gauges
-- Database-derived gauges, one row per queue: backlog (rows not yet acked), age of the oldest
-- due row nobody holds, both on the database clock. A due time of -infinity (another writer's
-- row, dead-lettered at its first claim) would make the age infinite and the subtraction fail:
-- only finite due times count.
SELECT queue,
       count(*)::bigint,
       coalesce(extract(epoch FROM now() - min(next_attempt_at)
                FILTER (WHERE acquired_token IS NULL AND next_attempt_at <= now()
                          AND isfinite(next_attempt_at))), 0)::float8
FROM {outbox}
GROUP BY queue

-- name: dlq_gauges
-- DLQ rows per queue and failure reason (the dashboards split DLQ volume by reason).
SELECT queue, failure_reason, count(*)::bigint FROM {dlq} GROUP BY queue, failure_reason

-- name: dlq_signature
-- What moves whenever the DLQ's rows may have changed, read without touching them: the file
-- the table lives in (TRUNCATE and VACUUM FULL give it a new one) and the statistics' count of
-- rows inserted, updated and deleted (aborted ones included: a needless recount, never a
-- missed one). NULL counts when the server keeps none (track_counts off). No row: no table.
SELECT c.relfilenode::bigint,
       CASE WHEN current_setting('track_counts')::bool
            THEN s.n_tup_ins + s.n_tup_upd + s.n_tup_del END::bigint
FROM pg_class AS c
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
WHERE c.oid = to_regclass(%(table)s)

-- name: vacuum_state
-- Whether this role may vacuum the outbox table (owner, or MAINTAIN from PostgreSQL 17 on;
-- VACUUM itself only warns and skips otherwise), how many dead row versions the statistics
-- count, seconds since anyone (autovacuum included) last vacuumed it, and whether the server
-- keeps those counts at all (track_counts off: nothing is counted, and autovacuum cannot run).
-- The CASE keeps the MAINTAIN test from running on servers that do not know the privilege.
-- No row: no such table.
SELECT pg_has_role(c.relowner, 'USAGE')
           OR CASE WHEN current_setting('server_version_num')::int >= 170000
                   THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END,
       coalesce(s.n_dead_tup, 0)::bigint,
       extract(epoch FROM now() - greatest(s.last_vacuum, s.last_autovacuum))::float8,
       current_setting('track_counts')::bool
FROM pg_class AS c
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
WHERE c.oid = to_regclass(%(table)s)

-- name: vacuum
-- SKIP_LOCKED: if autovacuum or another farm process is already at it, skip (a warning with
-- SQLSTATE 55P03) rather than queue behind it. TRUNCATE false: giving the empty tail back to
-- the OS takes an ACCESS EXCLUSIVE lock that stalls every claim and publish, and a queue table
-- grows back into that space within seconds anyway.
VACUUM (SKIP_LOCKED, TRUNCATE false) {outbox}

-- name: shrink_state
-- For the shrink after a backlog (`chores.shrink`): the outbox table, then each of its indexes,
-- with their size in bytes and in pages, and on the table's row the rows ever inserted into it
-- by the statistics (NULL when the server keeps none: track_counts off), whose growth from one
-- pass to the next says how busy the table is. The live rows are counted apart
-- (`shrink_live`): the catalog's and the statistics' estimates both come from the last VACUUM,
-- which scales the density it saw while the table was full to the pages it skips, and after a
-- drain they stayed in the tens of thousands for minutes. No row: no such table.
-- Each index's kind:
-- - `unique`: a unique index other than the primary key, never rebuilt: a publish's ON CONFLICT
--   takes it as its arbiter, and a rebuild beside such INSERTs is where the server has had bugs;
-- - `leftover`: invalid, named as REINDEX CONCURRENTLY names its copies (`<name>_ccnew`,
--   `<name>_ccold`, a digit after either when the name was taken), no index build under way on
--   the table (a user's REINDEX CONCURRENTLY has such copies while it runs), and this role may
--   drop it (owns it: MAINTAIN allows a rebuild, not a drop). The remains of a rebuild cut
--   short, which writes still maintain and nothing reads. Any other invalid index is a
--   user's, and not listed;
-- - `index`: any other.
SELECT n.nspname::text, c.relname::text, 'table',
       pg_relation_size(c.oid)::bigint,
       (pg_relation_size(c.oid) / current_setting('block_size')::int)::bigint,
       CASE WHEN current_setting('track_counts')::bool THEN s.n_tup_ins END::bigint
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
WHERE c.oid = to_regclass(%(table)s)
UNION ALL
(SELECT n.nspname::text, ic.relname::text,
        CASE WHEN NOT i.indisvalid THEN 'leftover'
             WHEN i.indisunique AND NOT i.indisprimary THEN 'unique'
             ELSE 'index' END,
        pg_relation_size(ic.oid)::bigint,
        (pg_relation_size(ic.oid) / current_setting('block_size')::int)::bigint,
        NULL::bigint
 FROM pg_index AS i
 JOIN pg_class AS ic ON ic.oid = i.indexrelid
 JOIN pg_namespace AS n ON n.oid = ic.relnamespace
 WHERE i.indrelid = to_regclass(%(table)s)
   AND (i.indisvalid
        OR ic.relname ~ '_cc(new|old)[0-9]*$'
           AND pg_has_role(ic.relowner, 'USAGE')
           AND NOT EXISTS (SELECT FROM pg_stat_progress_create_index AS p
                           WHERE p.relid = i.indrelid))
 ORDER BY 2)

-- name: shrink_live
-- The live rows of the outbox table, counted up to %(limit)s along the primary key (an
-- index-only scan where the visibility map allows): its cost is bounded by the limit, whatever
-- the table holds, and a table just filled by a backlog is never taken for an empty one.
SELECT count(*)::bigint FROM (SELECT 1 FROM {outbox} ORDER BY id LIMIT %(limit)s) AS live

-- name: shrink_begin
-- One shrink of a table at a time across every farm (a session lock, let go by `shrink_end`
-- or with the session), and the limits of its statements (session settings of the shrink's
-- pooled connection, put back by `shrink_end`): `lock_timeout` for the drops and the VACUUM, so
-- none queues behind a migration; `statement_timeout` for the rebuilds, which run without a
-- lock timeout (see `shrink_reindex`). False, and nothing set: another session shrinks it.
SELECT CASE WHEN pg_try_advisory_lock(hashtextextended('outbox_farm shrink ' || %(table)s, 0))
            THEN set_config('lock_timeout', %(lock_timeout)s, false) IS NOT NULL
                 AND set_config('statement_timeout', %(statement_timeout)s, false) IS NOT NULL
            ELSE false END

-- name: shrink_rebuilding
-- Before the rebuilds: no lock timeout (see `shrink_reindex`).
SELECT set_config('lock_timeout', '0', false)

-- name: shrink_end
-- The lock let go and the settings `shrink_begin` changed put back, in one round trip; a
-- connection on which this fails is closed rather than handed back to the pool.
SELECT pg_advisory_unlock(hashtextextended('outbox_farm shrink ' || %(table)s, 0)),
       (SELECT count(set_config(name, reset_val, false)) FROM pg_settings
        WHERE name IN ('lock_timeout', 'statement_timeout'))

-- name: shrink_vacuum
-- The shrink's VACUUM: as `vacuum`, but giving the empty tail of the table back to the OS. The
-- ACCESS EXCLUSIVE lock that takes is never waited for: the server tries it for up to five
-- seconds and gives up. Once it holds it, it checks every 32 pages it reads back from the end
-- whether anyone waits for the table, and if so truncates what it has read and tries again
-- later; the truncation itself (its WAL record flushed, the table's pages dropped from shared
-- buffers) happens under the lock too, and a standby replays it under the same lock. On a quiet
-- table (the only kind a shrink touches) that is a few such waits, once per backlog. Giving up
-- is logged only at DEBUG2, so what it gave back is read from the table's size.
-- INDEX_CLEANUP ON: with only a few dead rows left, VACUUM would otherwise skip the indexes and
-- leave each row's line pointer in its page, which then counts as in use: the last row deleted
-- would keep the whole file.
VACUUM (SKIP_LOCKED, TRUNCATE true, INDEX_CLEANUP ON) {outbox}

-- name: shrink_reindex
-- An index rebuilt beside the old one, which is dropped once the new one is valid. Its locks
-- (SHARE UPDATE EXCLUSIVE on the table, then on the indexes) never block a claim, an ack or a
-- publish. Its waits (for the transactions older than the new index, then for those still
-- using the old one) are lock waits a lock timeout would cut, after the build, leaving its copy
-- invalid: so it runs without one, bounded by `statement_timeout` instead. Cut short, its copy
-- is a `leftover` of `shrink_state`. {index} is composed by `db.housekeeping`.
REINDEX INDEX CONCURRENTLY {index}

-- name: shrink_drop
-- A leftover of a rebuild cut short. {index} is composed by `db.housekeeping`.
DROP INDEX CONCURRENTLY IF EXISTS {index}

-- name: set_aside
-- A claimed row the farm cannot load, with nowhere to dead-letter it (no DLQ table): parked
-- under the set-aside token (the nil uuid, which no runner ever takes and a dead worker's release
-- never frees) until %(seconds)s from now, when the claim's expired branch takes it again and it
-- is reported again. Its lease stays set because a row that breaks the table's value checks
-- (written before migration 0006, or by a role that bypasses them) may only change while leased.
-- Token-guarded like every write: a row not returned was lost to another lease.
UPDATE {outbox} AS o
SET acquired_token = %(aside)s, acquired_at = now(),
    lease_expires_at = now() + make_interval(secs => %(seconds)s::float8)
FROM unnest(%(ids)s::bigint[]) AS t(id)
WHERE o.id = t.id AND o.acquired_token = %(token)s
RETURNING o.id

-- name: release_worker
-- A dead worker's leases, freed by its supervisor: its tokens are the range [low, high] (the
-- worker id is their first four bytes, and uuids compare bytewise). `acquired_token IS NOT
-- NULL` is the lease index's predicate, so only leased rows are read. deliveries_count is
-- kept: the dead worker's delivery counts toward max_deliveries.
UPDATE {outbox}
SET acquired_token = NULL, acquired_at = NULL, lease_expires_at = NULL
WHERE acquired_token IS NOT NULL AND acquired_token BETWEEN %(low)s AND %(high)s

-- name: extend_leases
-- The heartbeat: one statement for every running row of a queue. Token-guarded like every
-- write, so a lease another runner took over is not extended; the rows not returned are lost.
UPDATE {outbox} AS o
SET lease_expires_at = now() + make_interval(secs => %(lease_ttl)s::float8)
FROM unnest(%(ids)b::bigint[], %(tokens)b::uuid[]) AS t(id, token)
WHERE o.id = t.id AND o.acquired_token = t.token
RETURNING o.id

-- name: lease_holders
-- After a write was sent again on a new connection (the first reply was lost): who holds the
-- rows it did not match. Another token: the lease was lost. No row, or no token: the first
-- attempt most likely committed, so the outcome is unconfirmed rather than lost.
SELECT id, acquired_token FROM {outbox} WHERE id = ANY(%(ids)b::bigint[])

-- name: listen
-- The farm's wake-ups: every NOTIFY on `outbox_<table>` names a queue with rows due now. Run on
-- a connection of its own, never a pooled one: LISTEN belongs to the session. The channel is
-- not a table, so this block is composed by `db.listen` with the channel's identifier.
LISTEN {channel}

-- name: listen_check
-- Between waits for NOTIFY: a LISTEN connection that died quietly (a dropped network path) says
-- so only when used, and until then no wake-up arrives.
SELECT 1

-- name: complete_in_transaction
-- A transactional handler's ack, inside the handler's own transaction, after its writes: the
-- row goes only while this runner's lease still holds, and it goes or stays with those writes.
-- Nothing returned: the lease was lost, and the transaction is rolled back. A keyed row wakes
-- the fetchers at commit and moves its key's line up, as `ack` does.
WITH gone AS (
    DELETE FROM {outbox}
    WHERE id = %(id)s AND acquired_token = %(token)s
    RETURNING id, queue, ordering_key
), wake AS (
    SELECT pg_notify({notify_channel}, queue) FROM gone WHERE ordering_key IS NOT NULL
), {moved_up}
SELECT gone.id FROM gone, (SELECT count(*) FROM wake) AS woken
