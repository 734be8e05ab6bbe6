-- target: dlq
-- Dead letters grouped by cause: "KeyError('sku') x 30, TimeoutError() x 10" instead of
-- "retry_terminal 40". A row's cause is its `last_exception` normalised by the function below,
-- so rows that differ only in volatile parts (ids, counts, addresses) fall into one group.
--
-- An index alone does not answer "how many rows per cause" fast enough: counting a million
-- entries of an index on the cause reads all of them, 100 to 300 ms on a 2-core machine when
-- every page is all-visible and the index covers the cause alone, and an expression index
-- cannot even be read index-only (the planner wants `last_exception` itself, which no btree
-- can hold). So the counts are kept: `{dlq_causes}` holds one row per queue, failure reason
-- and cause with how many DLQ rows it has, kept exact by statement-level triggers on the DLQ
-- (inserts, deletes, updates, TRUNCATE), whatever writes the rows: the farm's dead-letter
-- move, `dlq replay` and `purge`, retention, another writer. Grouping then reads a few rows
-- per cause, milliseconds whatever the DLQ's size. The expression index on the cause serves
-- the other half: the rows of one cause, newest first (`dlq list --cause`, the console's
-- group page, a replay or purge of one group).
--
-- A trigger runs once per statement, over the rows the statement changed (its transition
-- tables), so a batch of 1,000 dead letters costs one grouped upsert, not 1,000. The upsert
-- takes the count rows it touches in key order: two batches never wait on each other in a
-- cycle. It holds them until its transaction ends, which for the farm's dead-letter move is
-- the flush it is part of. SECURITY DEFINER: the farm's role needs no privilege on the counts
-- table (its INSERT on the DLQ is what it always needed). Running with its owner's rights
-- (often a superuser's), whoever writes the DLQ, it must call nothing another role could
-- define: its search path is pg_catalog alone (pg_temp named last, so a session's temporary
-- table cannot stand in for a table either), it names the counts table and the cause function
-- with the schema they were created in, and its casts are written out.
--
-- The recount below and the plain CREATE INDEX (the migration runs in one transaction, and a
-- concurrent build cannot run in one) hold off every write to the DLQ until this migration
-- commits: about a minute per million DLQ rows on a 2-core machine (54 s measured for one
-- million). Not only dead-lettering waits: a worker's completer sends a flush's writes one
-- after another on one connection, so once one of them is a DLQ move, the acks and retries
-- behind it wait too, in every process that has a dead letter to write. Nothing is lost
-- (the flush completes when the migration commits), but delivery stalls meanwhile: migrate
-- a large DLQ at a quiet moment, or purge what is no longer needed first (`outbox-farm dlq
-- purge --until ...`). The recount makes the counts true whenever this migration runs
-- (`migrate --repair` after a restore or a bulk load that ran with triggers disabled, e.g.
-- `session_replication_role = replica`). Code of the previous release neither reads nor
-- needs any of this: the triggers keep the counts whoever writes.

-- Every object of this migration is made in the DLQ's own schema (found through its row type,
-- as in 0004), also when the table's name carries none; search_path is put back at the end,
-- before the migration is recorded.
SELECT set_config('outbox_farm.search_path', current_setting('search_path'), true);
SELECT set_config('search_path', quote_ident(n.nspname), true)
FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
WHERE t.oid = pg_typeof(NULL::{dlq});

