-- target: outbox
-- Rows written by other writers (a SQL trigger, another language's producer) may hold values
-- no client can load or count: a timestamp of ±infinity, BC or past year 9999, a counter at
-- bigint's limit, headers that are a JSON array or string. The farm survives such rows (it
-- dead-letters them as `invalid_row`), but the door is the better place to stop them.
--
-- NOT VALID: existing rows are not scanned (no long lock on a live table) and stay as they
-- are; every row inserted or updated from now on must pass. Two consequences the runtime
-- relies on:
-- - the counters check holds for every row the claim has touched, because the claim keeps both
--   counters within [0, bigint max - 1) whatever they held before;
-- - the values check exempts leased rows, so the claim can still lease an old row that breaks
--   it, and the fetcher can dead-letter it or set it aside (the set-aside keeps a lease).
-- The bounds keep a day clear of the years 1 and 9999 so any session time zone loads them.
ALTER TABLE {outbox} DROP CONSTRAINT IF EXISTS {counts_ck};
ALTER TABLE {outbox} ADD CONSTRAINT {counts_ck} CHECK (
    deliveries_count >= 0 AND deliveries_count < 9223372036854775807
    AND attempts_count >= 0 AND attempts_count < 9223372036854775807
) NOT VALID;

ALTER TABLE {outbox} DROP CONSTRAINT IF EXISTS {values_ck};
ALTER TABLE {outbox} ADD CONSTRAINT {values_ck} CHECK (
    acquired_token IS NOT NULL OR (
        created_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
        AND next_attempt_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00'
        AND (first_attempt_at IS NULL
             OR first_attempt_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00')
        AND (last_attempt_at IS NULL
             OR last_attempt_at BETWEEN '0001-01-02 00:00:00+00' AND '9999-12-30 00:00:00+00')
        AND (headers IS NULL OR jsonb_typeof(headers) = 'object')
    )
) NOT VALID;
