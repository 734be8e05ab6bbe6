-- target: dlq
-- The dead-letter table: an audit copy of every row that failed for good. No foreign key to
-- the outbox (the source row is deleted by the same statement) and no NOTIFY (nobody polls it).
CREATE TABLE IF NOT EXISTS {dlq} (
    id               bigserial PRIMARY KEY,
    original_id      bigint NOT NULL,
    queue            varchar(255) NOT NULL,
    payload          bytea NOT NULL,
    headers          jsonb,
    deliveries_count bigint NOT NULL,
    created_at       timestamptz NOT NULL,
    failed_at        timestamptz NOT NULL DEFAULT now(),
    failure_reason   varchar(64) NOT NULL,
    last_exception   text,
    timer_id         varchar(255)
);

-- "Recent failures of queue X", and the pruning index for retention by failed_at.
CREATE INDEX IF NOT EXISTS {dlq_idx} ON {dlq} (queue, failed_at);
