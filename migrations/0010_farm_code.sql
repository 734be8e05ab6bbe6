-- target: outbox
-- Which code runs which queue, so that farms on one database can tell when they disagree (a
-- half-done deploy: two farms run different handlers for one queue). Each worker process keeps
-- one row per queue it serves: the handler's fingerprint, since when it has had it, and until
-- when the row counts. A process that stopped stops counting when its row expires, on the
-- database clock; any process deletes the expired rows. `note`: what the process says of its
-- code, such as that its farm's last reload failed (the code on disk did not load).
--
-- One table for every outbox of the database (`target` names the outbox), beside
-- `outbox_farm_migrations`: nothing here is about one table's rows. UNLOGGED: the rows are
-- renewed every few seconds, so they need no WAL, and a crash that empties the table costs a
-- few seconds without a comparison. Expand-only: a farm of an earlier release ignores it, and
-- a farm that finds no such table runs on without comparing.
CREATE UNLOGGED TABLE IF NOT EXISTS outbox_farm_code (
    target      text NOT NULL,
    queue       varchar(255) NOT NULL,
    worker      text NOT NULL,
    fingerprint text NOT NULL,
    since       timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    note        text,
    PRIMARY KEY (target, queue, worker)
);
