-- name: table_privileges
-- What the current role may do with one table, read from the catalogs alone: to_regclass would
-- raise "permission denied for schema" instead of saying that USAGE is what is missing. An
-- unqualified name is looked up along the effective search path, like the farm's statements.
-- The id column's sequence (bigserial) needs USAGE for every INSERT. VACUUM needs ownership,
-- or MAINTAIN from PostgreSQL 17 on (the CASE keeps older servers from parsing the privilege).
-- No row: no such table (the schema check reports that).
SELECT current_user::text,
       n.nspname::text,
       has_schema_privilege(n.oid, 'USAGE'),
       has_table_privilege(c.oid, 'SELECT'),
       has_table_privilege(c.oid, 'INSERT'),
       has_table_privilege(c.oid, 'UPDATE'),
       has_table_privilege(c.oid, 'DELETE'),
       pg_has_role(c.relowner, 'USAGE')
           OR CASE WHEN current_setting('server_version_num')::int >= 170000
                   THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END,
       seq.nspname::text,
       seq.relname::text,
       seq.oid IS NULL OR has_sequence_privilege(seq.oid, 'USAGE')
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN LATERAL (
    SELECT s.oid, s.relname, sn.nspname
    FROM pg_attribute AS a
    JOIN pg_depend AS d ON d.refclassid = 'pg_class'::regclass AND d.refobjid = c.oid
                       AND d.refobjsubid = a.attnum AND d.classid = 'pg_class'::regclass
    JOIN pg_class AS s ON s.oid = d.objid AND s.relkind = 'S'
    JOIN pg_namespace AS sn ON sn.oid = s.relnamespace
    WHERE a.attrelid = c.oid AND a.attname = 'id'
    LIMIT 1
) AS seq ON true
WHERE c.relname = %(name)s AND c.relkind IN ('r', 'p')
  AND CASE WHEN %(schema)s::text IS NULL THEN n.nspname = ANY (current_schemas(false))
           ELSE n.nspname = %(schema)s::text END
ORDER BY array_position(current_schemas(false), n.nspname)
LIMIT 1

-- name: grant_table
-- Printed for an owner to run, never run by the farm. {privileges} are keywords of ours.
GRANT {privileges} ON TABLE {table} TO {role};

-- name: grant_schema
-- Printed for an owner to run, never run by the farm.
GRANT USAGE ON SCHEMA {schema} TO {role};

-- name: grant_sequence
-- Printed for an owner to run, never run by the farm: INSERTs take the next id from it.
GRANT USAGE ON SEQUENCE {sequence} TO {role};

-- name: try_writes_begin
-- The writes are tried in a transaction that is rolled back. A lock that a migration or a
-- manual LOCK holds on a table must not hang `check` or `start`: it waits this long at most
-- (set_config, as SET takes no parameter; true: for this transaction only).
SELECT set_config('lock_timeout', %(lock_wait)s, true)

-- name: try_outbox_insert
-- What a producer does. The row is rolled back with the transaction; its id is not given back
-- to the sequence (a gap, as after any rollback). Triggers on the table run as for any row.
INSERT INTO {outbox} (queue, payload) VALUES ('outbox-farm privilege check', '\x') RETURNING id

-- name: try_outbox_update
-- What a claim, a retry and a lease extension do, to the row just inserted (or to none).
UPDATE {outbox} SET next_attempt_at = next_attempt_at WHERE id = %(id)s

-- name: try_outbox_delete
-- What an ack and a dead-letter move do.
DELETE FROM {outbox} WHERE id = %(id)s

-- name: try_dlq_insert
-- What a dead-letter move writes (its triggers, if any, run as for a real move).
INSERT INTO {dlq} (original_id, queue, payload, deliveries_count, created_at, failure_reason)
VALUES (0, 'outbox-farm privilege check', '\x', 0, now(), 'rejected')

-- name: role_read_write
-- Printed for an owner to run, never run by the farm: a role's own setting of
-- default_transaction_read_only (the database's is ALTER DATABASE ... SET, the same way).
ALTER ROLE {role} SET default_transaction_read_only = off;
