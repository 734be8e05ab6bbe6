-- name: code_publish
-- This worker's handler fingerprints, one row per queue, renewed until `ttl` seconds from now
-- on the database clock; `since` moves only when the fingerprint changes, so it says how long
-- this code has run here. Expired rows (processes that stopped) go in the same statement: any
-- process cleans up after every other, and none needs a clock of its own. Its own rows are
-- left to the INSERT: one statement may not both delete and update a row. `note`: what the
-- process says of its code (its farm's last reload failed), or NULL.
WITH gone AS (
    DELETE FROM outbox_farm_code WHERE expires_at < now() AND worker <> %(worker)s
)
INSERT INTO outbox_farm_code AS c (target, queue, worker, fingerprint, expires_at, note)
SELECT %(target)s, q.queue, %(worker)s, q.fingerprint, now() + make_interval(secs => %(ttl)s),
       %(note)s
FROM unnest(%(queues)s::text[], %(fingerprints)s::text[]) AS q (queue, fingerprint)
ON CONFLICT (target, queue, worker) DO UPDATE
SET expires_at = EXCLUDED.expires_at,
    note = EXCLUDED.note,
    fingerprint = EXCLUDED.fingerprint,
    since = CASE WHEN c.fingerprint = EXCLUDED.fingerprint THEN c.since ELSE now() END

-- name: code_seen
-- Every live fingerprint of the outbox's queues (or of `queues` only, when given): how many
-- processes run it, since when the first of them does (seconds ago), a few of them by name,
-- and their notes. Ordered so that the output is stable.
SELECT queue,
       fingerprint,
       count(*)::int,
       extract(epoch FROM now() - min(since))::float8,
       (array_agg(worker ORDER BY worker))[1:3],
       array_agg(DISTINCT note) FILTER (WHERE note IS NOT NULL)
FROM outbox_farm_code
WHERE target = %(target)s AND expires_at >= now()
  AND (%(queues)s::text[] IS NULL OR queue = ANY (%(queues)s::text[]))
GROUP BY queue, fingerprint
ORDER BY queue, min(since)

-- name: code_forget
-- A stopping process's rows: it runs no code any more, whatever their expiry says, and a
-- rolling deploy that completed must not look half done for another TTL.
DELETE FROM outbox_farm_code WHERE target = %(target)s AND worker = %(worker)s
