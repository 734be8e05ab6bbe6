-- target: outbox
-- Farm-wide limits of a queue, beside its pause in the same row: a rate (`rate_count` rows
-- per `rate_seconds`, kept as given so "6000/min" reads back as written) and a most running at
-- once (`max_running`), across every process and host. Set by `outbox-farm queue limit`.
--
-- `tokens` and `tokens_at` are the rate's bucket: what is left of it and when it was last
-- refilled, on the database clock. Every claim of a limited queue locks this row, refills the
-- bucket by the time gone, takes what it claims and writes it back, so the processes of every
-- host share one budget. NULL `tokens`: a full bucket (a limit just set, or changed).
--
-- The `breaker_*` columns are the queue's breaker (a handler option, `Breaker`): the failures
-- counted in a row across every process, and while the breaker is open, since when, why, and
-- when the next probe may run. Open, the breaker holds the queue on every farm as a pause does,
-- but one probe row runs every interval, and the first success closes it.
--
-- Expand-only: a farm of an earlier release ignores the columns (and claims unlimited; run
-- `migrate` before raising a limit you depend on), a farm of this release reads them.
ALTER TABLE outbox_farm_queues
    ADD COLUMN IF NOT EXISTS rate_count integer,
    ADD COLUMN IF NOT EXISTS rate_seconds double precision,
    ADD COLUMN IF NOT EXISTS max_running integer,
    ADD COLUMN IF NOT EXISTS tokens double precision,
    ADD COLUMN IF NOT EXISTS tokens_at timestamptz,
    ADD COLUMN IF NOT EXISTS breaker_failures integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS breaker_open_since timestamptz,
    ADD COLUMN IF NOT EXISTS breaker_probe_at timestamptz,
    ADD COLUMN IF NOT EXISTS breaker_reason text;

DO $$
BEGIN
    ALTER TABLE outbox_farm_queues ADD CONSTRAINT outbox_farm_queues_limits_check CHECK (
        (rate_count IS NULL) = (rate_seconds IS NULL)
        AND (rate_count IS NULL OR rate_count > 0)
        AND (rate_seconds IS NULL OR (rate_seconds > 0 AND rate_seconds < 'Infinity'))
        AND (max_running IS NULL OR max_running > 0));
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;
