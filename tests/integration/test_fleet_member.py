"""A fleet's processes, run as members in one event loop against real databases: every row
of every database handled, the set shared out with no database served twice, a member that
stops has its databases taken by the others, databases added to and removed from the file
picked up while the rest flow, and one unreachable database that database's problem only."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql

from outbox_farm import Farm, Message
from outbox_farm.fleet.fleet import Fleet
from outbox_farm.fleet.member import FleetMember
from outbox_farm.settings import RuntimeSettings
from outbox_farm.testing.databases import Templates

TENANTS = 4
PER_TENANT = 25
SETTINGS = RuntimeSettings(poll_interval=0.2, graceful_timeout=5.0)


@pytest.fixture
def tenants(outbox_templates: Templates) -> Iterator[dict[str, str]]:
    """Four migrated databases, by name."""
    farm = Farm()
    with contextlib.ExitStack() as stack:
        yield {
            f"tenant_{i}": stack.enter_context(outbox_templates.database(farm.names))
            for i in range(TENANTS)
        }


def write_set(path: Path, databases: dict[str, str]) -> None:
    lines = ["[databases]", *(f'{name} = "{dsn}"' for name, dsn in databases.items())]
    path.write_text("\n".join(lines) + "\n")


def publish(farm: Farm, dsn: str, tenant: str, count: int, start: int = 0) -> None:
    with psycopg.connect(dsn) as conn:
        for i in range(start, start + count):
            farm.publish(conn, {"tenant": tenant, "n": i}, queue="work")


async def until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def fleet_with(path: Path, seen: Counter[tuple[str, int]], recheck: float = 0.5) -> Fleet:
    farm = Farm()

    @farm.handler("work")
    async def work(msg: Message) -> None:
        body = msg.json()
        seen[(body["tenant"], body["n"])] += 1

    return Fleet(farm, databases=path, lease=3.0, recheck=recheck)


def run(body: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 120))


def served(*members: FleetMember) -> list[str]:
    return sorted(name for m in members for name in m.served)


def test_members_share_the_set_and_take_over_from_one_that_stops(
    dsn: str, tenants: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "databases.toml"
    write_set(path, tenants)
    seen: Counter[tuple[str, int]] = Counter()
    fleet = fleet_with(path, seen)
    for name, tenant in tenants.items():
        publish(fleet.farms[0], tenant, name, PER_TENANT)

    async def body() -> None:
        a = FleetMember(fleet, dsn, SETTINGS, name="a")
        b = FleetMember(fleet, dsn, SETTINGS, name="b")
        await asyncio.gather(a.start(), b.start())
        try:
            # Both joined before either took: two each, none twice.
            await until(lambda: len(served(a, b)) == TENANTS, "every database served")
            assert served(a, b) == sorted(tenants)
            assert len(a.served) == len(b.served) == TENANTS // 2
            await until(lambda: len(seen) == TENANTS * PER_TENANT, "every row handled")
            await b.stop()
            await until(lambda: len(a.served) == TENANTS, "a taking b's databases")
            for name, tenant in tenants.items():
                publish(fleet.farms[0], tenant, name, PER_TENANT, start=PER_TENANT)
            await until(lambda: len(seen) == 2 * TENANTS * PER_TENANT, "rows after the stop")
        finally:
            await asyncio.gather(a.stop(), b.stop())

    run(body)
    assert set(seen) == {(name, n) for name in tenants for n in range(2 * PER_TENANT)}
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM outbox_farm_fleet_leases").fetchone() == (0,)
        assert conn.execute("SELECT count(*) FROM outbox_farm_fleet_members").fetchone() == (0,)


def test_a_database_added_or_removed_is_picked_up_while_the_rest_flow(
    dsn: str, tenants: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "databases.toml"
    first = dict(list(tenants.items())[:2])
    write_set(path, first)
    seen: Counter[tuple[str, int]] = Counter()
    fleet = fleet_with(path, seen)

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="only")
        await member.start()
        try:
            await until(lambda: served(member) == sorted(first), "the first two served")
            kept = {name: member.served[name] for name in first}
            write_set(path, tenants)
            await until(lambda: served(member) == sorted(tenants), "the new ones served")
            # The first two were never restarted: the same objects serve them.
            assert all(member.served[name] is kept[name] for name in first)
            for name, tenant in tenants.items():
                publish(fleet.farms[0], tenant, name, PER_TENANT)
            await until(lambda: len(seen) == TENANTS * PER_TENANT, "every row handled")
            gone = "tenant_0"
            write_set(path, {k: v for k, v in tenants.items() if k != gone})
            await until(lambda: gone not in member.served, "the removed one let go")
            assert all(member.served[name] is kept[name] for name in first if name != gone)
            with psycopg.connect(dsn) as conn:

                def leased() -> set[str]:
                    rows = conn.execute("SELECT database FROM outbox_farm_fleet_leases")
                    conn.commit()
                    return {d for (d,) in rows}

                await until(lambda: gone not in leased(), "the removed one's lease given up")
        finally:
            await member.stop()

    run(body)


def test_an_unreachable_database_is_its_own_problem(
    dsn: str, tenants: dict[str, str], tmp_path: Path
) -> None:
    path = tmp_path / "databases.toml"
    down = "host=127.0.0.1 port=1 dbname=nowhere user=nobody connect_timeout=2"
    write_set(path, {**tenants, "broken": down})
    seen: Counter[tuple[str, int]] = Counter()
    fleet = fleet_with(path, seen)
    for name, tenant in tenants.items():
        publish(fleet.farms[0], tenant, name, PER_TENANT)

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="only")
        await member.start()
        try:
            await until(lambda: len(seen) == TENANTS * PER_TENANT, "the reachable ones' rows")
            broken = member.served["broken"]
            await until(lambda: broken.unready is not None and "unreachable" in broken.unready, "x")
            assert member.problem is None  # degraded, not failed
            assert any(line.startswith("database broken: unreachable") for line in member.warnings)
            assert all(member.served[name].up for name in tenants)
        finally:
            await member.stop()

    run(body)


def test_several_outboxes_of_the_home_database_alone(dsn: str) -> None:
    """With no file and no catalog, a fleet of two farms serves both tables of the home
    database, under the name `default`."""
    from outbox_farm.names import TableNames
    from outbox_farm.ops.migrate import migrate

    billing = Farm("billing_outbox", "billing_dlq")
    orders = Farm()
    seen: Counter[tuple[str, int]] = Counter()

    @orders.handler("work")
    async def order(msg: Message) -> None:
        seen[("orders", msg.json()["n"])] += 1

    @billing.handler("work")
    async def bill(msg: Message) -> None:
        seen[("billing", msg.json()["n"])] += 1

    with psycopg.connect(dsn) as conn:
        migrate(conn, TableNames.build("billing_outbox", "billing_dlq"))
    with psycopg.connect(dsn) as conn:
        for n in range(PER_TENANT):
            orders.publish(conn, {"n": n}, queue="work")
            billing.publish(conn, {"n": n}, queue="work")
        for n in range(3):  # a queue no farm of the fleet serves: its rows stay
            billing.publish(conn, {"n": n}, queue="idle")
    fleet = Fleet(orders, billing, lease=3.0)

    def backlog() -> float | None:
        return REGISTRY.get_sample_value("outbox_farm_database_backlog", {"database": "default"})

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="only")
        await member.start()
        try:
            assert served(member) == ["default"]
            await until(lambda: len(seen) == 2 * PER_TENANT, "both tables' rows")
            assert len(member.served["default"].runtimes) == 2
            # Its holder counts the database's rows, every table's: the idle queue's are left.
            await until(lambda: backlog() == 3, "the backlog of both tables counted")
        finally:
            await member.stop()

    run(body)
    assert set(seen) == {(t, n) for t in ("orders", "billing") for n in range(PER_TENANT)}
    assert backlog() is None  # not served here any more: not exported


def test_a_lease_taken_by_another_process_stops_being_served(
    dsn: str, tenants: dict[str, str], tmp_path: Path
) -> None:
    """A process that could not renew (cut off from the home database) finds its lease taken:
    it stops serving that database at its next round, and serves the rest."""
    path = tmp_path / "databases.toml"
    write_set(path, tenants)
    fleet = fleet_with(path, Counter())

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="slow")
        await member.start()
        try:
            await until(lambda: served(member) == sorted(tenants), "every database served")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    "UPDATE outbox_farm_fleet_leases"
                    " SET holder = 'thief', expires_at = now() + interval '1 hour'"
                    " WHERE database = 'tenant_1'"
                )
            await until(lambda: "tenant_1" not in member.served, "the taken one let go")
            assert served(member) == sorted(set(tenants) - {"tenant_1"})
        finally:
            await member.stop()

    run(body)
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT database, holder FROM outbox_farm_fleet_leases").fetchall()
    assert rows == [("tenant_1", "thief")]  # the thief's lease is not given up by the victim


def test_a_home_database_out_of_reach_leaves_the_databases_served(
    dsn: str, tenants: dict[str, str], tmp_path: Path, server_dsn: str
) -> None:
    """The home database refuses connections: the process keeps serving what it holds (no
    other process could take it through that database either), says so, and renews again
    once the home database answers."""
    path = tmp_path / "databases.toml"
    write_set(path, tenants)
    seen: Counter[tuple[str, int]] = Counter()
    fleet = fleet_with(path, seen)
    home = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])

    def home_reachable(allowed: bool) -> None:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(
                sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                    sql.Identifier(home), sql.Literal(allowed)
                )
            )
            if not allowed:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    [home],
                )

    async def body() -> None:
        member = FleetMember(fleet, dsn, SETTINGS, name="only")
        await member.start()
        try:
            await until(lambda: served(member) == sorted(tenants), "every database served")
            home_reachable(False)
            await until(lambda: member.home_problem is not None, "the home database missed")
            assert any("home database unreachable" in line for line in member.warnings)
            assert member.problem is None
            for name, tenant in tenants.items():
                publish(fleet.farms[0], tenant, name, PER_TENANT)
            await until(lambda: len(seen) == TENANTS * PER_TENANT, "rows while home is out")
            assert served(member) == sorted(tenants)
            home_reachable(True)
            await until(lambda: member.home_problem is None, "the home database answering")
        finally:
            home_reachable(True)
            await member.stop()

    run(body)
