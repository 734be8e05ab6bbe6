-- name: migrations_table
-- What `outbox-farm migrate` applied, per target table, so re-runs are no-ops.
CREATE TABLE IF NOT EXISTS outbox_farm_migrations (
    target     text NOT NULL,
    version    integer NOT NULL,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target, version)
)

-- name: migration_applied
-- The checksum of an applied migration, if it was applied.
SELECT checksum FROM outbox_farm_migrations WHERE target = %(target)s AND version = %(version)s

-- name: migration_record
-- Written in the same transaction as the migration itself.
INSERT INTO outbox_farm_migrations (target, version, name, checksum)
VALUES (%(target)s, %(version)s, %(name)s, %(checksum)s)

-- name: migrate_lock
-- Session-level, so it spans the per-migration transactions; concurrent runs take turns.
SELECT pg_advisory_lock(%(key)s)

-- name: migrate_unlock
-- Released explicitly; a crashed run releases it by ending its session.
SELECT pg_advisory_unlock(%(key)s)

-- name: migration_forget
-- The records of a target table that no longer exists (`table_oid` finds no table by that
-- name: its records describe nothing any more), so its migrations are applied again from the
-- first. Should that fail, table and records agree again: neither is there.
DELETE FROM outbox_farm_migrations WHERE target = %(target)s

-- name: migrations_readable
-- Whether this role can read `outbox_farm_migrations`: a schema made from `outbox-farm sql` has
-- no such table, and the farm's own role need not be granted it (the CASE asks for the privilege
-- only of a table that exists).
SELECT CASE WHEN to_regclass('outbox_farm_migrations') IS NULL THEN false
            ELSE has_table_privilege(to_regclass('outbox_farm_migrations')::oid, 'SELECT') END

-- name: migrations_recorded
-- What `migrate` recorded for these tables, for `check`: a version this release does not ship
-- was applied by a newer release. Asked only when `migrations_readable`.
SELECT target, version, name FROM outbox_farm_migrations
WHERE target = ANY(%(targets)s::text[])
ORDER BY version
