-- target: outbox
-- A lease's expiry becomes a property of the row. Each runner used to judge another's lease by
-- its own lease_ttl, so two deployments with different settings (a rolling deploy) disagreed on
-- when a row was free. Now the claim stamps `lease_expires_at` from the claimer's lease_ttl,
-- the claimer's heartbeat moves it on while the handler runs, and every runner compares it with
-- the database clock. Rows leased by an older farm while this runs keep a NULL expiry and
-- expire as before.
ALTER TABLE {outbox} ADD COLUMN IF NOT EXISTS lease_expires_at timestamptz;

-- The lease index is rebuilt on the expiry, under the same name, so the claim and the schema
-- check find it. Building it reads the whole table once while writes wait (seconds per few
-- million rows): migrate a large backlog at a quiet moment. Index names carry no schema, so
-- the old index is looked up in the table's own schema (found through the table's row type:
-- no name is spelled out as text here), and search_path is put back before anything else.
SELECT set_config('outbox_farm.search_path', current_setting('search_path'), true);
SELECT set_config('search_path', quote_ident(n.nspname), true)
FROM pg_type AS t JOIN pg_namespace AS n ON n.oid = t.typnamespace
WHERE t.oid = pg_typeof(NULL::{outbox});
DROP INDEX IF EXISTS {lease_idx};
SELECT set_config('search_path', current_setting('outbox_farm.search_path'), true);

CREATE INDEX {lease_idx} ON {outbox} (queue, lease_expires_at)
    WHERE acquired_token IS NOT NULL;
