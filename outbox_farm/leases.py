"""Lease tokens that name the worker holding them, and the release of a dead worker's leases.

A token is a version-4 UUID whose first four bytes say who took it: the high bit set and a
31-bit worker id, or the high bit clear for a runtime without one (its other 31 bits random).
A supervisor that reaps a dead worker can then free that worker's rows at once instead of
leaving them until their leases expire, and it can never free a row held by a runtime that has
no worker id, whatever that runtime's random bits are.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import psycopg

from .errors import ConfigurationError
from .queries import Queries

WORKER_BIT = 0x80000000
MAX_WORKER_ID = 0x7FFFFFFF


def check_worker_id(worker_id: object) -> int:
    if (
        isinstance(worker_id, bool)
        or not isinstance(worker_id, int)
        or not 0 <= worker_id <= MAX_WORKER_ID
    ):
        raise ConfigurationError(
            f"worker_id must be a whole number from 0 to {MAX_WORKER_ID}, got {worker_id!r}"
        )
    return worker_id


def lease_token(worker_id: int | None = None) -> uuid.UUID:
    """A fresh token: the worker's id in its first four bytes, 96 random bits after them."""
    raw = os.urandom(16)
    if worker_id is None:
        head = raw[0] & 0x7F
        return uuid.UUID(bytes=bytes([head]) + raw[1:], version=4)
    prefix = (WORKER_BIT | worker_id).to_bytes(4, "big")
    return uuid.UUID(bytes=prefix + raw[4:], version=4)


def token_range(worker_id: int) -> tuple[uuid.UUID, uuid.UUID]:
    prefix = (WORKER_BIT | check_worker_id(worker_id)).to_bytes(4, "big")
    return uuid.UUID(bytes=prefix + bytes(12)), uuid.UUID(bytes=prefix + b"\xff" * 12)


def release_worker(conn: psycopg.Connection[Any], queries: Queries, worker_id: int) -> int:
    """Clear the lease of every row held under a token of `worker_id`; return how many.

    For a supervisor that has just reaped the worker: the rows become claimable at once. The
    delivery the dead worker's claim counted is kept, so a message that kills its worker on
    every run still reaches `max_deliveries` and the DLQ. Tokens are UUIDs, which Postgres
    orders bytewise, so one worker's tokens are one range; only leased rows are visited.
    The UPDATE runs in `conn`'s current transaction: use an autocommit connection, or commit.
    """
    low, high = token_range(worker_id)
    with conn.cursor() as cursor:
        cursor.execute(queries["release_worker"], {"low": low, "high": high})
        return max(cursor.rowcount, 0)
