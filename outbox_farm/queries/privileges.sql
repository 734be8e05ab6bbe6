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
