-- target: outbox
-- Many outboxes served by one farm (`outbox_farm.fleet`): which process of which host serves
-- which database, kept in the farm's home database (the one `--dsn` names), so every process
-- of every host agrees without a second datastore.
--
-- `outbox_farm_fleet_members`: one row per live process of a fleet, renewed every round; a
-- process that stopped renewing (killed, its host cut off) stops counting once its row
-- expires, on the database clock. The live count is what each process divides the databases
-- by to know its share.
--
-- `outbox_farm_fleet_leases`: one row per served database: its holder and until when. A holder
-- renews its rows every round; a row past `expires_at` is free for any process to take,
-- guarded in the taking statement itself, so two processes never hold one database. Rows of a
-- database no longer in the set are deleted by their holder; rows of a dead holder expire.
--
-- Global tables (no `target` column): a fleet is named instead (`fleet`), so several fleets may
-- share one home database. Logged: a crash of the server must not hand every database to new
-- holders at once. Expand-only: an earlier release ignores them.
-- The key columns make each table; every other column is added on its own, so `migrate
-- --repair` puts back a column dropped since (a lease's expiry defaults to now: expired).
CREATE TABLE IF NOT EXISTS outbox_farm_fleet_members (
    fleet      text NOT NULL,
    member     text NOT NULL,
    PRIMARY KEY (fleet, member)
);
ALTER TABLE outbox_farm_fleet_members
    ADD COLUMN IF NOT EXISTS host       text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS pid        integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS started_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS expires_at timestamptz NOT NULL DEFAULT now();

CREATE TABLE IF NOT EXISTS outbox_farm_fleet_leases (
    fleet      text NOT NULL,
    database   text NOT NULL,
    PRIMARY KEY (fleet, database)
);
ALTER TABLE outbox_farm_fleet_leases
    ADD COLUMN IF NOT EXISTS holder     text NOT NULL DEFAULT '',
    ADD COLUMN IF NOT EXISTS taken_at   timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS expires_at timestamptz NOT NULL DEFAULT now();

CREATE INDEX IF NOT EXISTS outbox_farm_fleet_leases_holder
    ON outbox_farm_fleet_leases (fleet, holder);
