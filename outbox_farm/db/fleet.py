"""The statements of a fleet's coordination (migration 0015), on the fleet's home database.

One round of a process is one transaction: its heartbeat and the count of live processes, the
renewal of what it holds, and the taking of free databases up to its share, so a share is
judged against the leases as they are within that transaction. Errors leave as the storage
layer's (`ConnectionLost` while the home database is out of reach: the caller keeps serving
what it holds and tries again next round).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

from ..queries import load_blocks
from .boundary import boundary
from .connect import Connection, bounded
from .pool import Pool, pooled


def _text(name: str) -> str:
    # No placeholder to fill: the fleet's tables are global, not one outbox's.
    return load_blocks()[name]


class Member(NamedTuple):
    """Who a process is in its fleet: the row it renews and the holder of its leases."""

    fleet: str
    name: str
    host: str
    pid: int


class Round(NamedTuple):
    """What one round found: live processes of the fleet (this one included) and the
    databases this process holds after it."""

    members: int
    held: frozenset[str]
    taken: frozenset[str]


class Process(NamedTuple):
    """One live process of a fleet, as an operator sees it."""

    member: str
    host: str
    pid: int
    started_at: datetime
    databases: int


class Assignment(NamedTuple):
    """One lease of the fleet, as an operator sees it."""

    database: str
    holder: str
    live: bool
    expires_in: float


async def play_round(
    pool: Pool,
    member: Member,
    ttl: float,
    wanted: list[str],
    share: Callable[[int], int],
) -> Round:
    """Beat, renew, then take free databases of `wanted` (in that order of preference) until
    this process holds `share(members)` of them. `share` is the caller's rule, given the live
    count found in this very transaction."""
    params: dict[str, Any] = {
        "fleet": member.fleet,
        "member": member.name,
        "host": member.host,
        "pid": member.pid,
        "ttl": ttl,
    }
    with boundary():
        async with pooled(pool) as conn, conn.transaction():
            row = await (await conn.execute(_text("fleet_beat"), params)).fetchone()
            members = int(row[0]) if row is not None else 1
            renewed = await (await conn.execute(_text("fleet_renew"), params)).fetchall()
            held = {database for (database,) in renewed}
            room = min(int(share(members)), len(wanted)) - len(held & set(wanted))
            taken: set[str] = set()
            if room > 0:
                free = await (
                    await conn.execute(
                        _text("fleet_free"),
                        {**params, "databases": wanted, "limit": room},
                    )
                ).fetchall()
                if free:
                    got = await (
                        await conn.execute(
                            _text("fleet_take"),
                            {**params, "databases": [database for (database,) in free]},
                        )
                    ).fetchall()
                    taken = {database for (database,) in got}
    return Round(members, frozenset(held | taken), frozenset(taken))


async def release(pool: Pool, member: Member, databases: list[str]) -> None:
    """Give `databases` up, for another process to take at its next round."""
    with boundary():
        async with pooled(pool) as conn:
            await conn.execute(
                _text("fleet_release"),
                {"fleet": member.fleet, "member": member.name, "databases": databases},
            )


async def leave(pool: Pool, member: Member) -> None:
    """This process stops: its row and all its leases go."""
    with boundary():
        async with pooled(pool) as conn:
            await conn.execute(_text("fleet_leave"), {"fleet": member.fleet, "member": member.name})


def leave_for(dsn: str, fleet: str, member: str, timeout: float) -> None:
    """For a worker that died, on a connection of its own bounded by `timeout`: what `leave`
    would have done, so its databases are taken at the others' next round rather than after
    the lease time."""
    with boundary(), bounded(dsn, timeout) as conn:
        conn.execute(_text("fleet_leave"), {"fleet": fleet, "member": member})


def assignments(conn: Connection, fleet: str) -> list[Assignment]:
    """Every lease of `fleet`, by database."""
    with boundary():
        rows = conn.execute(_text("fleet_assignments"), {"fleet": fleet}).fetchall()
    return [Assignment(d, h, bool(live), float(left)) for d, h, live, left in rows]


def has_tables(conn: Connection) -> bool:
    """Whether migration 0015's tables are there (on the connection's search path)."""
    with boundary():
        row = conn.execute(_text("fleet_tables")).fetchone()
    return bool(row and row[0])


def processes(conn: Connection, fleet: str) -> list[Process]:
    """The live processes of `fleet`, by host and pid."""
    with boundary():
        rows = conn.execute(_text("fleet_members"), {"fleet": fleet}).fetchall()
    return [Process(m, h, int(p), s, int(n)) for m, h, p, s, n in rows]
