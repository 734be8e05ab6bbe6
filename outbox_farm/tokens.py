"""Lease tokens that name the worker holding them.

A token is a version-4 UUID whose first four bytes say who took it: the high bit set and a
31-bit worker id, or the high bit clear for a runtime without one (its other 31 bits random).
A supervisor that reaps a dead worker can then free that worker's rows at once instead of
leaving them until their leases expire, and it can never free a row held by a runtime that has
no worker id, whatever that runtime's random bits are (`db.leases.release_worker`).
"""

from __future__ import annotations

import os
import uuid

from .errors import ConfigurationError

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