-- The cause of one `last_exception`, at most 200 characters:
--   * NULL, empty or blank: "(no exception recorded)";
--   * a Python traceback (another writer's) is represented by its last line, the exception;
--     any other text by its first line (the repr; the frames the farm appends come after it);
--   * UUIDs become <uuid>; hex numbers (0x7f3a...) and runs of 16 or more hex digits (hashes,
--     tokens) <hex>; numbers that start a word (42, 3.5, the 42 of order-42 and the 30 of
--     30s, not the 5 of q5) <n>; a quoted value longer than 32 characters '...' (or
--     "..."): short quoted values, such as the key of a KeyError, stay as they are;
--   * runs of white space become one space; past 200 characters the text is cut and ends in
--     an ellipsis.
-- IMMUTABLE, so an index can be built on it, and written with pg_catalog's functions only,
-- whatever the search path of the session that builds it. plpgsql rather than SQL: a SQL
-- function this shape is not inlined, and its per-call cost was four times the regular
-- expressions'; the three about digits are skipped for a line without any. About 30 us a
-- row on a 2-core machine: the recount and the index below read a DLQ of a million rows in
-- about a minute together.
CREATE OR REPLACE FUNCTION {dlq_cause_fn}(exception text) RETURNS text
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
DECLARE
    line text := CASE WHEN exception ~ '^\s*Traceback \(most recent call last\)'
                      THEN pg_catalog.substring(exception, '([^\n]*\S)\s*$')
                      ELSE pg_catalog.split_part(exception, E'\n', 1) END;
BEGIN
    IF line ~ '[0-9]' THEN
        line := pg_catalog.regexp_replace(
            line,
            '[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{12}}',
            '<uuid>', 'g');
        line := pg_catalog.regexp_replace(
            line, '\m(0[xX][0-9a-fA-F]+|[0-9a-fA-F]{{16,}})\M', '<hex>', 'g');
        line := pg_catalog.regexp_replace(line, '\m[0-9]+(\.[0-9]+)?', '<n>', 'g');
    END IF;
    line := pg_catalog.btrim(pg_catalog.regexp_replace(
        pg_catalog.regexp_replace(line, '([''"])[^''"]{{33,}}\1', '\1...\1', 'g'),
        '\s+', ' ', 'g'));
    IF line IS NULL OR line = '' THEN
        RETURN '(no exception recorded)';
    ELSIF pg_catalog.length(line) > 200 THEN
        RETURN pg_catalog.left(line, 199) || '…';
    END IF;
    RETURN line;
END
$$;

CREATE TABLE IF NOT EXISTS {dlq_causes} (
    queue          varchar(255) NOT NULL,
    failure_reason varchar(64) NOT NULL,
    cause          text NOT NULL,
    row_count      bigint NOT NULL,
    PRIMARY KEY (queue, failure_reason, cause)
);

-- The rows a statement added (new_rows) and removed (old_rows), counted per key, applied in
-- one upsert in key order; a count that reaches zero is deleted, so the table holds only the
-- causes the DLQ has. plpgsql plans each statement when it first runs, so a branch naming a
-- transition table its trigger does not have is never planned. The function is written with
-- format(): %1$I is the schema the counts table was just created in, which also holds the
-- cause function.
DO $migration$
BEGIN
    EXECUTE pg_catalog.format($function$
CREATE OR REPLACE FUNCTION %1$I.%2$I() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
DECLARE
    queues text[];
    reasons text[];
    causes text[];
    counts bigint[];
BEGIN
    IF TG_OP = 'TRUNCATE' THEN
        DELETE FROM %1$I.%3$I;
        RETURN NULL;
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') THEN
        SELECT array_agg(k.queue), array_agg(k.failure_reason), array_agg(k.cause),
               array_agg(k.n)
        INTO queues, reasons, causes, counts
        FROM (SELECT queue::text AS queue, failure_reason::text AS failure_reason,
                     %1$I.%4$I(last_exception::text) AS cause, count(*) AS n
              FROM new_rows GROUP BY 1, 2, 3) AS k;
    END IF;
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        SELECT array_cat(queues, array_agg(k.queue)),
               array_cat(reasons, array_agg(k.failure_reason)),
               array_cat(causes, array_agg(k.cause)), array_cat(counts, array_agg(-k.n))
        INTO queues, reasons, causes, counts
        FROM (SELECT queue::text AS queue, failure_reason::text AS failure_reason,
                     %1$I.%4$I(last_exception::text) AS cause, count(*) AS n
              FROM old_rows GROUP BY 1, 2, 3) AS k;
    END IF;
    IF queues IS NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO %1$I.%3$I AS c (queue, failure_reason, cause, row_count)
    SELECT d.queue::varchar, d.reason::varchar, d.cause, sum(d.n)::bigint
    FROM unnest(queues, reasons, causes, counts) AS d(queue, reason, cause, n)
    GROUP BY 1, 2, 3
    HAVING sum(d.n)::bigint <> 0::bigint
    ORDER BY 1, 2, 3
    ON CONFLICT (queue, failure_reason, cause)
        DO UPDATE SET row_count = c.row_count + excluded.row_count;
    DELETE FROM %1$I.%3$I AS c
    USING unnest(queues, reasons, causes) AS d(queue, reason, cause)
    WHERE c.queue::text = d.queue AND c.failure_reason::text = d.reason AND c.cause = d.cause
      AND c.row_count <= 0::bigint;
    RETURN NULL;
END
$body$
$function$,
        (SELECT n.nspname FROM pg_catalog.pg_type AS t
         JOIN pg_catalog.pg_namespace AS n ON n.oid = t.typnamespace
         WHERE t.oid = pg_catalog.pg_typeof(NULL::{dlq_causes})),
        {dlq_causes_count_name}, {dlq_causes_name}, {dlq_cause_fn_name});
END
$migration$;

-- Taken first so the recount below sees every row and no writer slips in between: the
-- triggers count from the moment this transaction commits, the recount up to it.
LOCK TABLE {dlq} IN SHARE ROW EXCLUSIVE MODE;
DROP TRIGGER IF EXISTS outbox_farm_causes_insert ON {dlq};
DROP TRIGGER IF EXISTS outbox_farm_causes_update ON {dlq};
DROP TRIGGER IF EXISTS outbox_farm_causes_delete ON {dlq};
DROP TRIGGER IF EXISTS outbox_farm_causes_truncate ON {dlq};
CREATE TRIGGER outbox_farm_causes_insert AFTER INSERT ON {dlq}
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {dlq_causes_count}();
CREATE TRIGGER outbox_farm_causes_update AFTER UPDATE ON {dlq}
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {dlq_causes_count}();
CREATE TRIGGER outbox_farm_causes_delete AFTER DELETE ON {dlq}
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION {dlq_causes_count}();
CREATE TRIGGER outbox_farm_causes_truncate AFTER TRUNCATE ON {dlq}
    FOR EACH STATEMENT EXECUTE FUNCTION {dlq_causes_count}();

DELETE FROM {dlq_causes};
INSERT INTO {dlq_causes} (queue, failure_reason, cause, row_count)
SELECT queue, failure_reason, {dlq_cause_fn}(last_exception), count(*)
FROM {dlq}
GROUP BY 1, 2, 3;

CREATE INDEX IF NOT EXISTS {dlq_cause_idx} ON {dlq} ({dlq_cause_fn}(last_exception), id);
ANALYZE {dlq_causes};
SELECT set_config('search_path', current_setting('outbox_farm.search_path'), true);
