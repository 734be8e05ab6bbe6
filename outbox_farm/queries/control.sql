-- name: control_changed
-- Sent inside the operator's transaction, so every farm reloads once the change commits (and
-- not at all when it rolls back). On the farm's own channel: see `db.control`.
SELECT pg_notify({notify_channel}, %(payload)s)

-- name: control_load
-- The queues of one outbox paused now. A `paused_until` already past is no pause, judged on
-- the database's clock (one clock for every farm of every host); the soonest end of a pause
-- still running comes back with it, so the watcher reloads at that instant.
SELECT queue, paused_until, reason
FROM outbox_farm_queues
WHERE target = %(target)s AND paused AND (paused_until IS NULL OR paused_until > now())
