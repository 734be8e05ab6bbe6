"""A fleet member asked to read its set now (`recheck()`, what a HUP to the arbiter comes to in
each worker): with `recheck` an hour long, only the request explains a database of the file
taken up or let go within seconds, and the databases that stay are served by the same
objects throughout."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from outbox_farm.fleet.member import FleetMember
from tests.integration.test_fleet_member import (
    SETTINGS,
    TENANTS,
    fleet_with,
    publish,
    run,
    served,
    tenants,
    until,
    write_set,
)

__all__ = ["tenants"]  # the fixture, used by name

PER_TENANT = 20
PICKED_UP = 10.0  # seconds a request may take: a round, well under the hour of `recheck`


def test_recheck_takes_up_and_lets_go_at_once_keeping_the_rest(
    dsn: str, tenants: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "databases.toml"
    names = sorted(tenants)
    first = {name: tenants[name] for name in names[:2]}
    write_set(path, first)
    seen: Counter[tuple[str, int]] = Counter()
    fleet = fleet_with(path, seen, recheck=3600.0)
    farm = fleet.farms[0]
    caplog.set_level("INFO", logger="outbox_farm.fleet")

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="only")
        await member.start()
        try:
            await until(lambda: served(member) == names[:2], "the first two served")
            kept = dict(member.served)
            write_set(path, tenants)
            # Several rounds pass (a round is 0.75 s): the hour-long recheck reads nothing.
            rounds = asyncio.get_running_loop().time()
            await asyncio.sleep(0)  # let the round loop run before measuring
            await until(
                lambda: asyncio.get_running_loop().time() - rounds > 2 * fleet.round_every,
                "two rounds' time",
            )
            assert served(member) == names[:2], "read before it was asked"
            asked = asyncio.get_running_loop().time()
            member.recheck()
            await until(lambda: served(member) == names, "the added one served", PICKED_UP)
            print(f"added database served {asyncio.get_running_loop().time() - asked:.2f}s on")
            assert all(member.served[name] is kept[name] for name in kept)
            for name, tenant in tenants.items():
                publish(farm, tenant, name, PER_TENANT)
            await until(lambda: len(seen) == TENANTS * PER_TENANT, "every row handled")

            gone = names[0]
            write_set(path, {k: v for k, v in tenants.items() if k != gone})
            member.recheck()
            member.recheck()  # twice in a row: one more reading, nothing else
            await until(lambda: gone not in member.served, "the removed one let go", PICKED_UP)
            assert member.served[names[1]] is kept[names[1]]
            with psycopg.connect(dsn, autocommit=True) as conn:

                def leased() -> set[str]:
                    rows = conn.execute("SELECT database FROM outbox_farm_fleet_leases")
                    return {d for (d,) in rows}

                await until(lambda: gone not in leased(), "its lease given up", PICKED_UP)
            for name, tenant in tenants.items():
                if name != gone:
                    publish(farm, tenant, name, PER_TENANT, start=PER_TENANT)
            await until(lambda: len(seen) == (2 * TENANTS - 1) * PER_TENANT, "rows after")
        finally:
            await member.stop()

    run(body)
    assert all(count == 1 for count in seen.values())
    lines = [r.getMessage() for r in caplog.records if getattr(r, "event", "") == "fleet_set_read"]
    assert any(f"added {names[2]}" in line for line in lines), lines
    assert any(f"removed {names[0]}" in line for line in lines), lines


def test_a_request_before_start_is_served_by_the_first_rounds(
    dsn: str, tenants: dict[str, str], tmp_path: Path
) -> None:
    """A worker asked while still booting: the start's own reading is fresh, nothing fails."""
    path = tmp_path / "databases.toml"
    write_set(path, tenants)
    fleet = fleet_with(path, Counter(), recheck=3600.0)

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="early")
        member.recheck()
        await member.start()
        try:
            await until(lambda: served(member) == sorted(tenants), "every database served")
        finally:
            await member.stop()

    run(body)
