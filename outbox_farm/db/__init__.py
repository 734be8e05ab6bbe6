"""Storage: the only code of the runtime that talks to the database.

Typed functions over a connection pool and the composed `Queries`: rows come back as named
tuples, writes report which of their rows they matched. Every driver error is translated
once, here (`boundary`), into the `outbox_farm.errors` family, so the loops above decide
whether to retry, report or give up from those classes alone and never import psycopg.

- `pool`: opening the runtime's pool, probing a DSN.
- `store`: the storage port (`outbox_farm.storage`) on PostgreSQL, which the runtime's loops
  speak: claims, outcome writes, lease extensions, next due times.
- `claims`: the claim's statements and the `Message` each claimed row becomes.
- `outcomes`: a flush's lease-guarded writes through one pipeline (the completer's).
- `leases`: a dead worker's release (the supervisor).
- `housekeeping`: gauges, VACUUM, DLQ retention (one process per farm).
- `listen`: the LISTEN connection (the listener).
"""
