"""Table chores a runtime does beside the data path: the database-derived gauges, the outbox's
VACUUM, and the DLQ's retention. None of them decides a row's fate."""
