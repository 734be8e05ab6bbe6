"""`doctor`: is this database fit to run a farm on, and if not, what to do about it.

Each check gives OK, WARN or FAIL and, when not OK, the next step. FAIL means the farm cannot
work as it should (no table, missing privileges, a transaction holding back VACUUM for longer
than the limit, a stalled queue); WARN means it works but will degrade (autovacuum off, a
filling NOTIFY queue, a backlog). The checks read the statistics views, the catalogs and the
outbox's indexes; the one statement that writes, each queue's claim probe, is rolled back.

Doctor runs in a process of its own, so a stall is judged from the database alone: a queue
whose claim statement fails (the farm's claims of it fail the same way, every time), or whose
oldest claimable row has waited past `Limits.max_stall` while none of its rows is leased, unless
its rows wait by design: an operator paused it, or its breaker is open (`stats.held`). So is
the farms' code: what every live worker process reports of its handlers (`chores.farm_code`);
two codes for one queue past the farm's grace period are a deploy left half done (WARN).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from ..chores.farm_code import GRACE, disagreements
from ..db import farm_code, queue_controls
from ..db.connect import Connection
from ..db.operator import DoctorProbes
from ..errors import DatabaseError, SchemaError
from ..names import QualifiedName, TableNames
from ..ops.privileges import check_privileges
from ..ops.schema_check import check_schema
from .queues import queue_states
from .stats import STALL_AFTER, held, stall_reason

MIN_SERVER = 120000  # VACUUM (SKIP_LOCKED, TRUNCATE false) and vacuum_truncate: PostgreSQL 12
NOTIFY_WARN, NOTIFY_FAIL = 0.1, 0.5
SLOT_XID_WARN = 1_000_000
DEAD_WARN = 100_000
# A claim probe cut short by its own lock or statement timeout: no verdict on the queue.
PROBE_CUT_SHORT = ("55P03", "57014")


class Status(Enum):
    OK = "OK"
    WARN = "WARN"
    FAIL = "FAIL"


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    hint: str = ""  # what to do, when not OK


@dataclass(frozen=True)
class Limits:
    max_xmin_age: float = 300.0  # seconds a snapshot may hold back VACUUM before FAIL
    max_lag: float = 60.0  # seconds the oldest ready row may wait before WARN
    max_stall: float = STALL_AFTER  # ... with none of its queue's rows leased, before FAIL


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024:
            return f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _server(probes: DoctorProbes) -> list[Check]:
    facts = probes.server()
    version, usage = facts.version, facts.notify_queue_usage
    checks = [Check("connection", Status.OK, f"database {facts.database} as {facts.user}")]
    if facts.version_num < MIN_SERVER:
        checks.append(
            Check(
                "server version",
                Status.FAIL,
                f"PostgreSQL {version}",
                "the farm needs PostgreSQL 12 or later; upgrade the server",
            )
        )
    else:
        checks.append(Check("server version", Status.OK, f"PostgreSQL {version}"))
    if not facts.track_counts:
        checks.append(
            Check(
                "track_counts",
                Status.WARN,
                "off: no row statistics are kept",
                "autovacuum cannot run and the farm's VACUUM runs blind; set track_counts = on "
                "in postgresql.conf and reload",
            )
        )
    else:
        checks.append(Check("track_counts", Status.OK, "on"))
    if not facts.autovacuum:
        checks.append(
            Check(
                "autovacuum",
                Status.WARN,
                "off for the whole server",
                "only the farm's own VACUUM (start --vacuum-interval, needs table ownership) keeps "
                "the outbox small; set autovacuum = on in postgresql.conf and reload",
            )
        )
    else:
        checks.append(Check("autovacuum", Status.OK, "on"))
    share = f"{usage:.1%} of the NOTIFY queue in use"
    hint = (
        "a session that LISTENs but does not read (or sits in a long transaction) holds "
        "it; find it in pg_stat_activity and end it: when the queue is full every "
        "publish fails"
    )
    status = (
        Status.FAIL if usage >= NOTIFY_FAIL else Status.WARN if usage >= NOTIFY_WARN else Status.OK
    )
    checks.append(Check("notify queue", status, share, hint if status is not Status.OK else ""))
    return checks


def _access(conn: Connection, names: TableNames) -> list[Check]:
    access = check_privileges(conn, names)
    checks = [
        Check("privileges", Status.FAIL, problem, "an owner runs the GRANT above")
        for problem in access.problems
    ]
    checks += [Check("privileges", Status.WARN, note, "optional") for note in access.notes]
    if not access.problems and not access.notes:
        checks.append(Check("privileges", Status.OK, "everything the farm does is granted"))
    if access.schema_usage_missing:
        return checks  # the catalog lookups of the schema check would be refused
    problems = check_schema(conn, names)
    checks += [
        Check(
            "schema",
            Status.FAIL,
            str(problem),
            "run `outbox-farm migrate` (`--repair` for a dropped index), then `check`",
        )
        for problem in problems
    ]
    if not problems:
        checks.append(Check("schema", Status.OK, "tables, columns and indexes as expected"))
    return checks


def _tables(probes: DoctorProbes, names: TableNames) -> list[Check]:
    checks = []
    tables: list[QualifiedName] = [names.outbox, *([names.dlq] if names.dlq else [])]
    for table in tables:
        health = probes.table_health(table)
        if health is None:
            continue  # the schema check reports the missing table
        live, dead, since = health.live, health.dead, health.since_vacuum
        vacuumed = "never vacuumed" if since is None else f"last vacuum {since:.0f}s ago"
        detail = f"{_size(health.size)}, {live} live and {dead} dead row versions, {vacuumed}"
        if dead > max(DEAD_WARN, 2 * live):
            checks.append(
                Check(
                    f"table {table}",
                    Status.WARN,
                    detail,
                    "dead rows pile up: is something holding back xmin (below)? Is the farm's "
                    "VACUUM allowed (owner or MAINTAIN)? A one-off `VACUUM` helps meanwhile",
                )
            )
        else:
            checks.append(Check(f"table {table}", Status.OK, detail))
        if health.autovacuum_off:
            checks.append(
                Check(
                    f"table {table}",
                    Status.WARN,
                    "autovacuum_enabled = false",
                    f"turn it back on: ALTER TABLE {table} RESET (autovacuum_enabled)",
                )
            )
    return checks


def _xmin(probes: DoctorProbes, limits: Limits) -> Check:
    holder = probes.xmin_holder()
    if holder is None:
        return Check("xmin horizon", Status.OK, "no open snapshot holds back VACUUM")
    seconds = holder.seconds
    age = "" if seconds is None else f"open for {seconds:.0f}s, "
    detail = f"oldest holder: {holder.kind} {holder.who}, {age}{holder.xid_age} transactions behind"
    late = seconds is not None and seconds > limits.max_xmin_age
    if late or (seconds is None and holder.xid_age > SLOT_XID_WARN):
        hint = {
            "session": "VACUUM cannot remove the outbox's dead rows while it is open: commit "
            "or end it (SELECT pg_terminate_backend(pid)), and set "
            "idle_in_transaction_session_timeout",
            "prepared transaction": "COMMIT PREPARED or ROLLBACK PREPARED it",
            "replication slot": "a slot nobody reads: drop it with pg_drop_replication_slot()",
        }[holder.kind]
        return Check("xmin horizon", Status.FAIL if late else Status.WARN, detail, hint)
    return Check("xmin horizon", Status.OK, detail)


def _lag(probes: DoctorProbes, limits: Limits) -> Check:
    ages = probes.oldest_ready_by_queue()
    if not ages or max(ages.values()) == 0:
        return Check("oldest ready row", Status.OK, "no row is waiting")
    queue = max(ages, key=lambda q: ages[q])
    detail = f"due {ages[queue]:.1f}s ago on queue {queue}"
    if ages[queue] > limits.max_lag:
        return Check(
            "oldest ready row",
            Status.WARN,
            detail,
            "the farm is behind or not running: see `outbox-farm stats` and the farm's "
            "/healthz; more --procs or concurrency if it is busy",
        )
    return Check("oldest ready row", Status.OK, detail)


def _queue_stall(
    probes: DoctorProbes, queue: str, limits: Limits, waits: bool = False
) -> Check | None:
    """The stall of one queue, if it has one: its claim fails, or rows wait unleased (unless
    they `waits` by design: the queue is paused or its breaker open)."""
    try:
        probes.probe_claim(queue)
    except DatabaseError as exc:
        if exc.sqlstate in PROBE_CUT_SHORT:
            return Check(
                f"queue {queue}",
                Status.WARN,
                f"the claim probe was cut short: {exc}",
                "a lock on the outbox (a migration, a manual LOCK) or a very slow claim: run "
                "doctor again, and look in pg_stat_activity for what holds the table",
            )
        return Check(
            f"queue {queue}",
            Status.FAIL,
            f"stalled: its claim fails: {exc}",
            "every claim of this queue fails the same way and none of its rows is delivered: "
            "remove the cause (a trigger or rule on the outbox, a revoked privilege, a "
            "constraint), and the farm resumes on its own",
        )
    if waits:
        return None
    reason = stall_reason(probes.stall(queue), limits.max_stall)
    if reason is None:
        return None
    return Check(
        f"queue {queue}",
        Status.FAIL,
        reason,
        "start a farm whose app has a handler for this queue (see its /healthz, and "
        "`outbox-farm stats` for the backlog)",
    )


def _held(conn: Connection, names: TableNames) -> dict[str, str]:
    """The queues whose rows wait by design, and why ("paused", "breaker open"); none on a
    database without the controls table, or a role that may not read it (the schema and
    privilege checks report those): every queue is then judged by its rows alone."""
    try:
        if not queue_controls.controls_kept(conn, names):
            return {}
        states = queue_states(conn, names)
    except DatabaseError:
        return {}
    return {s.queue: "paused" if s.paused else "breaker open" for s in states if held(s)}


def _stalls(
    conn: Connection, probes: DoctorProbes, names: TableNames, limits: Limits
) -> list[Check]:
    """Each stalled queue of the outbox, or one OK line; nothing without an outbox table (the
    schema check reports it). A schema that is otherwise wrong is no reason to skip: a claim
    it breaks fails the probe, and names the queues that are stuck. A paused queue's claim is
    probed too (a farm claims it again at the resume); its waiting rows are no stall."""
    if probes.table_health(names.outbox) is None:
        return []
    queues = probes.queues()
    waiting = _held(conn, names)
    checks = [
        c for c in (_queue_stall(probes, q, limits, q in waiting) for q in queues) if c is not None
    ]
    if not checks:
        detail = f"{len(queues)} queue(s): every claim runs, none stalled"
        held_here = sorted(q for q in queues if q in waiting)
        if held_here:
            detail += (
                " (held, so waiting by design: "
                + ", ".join(f"{q} {waiting[q]}" for q in held_here)
                + ")"
            )
        checks.append(Check("queues", Status.OK, detail))
    return checks


def _farm_code(conn: Connection, names: TableNames) -> list[Check]:
    """Whether the farms on this database run one code for each queue, and the code on their
    disks (a failed reload, as their workers report it)."""
    try:
        seen = farm_code.seen(conn, names)
    except SchemaError:
        return [
            Check(
                "farm code",
                Status.WARN,
                "no table outbox_farm_code: the farms cannot tell when they run different code",
                "run `outbox-farm migrate` (migration 0010)",
            )
        ]
    checks = [
        Check(
            "farm code",
            Status.WARN,
            f"the running code is not the code on disk: the last reload failed ({note})",
            "fix the code, then reload that farm again (kill -HUP); its /healthz says the same",
        )
        for note in sorted({note for entry in seen for note in entry.notes})
    ]
    if lasting := disagreements(seen, GRACE):
        hint = (
            "finish the deploy (or roll it back) on every farm; `kill -HUP` a farm to load the "
            "code on its disk, and see its /healthz: a failed reload keeps the old code"
        )
        return [*checks, Check("farm code", Status.WARN, " | ".join(lasting.values()), hint)]
    if not seen:
        detail = "no farm reports its code (none is running?)"
    elif young := disagreements(seen, 0.0):
        detail = f"{len(young)} queue(s) changing code (a rolling deploy under way?)"
    else:
        detail = f"{len({entry.queue for entry in seen})} queue(s), one code each"
    return [*checks, Check("farm code", Status.OK, detail)]


def doctor(conn: Connection, names: TableNames, limits: Limits | None = None) -> list[Check]:
    """Every check, in the order an operator reads them; the caller prints and decides. A
    check the database refuses (a missing privilege on a catalog view, say) is a FAIL of its
    own, and the others still run (the connection must be in autocommit mode)."""
    limits = limits or Limits()
    probes = DoctorProbes(conn, names)
    sections: list[tuple[str, Callable[[], list[Check]]]] = [
        ("server", lambda: _server(probes)),
        ("privileges and schema", lambda: _access(conn, names)),
        ("tables", lambda: _tables(probes, names)),
        ("xmin horizon", lambda: [_xmin(probes, limits)]),
    ]
    checks: list[Check] = []
    for name, section in sections:
        try:
            checks += section()
        except DatabaseError as exc:
            checks.append(Check(name, Status.FAIL, str(exc), "fix this first"))
    if all(c.status is not Status.FAIL for c in checks if c.name in ("privileges", "schema")):
        try:
            checks.append(_lag(probes, limits))
        except DatabaseError as exc:
            checks.append(Check("oldest ready row", Status.FAIL, str(exc)))
    try:
        checks += _stalls(conn, probes, names, limits)
    except DatabaseError as exc:
        checks.append(Check("queues", Status.FAIL, str(exc), "fix this first"))
    try:
        checks += _farm_code(conn, names)
    except DatabaseError as exc:
        checks.append(Check("farm code", Status.WARN, str(exc), "grant SELECT on outbox_farm_code"))
    return checks
