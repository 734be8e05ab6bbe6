-- target: outbox
-- The outbox table. Columns, types and indexes are what the claim, the completer and the
-- schema check depend on; extra user columns are fine. IF NOT EXISTS lets `migrate` adopt a
-- table created earlier from `outbox-farm sql`; `outbox-farm check` then finds any drift.
CREATE TABLE IF NOT EXISTS {outbox} (
    id               bigserial PRIMARY KEY,
    queue            varchar(255) NOT NULL,
    payload          bytea NOT NULL,
    headers          jsonb,
    attempts_count   bigint NOT NULL DEFAULT 0,
    deliveries_count bigint NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    first_attempt_at timestamptz,
    last_attempt_at  timestamptz,
    acquired_at      timestamptz,
    acquired_token   uuid,
    timer_id         varchar(255),
    -- A lease is a token and a time together, never one without the other.
    CONSTRAINT {lease_ck} CHECK ((acquired_token IS NULL) = (acquired_at IS NULL))
);

-- Every row is inserted, updated at least once (claim) and deleted within seconds, so the
-- table churns far faster than the default autovacuum thresholds (20% of the table) notice.
-- Vacuum on a fixed number of dead rows, unthrottled, and keep statistics fresh so the claim
-- keeps its index plans. Fillfactor leaves room on each page for the claim's new versions.
ALTER TABLE {outbox} SET (
    fillfactor = 80,
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- Claim branch A: due rows nobody holds, in due order. The predicate is load-bearing: the
-- claim repeats it so the planner can use this small index instead of scanning the table.
CREATE INDEX IF NOT EXISTS {pending_idx} ON {outbox} (queue, next_attempt_at)
    WHERE acquired_token IS NULL;

-- Claim branch B: leases that expired (a killed or stuck worker).
CREATE INDEX IF NOT EXISTS {lease_idx} ON {outbox} (queue, acquired_at)
    WHERE acquired_token IS NOT NULL;

-- Timer de-duplication: one live timer per (queue, timer_id); ordinary rows are not affected.
CREATE UNIQUE INDEX IF NOT EXISTS {timer_idx} ON {outbox} (queue, timer_id)
    WHERE timer_id IS NOT NULL;
