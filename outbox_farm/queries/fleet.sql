-- name: fleet_beat
-- One round of a fleet's process, first statement: say it is alive until `ttl` seconds from now
-- (the database's clock: one clock for every host), forget the fleet's processes that stopped
-- saying so, and count the live ones, itself included. In one statement so that the count sees
-- this process's own row.
WITH beat AS (
    INSERT INTO outbox_farm_fleet_members AS m (fleet, member, host, pid, expires_at)
    VALUES (%(fleet)s, %(member)s, %(host)s, %(pid)s, now() + make_interval(secs => %(ttl)s))
    ON CONFLICT (fleet, member) DO UPDATE SET expires_at = excluded.expires_at
    RETURNING 1
), gone AS (
    DELETE FROM outbox_farm_fleet_members
    WHERE fleet = %(fleet)s AND expires_at < now() AND member <> %(member)s
)
SELECT 1 + count(*) FROM outbox_farm_fleet_members
WHERE fleet = %(fleet)s AND expires_at >= now() AND member <> %(member)s;

-- name: fleet_renew
-- Second statement: extend every lease this process still holds; the ones it lost (taken
-- after they expired, while this process could not reach the database) do not come back, and
-- the caller stops serving them.
UPDATE outbox_farm_fleet_leases
SET expires_at = now() + make_interval(secs => %(ttl)s)
WHERE fleet = %(fleet)s AND holder = %(member)s
RETURNING database;

-- name: fleet_free
-- The databases of `databases` (in the caller's order of preference) nobody holds now:
-- candidates to take. Read without locks; `fleet_take` settles races.
SELECT d.database
FROM unnest(%(databases)s::text[]) WITH ORDINALITY AS d (database, ord)
LEFT JOIN outbox_farm_fleet_leases AS l ON l.fleet = %(fleet)s AND l.database = d.database
WHERE l.database IS NULL OR l.expires_at < now()
ORDER BY d.ord
LIMIT %(limit)s;

-- name: fleet_take
-- Take the databases found free: one another process took since, or renewed, stays its own
-- (the ON CONFLICT's WHERE reads the row as it is now, under its lock). What comes back is
-- what this process took.
INSERT INTO outbox_farm_fleet_leases AS l (fleet, database, holder, expires_at)
SELECT %(fleet)s, t.database, %(member)s, now() + make_interval(secs => %(ttl)s)
FROM unnest(%(databases)s::text[]) AS t (database)
ON CONFLICT (fleet, database) DO UPDATE
SET holder = excluded.holder, taken_at = now(), expires_at = excluded.expires_at
WHERE l.expires_at < now()
RETURNING database;

-- name: fleet_release
-- Give up these databases (drained, or no longer in the set): deleted rather than expired, so
-- another process takes them at its next round instead of after the lease time.
DELETE FROM outbox_farm_fleet_leases
WHERE fleet = %(fleet)s AND holder = %(member)s AND database = ANY(%(databases)s::text[]);

-- name: fleet_leave
-- A process that stops: its member row and every lease it holds, at once, so the others count
-- it out and take its databases at their next round. Also run by the arbiter for a worker
-- that died, on that worker's behalf.
WITH leases AS (
    DELETE FROM outbox_farm_fleet_leases WHERE fleet = %(fleet)s AND holder = %(member)s
)
DELETE FROM outbox_farm_fleet_members WHERE fleet = %(fleet)s AND member = %(member)s;

-- name: fleet_assignments
-- Who serves what, for operators: every lease of the fleet, live or not.
SELECT l.database, l.holder, l.expires_at >= now(),
    extract(epoch FROM l.expires_at - now())::float8
FROM outbox_farm_fleet_leases AS l
WHERE l.fleet = %(fleet)s
ORDER BY l.database;

-- name: fleet_tables
-- Whether the fleet's tables exist, before a fleet starts on this home database.
SELECT to_regclass('outbox_farm_fleet_leases') IS NOT NULL
    AND to_regclass('outbox_farm_fleet_members') IS NOT NULL;

-- name: fleet_members
-- The fleet's live processes, for operators, with how many databases each holds now.
SELECT m.member, m.host, m.pid, m.started_at,
    (SELECT count(*) FROM outbox_farm_fleet_leases AS l
     WHERE l.fleet = m.fleet AND l.holder = m.member AND l.expires_at >= now())
FROM outbox_farm_fleet_members AS m
WHERE m.fleet = %(fleet)s AND m.expires_at >= now()
ORDER BY m.host, m.pid;
