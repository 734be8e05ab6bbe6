"""Fleet: one farm, many outboxes, at scale. Two database hosts of 50 small databases each
(smoke: 5), every one served by `outbox-farm start loadtests.scale.fleetapp:fleet` on three
farm hosts (smoke: two) from the home database's `tenants` catalog, under steady load in every
database; then, one after the other:

- the second database host is cut off (the first, which keeps the home database, is not): the
  first host's databases must keep their rate, the cut ones catch up once it is healed;
- a farm host is killed (SIGKILL to its arbiter's whole process group): its databases must be
  served again by the others once their leases lapse;
- a database is added to the catalog: the time until its first row is handled;
- one database is given a backlog: the rows published meanwhile in the others must not wait
  behind it (commit -> handled, p99 and max, against 1 s).

Measured besides: `outbox-farm fleet migrate` over the whole set, the connections each farm
process holds to each database host, and the memory a served database costs a worker. Every
row of every database is accounted for at the end from the handlers' journals (the ledger of
the run): none lost, every duplicate explained.

`python -m loadtests.scale.fleet produce ...` is the producer host's program (every database
at a steady rate, one thread per database host, so a cut host holds up only its own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil
import psycopg
from psycopg import sql

from loadtests.common import tables
from loadtests.common.harness import CLI, SetupError, align, kill_farm
from loadtests.common.waits import wait_until
from outbox_farm import Farm
from outbox_farm.ops.migrate import migrate

from . import dbserver
from .bed import Bed, percentile, say
from .hosts import METRICS_PORT, REPO, FarmHost, clean_env, farm_host, run_to_end
from .netns import Host

APP = "loadtests.scale.fleetapp:fleet"
IDLE_APP = "loadtests.scale.fleetapp:idle"
QUEUE = "work"
FLEET = "default"
SECOND_DB_OCTET = 4
HOME = "fleet_home"
NEW_DB = "late"
# What an operator puts in a catalog's DSNs so that a connection to a host cut off fails in
# seconds rather than after the kernel's minutes of retransmissions.
DSN_OPTIONS = "connect_timeout=5 keepalives_idle=5 keepalives_interval=2 keepalives_count=3"
PRODUCER_OPTIONS = f"{DSN_OPTIONS} tcp_user_timeout=5000"
BACKLOG_CHUNK = 5_000
PRODUCER = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


@dataclass(frozen=True)
class Plan:
    per_host: int  # databases on each database host
    hosts: int  # farm hosts
    procs: int  # --procs of each
    rate: float  # messages per second into each database
    warm: float  # seconds of load before anything is measured
    before: float  # seconds of load measured before the cut
    cut_for: float
    lease: float  # the fleet's lease of a database
    backlog: int  # rows of the one database given a backlog
    recheck: float = 2.0
    catch_up_window: float = 120.0
    settle: float = 10.0  # seconds of load after the takeover, before the new database


FULL = Plan(
    per_host=50, hosts=3, procs=2, rate=2, warm=15, before=20, cut_for=30, lease=6, backlog=100_000
)
SMOKE = Plan(
    per_host=5, hosts=2, procs=1, rate=2, warm=4, before=8, cut_for=10, lease=6, backlog=10_000
)


# -- the producer host's program --------------------------------------------------------------


def _produce_host(
    dbs: Sequence[tuple[str, str]],
    rate: float,
    seconds: float,
    out: IO[str],
    lock: threading.Lock,
    halt: threading.Event,
    counts: dict[str, int],
) -> None:
    """Every second, `rate` rows into each of `dbs` (one transaction each). The first failure
    of a second ends that second for this host (a cut host fails every one of them, each
    after its timeout); the next second tries again on new connections."""
    conns: dict[str, psycopg.Connection[Any]] = {}
    seq = 0
    began = time.monotonic()
    tick = began
    per_tick = max(1, round(rate))
    while not halt.is_set() and time.monotonic() - began < seconds:
        for name, dsn in dbs:
            conn = conns.get(name)
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(dsn, application_name="fleet-producer")
                    conns[name] = conn
                bodies = [{"id": f"{name}-{seq}-{i}", "db": name} for i in range(per_tick)]
                with conn.transaction():
                    PRODUCER.publish_batch(conn, bodies, queue=QUEUE)
                at = time.time()
                with lock:
                    out.writelines(f"{b['id']}\t{name}\t{at:.6f}\n" for b in bodies)
                counts["committed"] += per_tick
            except psycopg.Error:
                counts["failed"] += 1
                for dead in conns.values():
                    dead.close()
                conns.clear()
                break
        with lock:
            out.flush()
        seq += 1
        tick += per_tick / rate
        halt.wait(max(0.0, tick - time.monotonic()))
        tick = max(tick, time.monotonic() - 1.0)  # behind by more than a second: no burst
    for conn in conns.values():
        conn.close()


def produce(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.scale.fleet produce")
    parser.add_argument("--dsns", type=Path, required=True, help="JSON: host -> {name: dsn}")
    parser.add_argument("--rate", type=float, required=True, help="messages/s per database")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--commits", type=Path, required=True, help="id<TAB>db<TAB>commit time")
    args = parser.parse_args(argv)
    halt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    hosts: dict[str, dict[str, str]] = json.loads(args.dsns.read_text())
    lock = threading.Lock()
    counts = {"committed": 0, "failed": 0}
    with args.commits.open("a", encoding="utf-8") as out:
        threads = [
            threading.Thread(
                target=_produce_host,
                args=(sorted(dbs.items()), args.rate, args.seconds, out, lock, halt, counts),
                daemon=True,
            )
            for dbs in hosts.values()
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(json.dumps(counts), flush=True)
    return 0


# -- the harness side ---------------------------------------------------------------------------


@dataclass
class DbHost:
    role: str
    server: dbserver.Server
    names: list[str]

    @property
    def host(self) -> Host:
        return self.server.host

    def dsn(self, name: str) -> str:
        return f"{self.server.dsn(name)} {DSN_OPTIONS}"


@contextlib.contextmanager
def second_server(bed: Bed) -> Iterator[dbserver.Server]:
    """A second database host on the bed's network, with a server of its own: the host goes
    with the network, the server stops on the way out."""
    host = bed.net.add("db2", SECOND_DB_OCTET)
    work = bed.work / "db2"
    work.mkdir()
    with dbserver.server(host, work, str(bed.net.subnet)) as server:
        yield server


def create_databases(server: dbserver.Server, names: Sequence[str]) -> None:
    with psycopg.connect(server.admin_dsn, autocommit=True, connect_timeout=10) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def run_cli(args: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return run_to_end([str(CLI), *args], timeout)


@contextlib.contextmanager
def fleet_farm(
    host: Host,
    home: str,
    procs: int,
    work: Path,
    env: Mapping[str, str],
    *,
    app: str = APP,
    port: int = METRICS_PORT,
    tag: str = "",
) -> Iterator[FarmHost]:
    """`outbox-farm start` of the fleet app in `host`'s namespace (`hosts.farm_host`), every
    worker alive when yielded, killed on the way out if still running."""
    with farm_host(
        host,
        home,
        procs,
        work,
        env={"FLEETAPP_HOST": host.role, **env},
        app=app,
        port=port,
        name=f"{host.role}{tag}",
    ) as farm:
        yield farm


def workers(
    farm: FarmHost, conn: psycopg.Connection[Any], fleet: str = FLEET
) -> list[psutil.Process]:
    """The farm's worker processes: the arbiter's children (`ip netns exec` execs into it)
    that are live processes of `fleet` (the arbiter has other children besides)."""
    rows = conn.execute(
        "SELECT pid FROM outbox_farm_fleet_members WHERE fleet = %s AND expires_at > now()",
        (fleet,),
    ).fetchall()
    members = {int(pid) for (pid,) in rows}
    with contextlib.suppress(psutil.Error):
        return [p for p in psutil.Process(farm.proc.pid).children() if p.pid in members]
    return []


def leases(conn: psycopg.Connection[Any]) -> dict[str, tuple[str, float]]:
    """Live leases of the fleet: database -> (holder, taken_at epoch)."""
    rows = conn.execute(
        "SELECT database, holder, extract(epoch FROM taken_at)::float8 "
        "FROM outbox_farm_fleet_leases WHERE fleet = %s AND expires_at > now()",
        (FLEET,),
    ).fetchall()
    return {d: (h, float(t)) for d, h, t in rows}


def pid_of(holder: str) -> int:
    return int(holder.rpartition(":")[2])


def balanced(conn: psycopg.Connection[Any], names: Sequence[str], members: int) -> bool:
    held = leases(conn)
    per: dict[str, int] = defaultdict(int)
    for holder, _ in held.values():
        per[holder] += 1
    share = math.ceil(len(names) / members)
    return (
        all(n in held for n in names)
        and len(per) == members
        and max(per.values(), default=0) <= share
    )


# -- the journals: the handler runs of every host -------------------------------------------


@dataclass
class Run:
    msg_id: str
    db: str
    started: float
    ended: float
    pid: int
    host: str


class Journals:
    """The journals of every host, read again as they grow (only what was added)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.runs: list[Run] = []
        self._read: dict[Path, int] = {}

    def refresh(self) -> list[Run]:
        added: list[Run] = []
        for path in sorted(self.folder.glob("*.tsv")):
            with path.open("rb") as f:
                f.seek(self._read.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line not yet finished is read next time
            self._read[path] = self._read.get(path, 0) + end
            for line in data[:end].decode("utf-8", "replace").splitlines():
                parts = line.split("\t")
                if len(parts) == 6:
                    added.append(
                        Run(
                            parts[0],
                            parts[1],
                            float(parts[2]),
                            float(parts[3]),
                            int(parts[4]),
                            parts[5],
                        )
                    )
        self.runs += added
        return added


class Commits:
    """What the producer and the harness committed: id -> (database, commit epoch)."""

    def __init__(self, *paths: Path) -> None:
        self.paths = paths
        self.rows: dict[str, tuple[str, float]] = {}
        self._read: dict[Path, int] = {}

    def refresh(self) -> None:
        for path in self.paths:
            if not path.exists():
                continue
            with path.open("rb") as f:
                f.seek(self._read.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._read[path] = self._read.get(path, 0) + end
            for line in data[:end].decode().splitlines():
                msg_id, db, at = line.split("\t")
                self.rows[msg_id] = (db, float(at))


# -- measurements -----------------------------------------------------------------------------


def _sockets(pid: int) -> dict[str, int]:
    """The TCP connections of process `pid` by remote address (read from its own namespace's
    /proc/<pid>/net/tcp and its descriptors): its database connections, by host."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out: dict[str, int] = defaultdict(int)
    with contextlib.suppress(OSError):
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
        for line in lines:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if inode in inodes and state == "01":  # ESTABLISHED
                hexaddr, hexport = remote.split(":")
                raw = bytes.fromhex(hexaddr)[::-1]
                if int(hexport, 16) == dbserver.PORT:
                    out[".".join(str(b) for b in raw)] += 1
    return dict(out)


def connections_and_memory(
    runs: Sequence[FarmHost],
    idle: FarmHost,
    conn: psycopg.Connection[Any],
    dbhosts: Sequence[DbHost],
) -> dict[str, Any]:
    held = leases(conn)
    served: dict[int, int] = defaultdict(int)
    for holder, _ in held.values():
        served[pid_of(holder)] += 1
    address = {h.host.address: h.role for h in dbhosts}
    procs = []
    for run in runs:
        for proc in workers(run, conn):
            with contextlib.suppress(psutil.Error):
                by_host = {address.get(a, a): n for a, n in _sockets(proc.pid).items()}
                procs.append(
                    {
                        "host": run.host.role,
                        "pid": proc.pid,
                        "served": served.get(proc.pid, 0),
                        "connections": by_host,
                        "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                    }
                )
    idle_rss = [p.memory_info().rss / 2**20 for p in workers(idle, conn, "idle")]
    idle_mb = idle_rss[0] if idle_rss else float("nan")
    per_db_mb = [(p["rss_mb"] - idle_mb) / p["served"] for p in procs if p["served"]]
    per_db_conns = [
        (sum(p["connections"].values()) - 2) / p["served"] for p in procs if p["served"]
    ]
    activity: dict[str, dict[str, int]] = {}
    for dbhost in dbhosts:
        with psycopg.connect(dbhost.server.admin_dsn, autocommit=True, connect_timeout=10) as c:
            rows = c.execute(
                "SELECT coalesce(host(client_addr), 'local'), count(*) FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' GROUP BY 1 ORDER BY 1"
            ).fetchall()
        activity[dbhost.role] = {str(a): int(n) for a, n in rows}
    return {
        "processes": procs,
        "idle_worker_rss_mb": round(idle_mb, 1),
        "rss_mb_per_served_database": round(sum(per_db_mb) / len(per_db_mb), 2)
        if per_db_mb
        else None,
        "connections_per_served_database": round(sum(per_db_conns) / len(per_db_conns), 2)
        if per_db_conns
        else None,
        "pg_stat_activity_by_client": activity,
    }


def outbox_empty(dsn: str) -> bool:
    with psycopg.connect(dsn, connect_timeout=5, autocommit=True) as conn:
        return conn.execute(tables.query("SELECT 1 FROM {outbox} LIMIT 1")).fetchone() is None


def all_empty(dsns: Sequence[str]) -> bool:
    with ThreadPoolExecutor(8) as pool:
        return all(pool.map(outbox_empty, dsns))


def publish_backlog(dsn: str, name: str, rows: int, out: Path) -> float:
    """`rows` messages in `name`, committed together; the commit's epoch."""
    ids = [f"{name}-backlog-{i}" for i in range(rows)]
    with psycopg.connect(dsn, connect_timeout=10) as conn, conn.transaction():
        for start in range(0, rows, BACKLOG_CHUNK):
            bodies = [{"id": i, "db": name} for i in ids[start : start + BACKLOG_CHUNK]]
            PRODUCER.publish_batch(conn, bodies, queue=QUEUE)
    at = time.time()
    with out.open("a", encoding="utf-8") as f:
        f.writelines(f"{i}\t{name}\t{at:.6f}\n" for i in ids)
    return at


def _rate(runs: Sequence[Run], dbs: set[str], start: float, end: float) -> float:
    n = sum(1 for r in runs if r.db in dbs and start <= r.ended < end)
    return n / (end - start) if end > start else float("nan")


def _catch_up(
    commits: Mapping[str, tuple[str, float]],
    first: Mapping[str, Run],
    cut_dbs: set[str],
    healed_at: float,
) -> float | None:
    """Seconds after the heal by which every cut database had handled all it held from before
    the heal and a row committed after it; None while one has not."""
    after: dict[str, float] = {}  # per cut database, its first row after the heal handled
    at = healed_at
    for msg_id, (db, committed) in commits.items():
        if db not in cut_dbs:
            continue
        run = first.get(msg_id)
        if committed < healed_at:
            if run is None:
                return None
            at = max(at, run.ended)
        elif run is not None:
            after[db] = min(after.get(db, run.ended), run.ended)
    if len(after) < len(cut_dbs):
        return None
    at = max(at, *after.values())
    return at - healed_at


def _first_runs(runs: Sequence[Run]) -> dict[str, Run]:
    first: dict[str, Run] = {}
    for run in runs:
        if run.msg_id not in first or run.ended < first[run.msg_id].ended:
            first[run.msg_id] = run
    return first


# -- the scenario -------------------------------------------------------------------------------


def run(bed: Bed, smoke: bool) -> dict[str, Any]:
    plan = SMOKE if smoke else FULL
    with second_server(bed) as server2:
        return _run(bed, server2, plan)


def _run(bed: Bed, server2: dbserver.Server, plan: Plan) -> dict[str, Any]:
    work = bed.work / "fleet"
    journal_dir = work / "journal"
    journal_dir.mkdir(parents=True)
    first = DbHost("db", bed.server, [f"a{i:02d}" for i in range(1, plan.per_host + 1)])
    second = DbHost("db2", server2, [f"b{i:02d}" for i in range(1, plan.per_host + 1)])
    dbhosts = [first, second]
    say(f"fleet: database hosts {first.host.address} and {second.host.address}")
    began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        list(
            pool.map(
                create_databases,
                [first.server, second.server],
                [[HOME, *first.names], second.names],
            )
        )
    home = first.dsn(HOME)
    created_s = time.monotonic() - began
    dsns = {n: h.dsn(n) for h in dbhosts for n in h.names}
    names = sorted(dsns)
    with psycopg.connect(home, autocommit=True) as conn:
        conn.execute("CREATE TABLE tenants (name text PRIMARY KEY, dsn text NOT NULL)")
        with conn.cursor() as cur:
            cur.executemany("INSERT INTO tenants VALUES (%s, %s)", list(dsns.items()))
    say(f"fleet: {len(names)} databases and the home database created in {created_s:.1f}s")
    began = time.monotonic()
    migrated = run_cli(["fleet", "migrate", APP, "--dsn", home], timeout=900)
    migrate_s = time.monotonic() - began
    migrate_line = (migrated.stdout.strip().splitlines() or [""])[-1]
    say(f"fleet: `outbox-farm fleet migrate` in {migrate_s:.1f}s: {migrate_line}")
    if migrated.returncode != 0:
        raise SetupError(
            f"fleet migrate failed: {migrated.stdout[-1500:]}{migrated.stderr[-1500:]}"
        )
    env = {
        "FLEETAPP_JOURNAL": str(journal_dir),
        "FLEETAPP_LEASE": str(plan.lease),
        "FLEETAPP_RECHECK": str(plan.recheck),
    }
    result: dict[str, Any] = {
        "scenario": "fleet",
        "databases": len(names),
        "database_hosts": 2,
        "hosts": plan.hosts,
        "procs": plan.procs,
        "rate_per_database": plan.rate,
        "lease_s": plan.lease,
        "catalog_dsn_options": DSN_OPTIONS,
        "create_s": round(created_s, 1),
        "migrate_s": round(migrate_s, 1),
        "migrate_summary": migrate_line,
        "migrate_ok": migrated.returncode == 0
        and f"{len(names)} database(s): {len(names)} migrated" in migrate_line,
    }
    with (
        psycopg.connect(home, autocommit=True, connect_timeout=10) as conn,
        contextlib.ExitStack() as stack,
    ):
        runs: list[FarmHost] = []
        for host in bed.farm_hosts(plan.hosts):
            runs.append(stack.enter_context(fleet_farm(host, home, plan.procs, work, env)))
        members = plan.hosts * plan.procs
        ok = wait_until(lambda: balanced(conn, names, members), 120, every=0.5)
        say(
            f"fleet: {members} processes {'share' if ok else 'DO NOT SHARE'} {len(names)} databases"
        )
        result["shared_out_at_start"] = ok
        idle = stack.enter_context(
            fleet_farm(
                bed.farm_hosts(1)[0],
                home,
                1,
                work,
                env,
                app=IDLE_APP,
                port=METRICS_PORT + 1,
                tag="-idle",
            )
        )
        _scenario(bed, plan, dbhosts, dsns, conn, runs, idle, work, result)
    return result


def _scenario(
    bed: Bed,
    plan: Plan,
    dbhosts: list[DbHost],
    dsns: dict[str, str],
    conn: psycopg.Connection[Any],
    runs: list[FarmHost],
    idle: FarmHost,
    work: Path,
    result: dict[str, Any],
) -> None:
    _first, _second = dbhosts
    journals = Journals(work / "journal")
    commits_file, harness_commits = work / "commits.tsv", work / "harness-commits.tsv"
    commits = Commits(commits_file, harness_commits)
    producer_dsns = work / "producer-dsns.json"
    producer_dsns.write_text(
        json.dumps(
            {h.role: {n: f"{h.server.dsn(n)} {PRODUCER_OPTIONS}" for n in h.names} for h in dbhosts}
        )
    )
    command = bed.producer.exec(
        [
            sys.executable, "-m", "loadtests.scale.fleet", "produce",
            "--dsns", str(producer_dsns), "--rate", str(plan.rate),
            "--seconds", "3600", "--commits", str(commits_file),
        ]
    )  # fmt: skip
    prod = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _phases(bed, plan, dbhosts, dsns, conn, runs, idle, journals, commits, harness_commits,
                result, prod)  # fmt: skip
    finally:
        if prod.poll() is None:
            prod.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            prod.communicate(timeout=10)


def _phases(
    bed: Bed,
    plan: Plan,
    dbhosts: list[DbHost],
    dsns: dict[str, str],
    conn: psycopg.Connection[Any],
    runs: list[FarmHost],
    idle: FarmHost,
    journals: Journals,
    commits: Commits,
    harness_commits: Path,
    result: dict[str, Any],
    prod: subprocess.Popen[str],
) -> None:
    first, second = dbhosts
    rate_total = plan.rate * len(dsns)
    say(f"fleet: producing {plan.rate:g} msg/s into each database ({rate_total:g} msg/s)")
    time.sleep(plan.warm)  # the load's own pace: nothing is asserted on it

    # Connections and memory, in the steady state.
    measured = connections_and_memory(runs, idle, conn, dbhosts)
    result["footprint"] = measured
    for p in measured["processes"]:
        say(
            f"fleet: {p['host']} pid {p['pid']}: serves {p['served']} databases, "
            f"connections {p['connections']}, RSS {p['rss_mb']} MB"
        )
    say(
        f"fleet: idle worker RSS {measured['idle_worker_rss_mb']} MB; per served database "
        f"{measured['rss_mb_per_served_database']} MB, "
        f"{measured['connections_per_served_database']} connections; pg_stat_activity "
        f"{measured['pg_stat_activity_by_client']}"
    )
    time.sleep(plan.before)

    # Cut the second database host.
    cut_dbs, kept_dbs = set(second.names), set(first.names)
    cut_at = time.time()
    second.host.cut()
    say(f"fleet: {second.role} CUT for {plan.cut_for:g}s")
    try:
        time.sleep(plan.cut_for)
    finally:
        second.host.heal()
    healed_at = time.time()
    say(f"fleet: {second.role} HEALED after {healed_at - cut_at:.1f}s")

    def caught_up() -> bool:
        commits.refresh()
        journals.refresh()
        return _catch_up(commits.rows, _first_runs(journals.runs), cut_dbs, healed_at) is not None

    ok = wait_until(caught_up, plan.catch_up_window, every=0.5)
    catch_up = _catch_up(commits.rows, _first_runs(journals.runs), cut_dbs, healed_at)
    before_rate = _rate(journals.runs, kept_dbs, cut_at - plan.before, cut_at)
    during_rate = _rate(journals.runs, kept_dbs, cut_at, healed_at)
    ratio = during_rate / before_rate if before_rate else float("nan")
    result["cut"] = {
        "host": second.role,
        "seconds": round(healed_at - cut_at, 1),
        "kept_rate_before": round(before_rate, 1),
        "kept_rate_during": round(during_rate, 1),
        "kept_ratio": round(ratio, 3),
        "kept_rate_ok": ratio >= 0.9,
        "caught_up": catch_up is not None,
        "catch_up_s": round(catch_up, 1) if catch_up is not None else None,
    }
    say(
        f"fleet: {first.role}'s databases handled {before_rate:.1f} msg/s before the cut, "
        f"{during_rate:.1f} during (ratio {ratio:.3f}); {second.role}'s caught up "
        + (f"in {catch_up:.1f}s after the heal" if catch_up is not None else "NOT in time")
    )

    # Kill a farm host.
    victim = runs[-1]
    victim_pids = {p.pid for p in workers(victim, conn)}
    held = leases(conn)
    victim_dbs = {d for d, (h, _) in held.items() if pid_of(h) in victim_pids}
    killed_at = time.time()
    kill_farm(victim.proc)
    say(
        f"fleet: {victim.host.role} KILLED (its workers {sorted(victim_pids)} held "
        f"{len(victim_dbs)} databases)"
    )

    def taken_over() -> bool:
        now = leases(conn)
        return all(d in now and pid_of(now[d][0]) not in victim_pids for d in victim_dbs)

    ok = wait_until(taken_over, plan.lease * 4 + 30, every=0.1)
    polled = time.time() - killed_at
    now = leases(conn)
    taken = [now[d][1] - killed_at for d in victim_dbs if d in now]
    takeover = max(taken) if ok and taken else None

    def served_again() -> bool:
        journals.refresh()
        seen = {r.db for r in journals.runs if r.ended > killed_at and r.pid not in victim_pids}
        return victim_dbs <= seen

    served = wait_until(served_again, 60, every=0.2)
    first_after: dict[str, float] = {}
    for r in journals.runs:
        if r.db in victim_dbs and r.ended > killed_at and r.pid not in victim_pids:
            first_after[r.db] = min(first_after.get(r.db, float("inf")), r.ended)
    served_s = max(first_after.values()) - killed_at if served and first_after else None
    # The fleet's promise: a dead host's databases are served again within the lease of their
    # last renewal, which came before the kill (half a second for the two clocks read here).
    bound = plan.lease + 0.5
    result["kill"] = {
        "host": victim.host.role,
        "databases": len(victim_dbs),
        "takeover_s": round(takeover, 2) if takeover is not None else None,
        "takeover_polled_s": round(polled, 2),
        "served_again_s": round(served_s, 2) if served_s is not None else None,
        "bound_s": round(bound, 1),
        "ok": takeover is not None and takeover <= bound,
    }
    say(
        f"fleet: the killed host's {len(victim_dbs)} databases taken over "
        f"{takeover if takeover is None else round(takeover, 2)}s after the kill (leases' "
        f"taken_at; lease {plan.lease:g}s, rounds every {plan.lease / 4:g}s), first row handled "
        f"again after {served_s if served_s is None else round(served_s, 2)}s"
    )
    time.sleep(plan.settle)

    # A database added to the catalog.
    with psycopg.connect(first.server.admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(NEW_DB)))
    new_dsn = first.dsn(NEW_DB)
    with psycopg.connect(new_dsn) as new:
        migrate(new, tables.NAMES)
    with psycopg.connect(new_dsn) as new, new.transaction():
        PRODUCER.publish_batch(new, [{"id": f"{NEW_DB}-0", "db": NEW_DB}], queue=QUEUE)
    with harness_commits.open("a") as f:
        f.write(f"{NEW_DB}-0\t{NEW_DB}\t{time.time():.6f}\n")
    conn.execute("INSERT INTO tenants VALUES (%s, %s)", (NEW_DB, new_dsn))
    added_at = time.time()

    def picked_up() -> bool:
        journals.refresh()
        return any(r.db == NEW_DB for r in journals.runs)

    ok = wait_until(picked_up, 60, every=0.1)
    pickup = min((r.ended for r in journals.runs if r.db == NEW_DB), default=float("nan"))
    result["new_database"] = {
        "pickup_s": round(pickup - added_at, 2) if ok else None,
        "ok": ok,
    }
    dsns = {**dsns, NEW_DB: new_dsn}
    say(
        "fleet: a database added to the catalog had its first row handled after "
        f"{pickup - added_at:.2f}s"
    )

    # Fairness: one database's backlog.
    busy = first.names[0]
    say(f"fleet: {plan.backlog:,} rows into {busy} ...")
    backlog_at = publish_backlog(dsns[busy], busy, plan.backlog, harness_commits)
    drained = wait_until(lambda: outbox_empty(dsns[busy]), 600, every=0.5)
    drained_at = time.time()
    journals.refresh()
    commits.refresh()
    first_runs = _first_runs(journals.runs)
    lat = [
        first_runs[m].ended - t
        for m, (d, t) in commits.rows.items()
        if d != busy and backlog_at <= t <= drained_at and m in first_runs
    ]
    backlog_ends = [r.ended for m, r in first_runs.items() if r.db == busy and "-backlog-" in m]
    drain_s = max(backlog_ends, default=backlog_at) - backlog_at
    p99 = percentile(lat, 99.0)
    worst = max(lat, default=float("nan"))
    result["fairness"] = {
        "backlog_database": busy,
        "backlog_rows": plan.backlog,
        "backlog_drain_s": round(drain_s, 1),
        "backlog_drained": drained,
        "others_rows": len(lat),
        "others_p50_ms": round(percentile(lat, 50.0) * 1000, 1),
        "others_p99_ms": round(p99 * 1000, 1),
        "others_max_ms": round(worst * 1000, 1),
        "ok": drained and bool(lat) and worst <= 1.0,
    }
    say(
        f"fleet: {busy}'s backlog drained in {drain_s:.1f}s; meanwhile {len(lat)} rows of the "
        f"other databases: commit->handled p50 {percentile(lat, 50.0) * 1000:.0f} ms, "
        f"p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms"
    )

    # The end: stop the load, drain everything, stop the farms.
    prod.send_signal(signal.SIGTERM)
    out, err = prod.communicate(timeout=60)
    produced = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    say(f"fleet: producer stopped: {produced} {err.strip()[-300:]}")
    everything = sorted(dsns.values())
    drained = wait_until(lambda: all_empty(everything), 180, every=1.0)
    stops = {}
    for farm in [*runs[:-1], idle]:
        stops[farm.host.role + ("-idle" if farm is idle else "")] = farm.stop()
    journals.refresh()
    commits.refresh()
    _account(result, journals.runs, commits.rows, victim.host.role, cut_dbs, cut_at, healed_at)
    result["producer"] = produced
    result["drained"] = drained
    result["stop_status"] = stops
    result["ok"] = bool(
        result["migrate_ok"]
        and result["shared_out_at_start"]
        and result["cut"]["kept_rate_ok"]
        and result["cut"]["caught_up"]
        and result["kill"]["ok"]
        and result["new_database"]["ok"]
        and result["fairness"]["ok"]
        and result["ledger"]["lost"] == 0
        and result["ledger"]["unexplained"] == 0
        and drained
    )


def _account(
    result: dict[str, Any],
    runs: Sequence[Run],
    commits: Mapping[str, tuple[str, float]],
    victim: str,
    cut_dbs: set[str],
    cut_at: float,
    healed_at: float,
) -> None:
    """Every committed row handled; every duplicate's first run on the killed host, or on a
    database of the cut host around the cut (its acks refused or lost), else unexplained."""
    per_msg: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        per_msg[r.msg_id].append(r)
    lost = [m for m in commits if m not in per_msg]
    unrecorded = [m for m in per_msg if m not in commits]
    by_kill = by_cut = 0
    unexplained = []
    for msg_id, rs in per_msg.items():
        if len(rs) < 2:
            continue
        firstrun = min(rs, key=lambda r: r.started)
        if firstrun.host == victim:
            by_kill += 1
        elif firstrun.db in cut_dbs and firstrun.started < healed_at + 60:
            by_cut += 1
        else:
            unexplained.append(msg_id)
    result["ledger"] = {
        "committed": len(commits),
        "handled": len(per_msg),
        "runs": len(runs),
        "lost": len(lost),
        "lost_ids": lost[:5],
        "committed_unrecorded": len(unrecorded),
        "duplicates": sum(len(rs) - 1 for rs in per_msg.values()),
        "duplicated_by_kill": by_kill,
        "duplicated_by_cut": by_cut,
        "unexplained": len(unexplained),
        "unexplained_ids": unexplained[:5],
    }
    say(f"fleet: ledger {result['ledger']}")


def render(r: dict[str, Any]) -> list[str]:
    """The scenario's table for the printed summary."""

    def mark(ok: object) -> str:
        return "pass" if ok else "FAIL"

    fp, cut, kill = r["footprint"], r["cut"], r["kill"]
    new, fair, led = r["new_database"], r["fairness"], r["ledger"]
    rows = [
        (
            "databases, hosts",
            f"{r['databases']} on 2 database hosts; {r['hosts']} farm hosts x --procs "
            f"{r['procs']}; {r['rate_per_database']:g} msg/s each",
            "",
        ),
        ("fleet migrate", f"{r['migrate_s']}s: {r['migrate_summary']}", mark(r["migrate_ok"])),
        ("shared out at start", str(r["shared_out_at_start"]), mark(r["shared_out_at_start"])),
        ("connections per served database", str(fp["connections_per_served_database"]), ""),
        (
            "RSS per served database",
            f"{fp['rss_mb_per_served_database']} MB (idle worker {fp['idle_worker_rss_mb']} MB)",
            "",
        ),
        (
            "kept host's rate before/during cut",
            f"{cut['kept_rate_before']}/{cut['kept_rate_during']} msg/s = {cut['kept_ratio']}",
            mark(cut["kept_rate_ok"]),
        ),
        (
            f"cut host's catch-up ({cut['seconds']}s cut)",
            f"{cut['catch_up_s']}s after the heal",
            mark(cut["caught_up"]),
        ),
        (
            "takeover of a killed farm host",
            f"{kill['takeover_s']}s for {kill['databases']} databases (bound {kill['bound_s']}s); "
            f"rows handled again after {kill['served_again_s']}s",
            mark(kill["ok"]),
        ),
        ("new database's first row handled", f"{new['pickup_s']}s", mark(new["ok"])),
        (
            "other databases during a backlog",
            f"{fair['backlog_rows']:,} rows drained in {fair['backlog_drain_s']}s; others p99 "
            f"{fair['others_p99_ms']} ms, max {fair['others_max_ms']} ms ({fair['others_rows']})",
            mark(fair["ok"]),
        ),
        (
            "ledger",
            f"{led['committed']:,} committed, {led['handled']:,} handled, {led['lost']} lost, "
            f"{led['duplicates']} duplicates ({led['duplicated_by_kill']} kill, "
            f"{led['duplicated_by_cut']} cut, {led['unexplained']} unexplained)",
            mark(led["lost"] == 0 and led["unexplained"] == 0),
        ),
        ("drained", str(r["drained"]), mark(r["drained"])),
    ]
    for p in fp["processes"]:
        conns = ", ".join(f"{h} {n}" for h, n in sorted(p["connections"].items()))
        rows.append(
            (
                f"  {p['host']} pid {p['pid']}",
                f"{p['served']} databases; connections {conns}; RSS {p['rss_mb']} MB",
                "",
            )
        )
    lines = align([("fleet", "value", "check"), *rows], left=3)
    return [lines[0], "-" * len(lines[0]), *lines[1:]]


if __name__ == "__main__":
    if sys.argv[1:2] == ["produce"]:
        sys.exit(produce(sys.argv[2:]))
    sys.exit("usage: python -m loadtests.scale.fleet produce --dsns ... (the producer host's)")
