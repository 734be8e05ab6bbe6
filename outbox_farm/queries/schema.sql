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
