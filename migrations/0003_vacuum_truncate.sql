-- target: outbox
-- No VACUUM of the outbox table, the farm's or autovacuum's, gives its empty tail pages back to
-- the operating system. Doing so takes an ACCESS EXCLUSIVE lock: every claim, completer write
-- and publish waits behind it (a five-minute run at 10,000 msg/s nearly stalled for seconds),
-- and a queue table grows back into that space moments later anyway.
ALTER TABLE {outbox} SET (vacuum_truncate = false);
