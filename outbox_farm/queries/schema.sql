-- name: table_oid
-- NULL when the table does not exist; takes the name as text so nothing is composed here.
SELECT to_regclass(%(table)s)::oid

-- name: columns
-- Type, nullability and whether a default exists, as Postgres itself formats them.
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull, a.atthasdef
FROM pg_attribute AS a
WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped

-- name: indexes
-- Each usable index with its key columns in order, uniqueness and partial predicate (NULL if
-- none). An INVALID index (a failed CREATE INDEX CONCURRENTLY) serves no query: left out.
SELECT c.relname,
       array(SELECT a.attname FROM unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
             JOIN pg_attribute AS a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
             ORDER BY k.n)::text[],
       i.indisunique,
       i.indisprimary,
       pg_get_expr(i.indpred, i.indrelid)
FROM pg_index AS i
JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = %(oid)s AND i.indisvalid

-- name: checks
-- CHECK constraints by definition; the lease check is matched by what it says, not its name.
SELECT conname, pg_get_constraintdef(oid)
FROM pg_constraint
WHERE conrelid = %(oid)s AND contype = 'c'

-- name: dlq_cause_objects
-- What migration 0009 made beside a DLQ, looked up by name in the DLQ's own schema (where 0009
-- makes them): the cause function, the counts table, the enabled triggers that call the
-- counting function, and whether a valid index of the DLQ uses the cause function (its key is
-- an expression, which the indexes block cannot show: found through the index's dependency).
SELECT EXISTS (SELECT FROM pg_proc AS p
               WHERE p.pronamespace = t.relnamespace AND p.proname = %(cause_fn)s
                 AND p.proargtypes = '25'::oidvector),
       EXISTS (SELECT FROM pg_class AS c
               WHERE c.relnamespace = t.relnamespace AND c.relname = %(causes)s
                 AND c.relkind IN ('r', 'p')),
       array(SELECT g.tgname FROM pg_trigger AS g JOIN pg_proc AS p ON p.oid = g.tgfoid
             WHERE g.tgrelid = t.oid AND g.tgenabled <> 'D'
               AND p.pronamespace = t.relnamespace AND p.proname = %(causes_count)s
             ORDER BY 1)::text[],
       EXISTS (SELECT FROM pg_index AS i
               JOIN pg_depend AS d ON d.classid = 'pg_class'::regclass
                                  AND d.objid = i.indexrelid
                                  AND d.refclassid = 'pg_proc'::regclass
               JOIN pg_proc AS p ON p.oid = d.refobjid
               WHERE i.indrelid = t.oid AND i.indisvalid
                 AND p.pronamespace = t.relnamespace AND p.proname = %(cause_fn)s)
FROM pg_class AS t
WHERE t.oid = %(oid)s
