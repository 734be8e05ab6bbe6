-- target: outbox
-- The operator's hand on each queue, kept where every farm of every host can read it: whether
-- a queue is paused (and until when, why, by whom, since when). Every farm loads it before its
-- first claim, again on the NOTIFY a change sends, and by a short poll when a NOTIFY is missed.
-- Later controls of a queue (farm-wide limits, a breaker's state) become columns of the same
-- row, so one read keeps a farm's view of every control current.
--
-- One table for every outbox of the database (`target` names the outbox, as in
-- `outbox_farm_code`), beside `outbox_farm_migrations`. A queue needs no rows to be paused: a
-- pause may be set ahead of a queue's first row. Logged, unlike `outbox_farm_code`: a pause
-- must outlive a crash of the server. Expand-only: a farm of an earlier release ignores it, and
-- a farm that finds no such table claims as if nothing were paused (and says so).
CREATE TABLE IF NOT EXISTS outbox_farm_queues (
    target       text NOT NULL,
    queue        varchar(255) NOT NULL,
    paused       boolean NOT NULL DEFAULT false,
    paused_until timestamptz,
    reason       text,
    changed_by   text,
    changed_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target, queue)
);
