"""Which code runs which queue, as every process of every farm on the database reports it in
`outbox_farm_code` (migration 0010). The farm works without that table: each call raises
`SchemaError` then, and the caller stops comparing."""

from __future__ import annotations

from typing import Any, NamedTuple

import psycopg

from ..names import TableNames
from ..queries import Queries
from .boundary import translate
from .connect import Connection
from .pool import Pool, pooled


class CodeSeen(NamedTuple):
    """One fingerprint of one queue: the processes running it (a few by name), the age, in
    seconds, of the oldest of their reports of it, and their notes on their code."""

    queue: str
    fingerprint: str
    workers: int
    age: float
    some: list[str]
    notes: list[str]


def _seen(rows: list[Any]) -> list[CodeSeen]:
    return [
        CodeSeen(q, f, int(n), float(age), list(some), list(notes or ()))
        for q, f, n, age, some, notes in rows
    ]


async def publish(
    pool: Pool,
    queries: Queries,
    worker: str,
    fingerprints: dict[str, str],
    ttl: float,
    note: str | None = None,
) -> list[CodeSeen]:
    """Renew this worker's fingerprints (by queue) for `ttl` seconds, with its `note` on its
    code; what every live process reports for those queues, this one included."""
    target = str(queries.names.outbox)
    try:
        async with pooled(pool) as conn:
            await conn.execute(
                queries["code_publish"],
                {
                    "target": target,
                    "worker": worker,
                    "queues": list(fingerprints),
                    "fingerprints": list(fingerprints.values()),
                    "ttl": ttl,
                    "note": note,
                },
            )
            cursor = await conn.execute(
                queries["code_seen"], {"target": target, "queues": list(fingerprints)}
            )
            return _seen(await cursor.fetchall())
    except psycopg.Error as exc:
        raise translate(exc, doing="reporting the farm's code failed") from exc


async def forget(pool: Pool, queries: Queries, worker: str) -> None:
    """This worker's reports, gone: it stops."""
    params = {"target": str(queries.names.outbox), "worker": worker}
    try:
        async with pooled(pool) as conn:
            await conn.execute(queries["code_forget"], params)
    except psycopg.Error as exc:
        raise translate(exc, doing="withdrawing the farm's code failed") from exc


def seen(conn: Connection, names: TableNames) -> list[CodeSeen]:
    """Every live fingerprint of the outbox's queues, for `doctor`."""
    params = {"target": str(names.outbox), "queues": None}
    try:
        return _seen(conn.execute(Queries(names)["code_seen"], params).fetchall())
    except psycopg.Error as exc:
        raise translate(exc, doing="reading the farms' code failed") from exc
