"""Farms on one database that run different code for one queue: found, logged once, and shown
on /healthz and by `doctor`.

Every worker process reports, every `EVERY` seconds, a fingerprint of each queue's handler to
`outbox_farm_code` (migration 0010), valid for `TTL` seconds on the database clock: a process
that stops drops out within that time, whatever its clock. The housekeeper of each farm also
reads what every live process reports for its queues. Two fingerprints for one queue are
normal while a rolling deploy is under way; one that lasts `GRACE` seconds is a deploy left half
done: a WARNING log line (once, and an INFO line when the farms agree again), and a warning
under /healthz's `degraded` that leaves the status 200: the rows are still delivered, each by
one of the codes, and an orchestrator that restarted or unrouted processes for it would make
things worse, not better.

The fingerprint is the handler's qualified name and source text, with the settings that decide
what happens to a row: deliveries, retry strategy, ack policy, timeout, lease, batch,
transactional. The text is read when the app's modules are imported (`remember`, called by the
app loader), so a worker forked later from a preloaded app (`--preload`) reports the code it
runs, not whatever file is on disk by then. Source, not bytecode: two farms on different Python
versions running the same code must agree. A handler whose source cannot be read is taken by its
code objects, constants and names included (a changed topic counts); those differ between Python
versions, so such a handler looks changed across them. A callable object (a relay) is taken by
its class's source and its public settings, a relay's target's too (topic, exchange, URL...),
secrets masked: a rotated password is no change of code. What stays unseen: a change in a
function the handler calls (a library's too), or in a setting kept in a private (`_`-named)
attribute. Concurrency and prefetch are left out, as farms may differ in them on
purpose (`start --concurrency`).

With its fingerprints a process reports a note on its code when it has one: its farm's last
reload failed, so the code it runs is not the code on disk (the arbiter's error line). `doctor`
shows it.

A database without the table (migration 0010 not applied yet: deploy order must not matter),
or a role that may not write it, costs the comparison only: said once, and tried again every
`RETRY` seconds, so that a `migrate` or a grant made later takes effect without a restart.

Each process reports under its host name and pid, for the operator, and a random token of its
own: containers that share a host name each have their own pids, and two of their processes
with one pid must not overwrite each other's reports, nor withdraw them at their stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import hashlib
import inspect
import logging
import os
import socket
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from types import CodeType

from ..db import farm_code
from ..db.farm_code import CodeSeen
from ..db.pool import Pool
from ..dsn import MASK, secret_fragments
from ..errors import DatabaseError, PermanentError
from ..handler import HandlerSpec
from ..queries import Queries

log = logging.getLogger("outbox_farm.farm_code")
EVERY = 10.0  # seconds between two reports of one process
TTL = 35.0  # seconds a report counts: a process that missed three is gone
GRACE = 120.0  # seconds two codes for one queue are a rolling deploy under way, not a problem
RETRY = 300.0  # seconds between two tries while the table is missing or may not be written
SETTINGS_DEPTH = 2  # a relay, its target, the target's settings: deeper objects by type alone

# The code of every handler loaded in this process (or in the arbiter that forked it), read as
# its module was imported: id(handler) -> (handler, its text). The handler is kept so that its
# id is never reused by another object.
_loaded: dict[int, tuple[object, str]] = {}


def remember(specs: Iterable[HandlerSpec]) -> None:
    """Read the handlers' code now, while it is the code just imported: called by the app
    loader, in the arbiter (for `--preload`) and in every worker that imports the app afresh."""
    for spec in specs:
        _loaded[id(spec.func)] = (spec.func, _code_text(spec.func))


def fingerprint(spec: HandlerSpec) -> str:
    """12 hex digits that differ when the queue's handler or its row policy does (see above)."""
    loaded = _loaded.get(id(spec.func))
    code = loaded[1] if loaded is not None and loaded[0] is spec.func else _code_text(spec.func)
    retry = spec.retry
    # A strategy of the user's without a repr of its values would differ in every process.
    retry_text = repr(retry) if dataclasses.is_dataclass(retry) else type(retry).__qualname__
    policy = (spec.max_deliveries, retry_text, spec.ack, spec.timeout, spec.lease_ttl)
    text = "\0".join((code, repr((*policy, spec.batch, spec.transactional))))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _code_text(func: object) -> str:
    """The handler's name and code; for a callable object, its class's, and its settings."""
    if inspect.isfunction(func) or inspect.ismethod(func):
        return f"{_name(func)}\0{_source(func)}"
    return f"{_name(type(func))}\0{_source(type(func))}\0{_settings(func, SETTINGS_DEPTH)}"


def _name(code_of: object) -> str:
    return f"{getattr(code_of, '__module__', '')}.{getattr(code_of, '__qualname__', '')}"


def _source(code_of: object) -> str:
    """The source text, or else the code objects (a class's: those of its functions)."""
    try:
        return inspect.getsource(code_of)  # type: ignore[arg-type]
    except (OSError, TypeError):
        pass
    if inspect.isclass(code_of):
        members = sorted(vars(code_of).items())
        return "\0".join(_source(value) for _, value in members if inspect.isfunction(value))
    code = getattr(code_of, "__code__", None)
    return _bytecode(code) if isinstance(code, CodeType) else ""


def _bytecode(code: CodeType) -> str:
    """The instructions with the constants and names they use (`co_code` holds only their
    indexes), nested functions' code included."""
    consts = [
        _bytecode(const)
        if isinstance(const, CodeType)
        # A set literal's constant: its order changes with each process's string hashing.
        else repr(sorted(map(repr, const)))
        if isinstance(const, frozenset)
        else repr(const)
        for const in code.co_consts
    ]
    return "\0".join((code.co_code.hex(), repr(code.co_names), *consts))


def _settings(value: object, depth: int) -> str:
    """A stable text of `value`'s public settings, `depth` objects deep, secrets masked: only
    a digest of it is stored, but a password changed on one farm first must not look like
    different code."""
    if isinstance(value, str):
        for fragment in secret_fragments(value):
            value = value.replace(fragment, MASK)
        return repr(value)
    if value is None or isinstance(value, bool | int | float | bytes | enum.Enum):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_settings(item, depth) for item in value) + "]"
    if isinstance(value, set | frozenset):
        return "{" + ", ".join(sorted(_settings(item, depth) for item in value)) + "}"
    if isinstance(value, Mapping):
        items = sorted(f"{_settings(k, depth)}: {_settings(v, depth)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    if inspect.isroutine(value) or inspect.isclass(value):
        return _name(value)
    kind = _name(type(value))
    if depth == 0 or not hasattr(value, "__dict__"):
        return kind
    fields = sorted((k, v) for k, v in vars(value).items() if not k.startswith("_"))
    return kind + "(" + ", ".join(f"{k}={_settings(v, depth - 1)}" for k, v in fields) + ")"


def disagreements(seen: list[CodeSeen], grace: float) -> dict[str, str]:
    """The queues run with more than one fingerprint for `grace` seconds or longer, each with
    the line that says so."""
    by_queue: dict[str, list[CodeSeen]] = defaultdict(list)
    for entry in seen:
        by_queue[entry.queue].append(entry)
    found: dict[str, str] = {}
    for queue, codes in by_queue.items():
        lasting = min(code.age for code in codes)  # since the newest code first ran
        if len(codes) < 2 or lasting < grace:
            continue
        found[queue] = (
            f"queue {queue}: the farms on this database run different code for it, for "
            f"{lasting:.0f}s: "
            + "; ".join(
                f"{c.fingerprint} in {c.workers} process(es) ({', '.join(c.some)})" for c in codes
            )
            + ". A deploy left half done? Finish it, or roll it back, on every farm"
        )
    return found


class CodeWatch:
    """This process's reports, and what they found; owned by its loop (`run`), `warnings`
    read by the runtime's health."""

    def __init__(
        self,
        pool: Pool,
        queries: Queries,
        specs: list[HandlerSpec],
        *,
        compare: bool,
        note: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.pool = pool
        self.queries = queries
        self.fingerprints = {spec.queue: fingerprint(spec) for spec in specs}
        # Host and pid say which process it is; the token that it is no other (see above).
        token = uuid.uuid4().hex[:8]
        self.worker = f"{socket.gethostname()} pid {os.getpid()} #{token}"
        self.compare = compare
        self.note = note
        self.found: dict[str, str] = {}  # queue: why it is a warning

    @property
    def warnings(self) -> list[str]:
        return sorted(self.found.values())

    async def once(self, grace: float = GRACE) -> None:
        """Report, and when comparing, take in what every process reports."""
        seen = await farm_code.publish(
            self.pool, self.queries, self.worker, self.fingerprints, TTL, self.note()
        )
        if not self.compare:
            return
        found = disagreements(seen, grace)
        for queue in found.keys() - self.found.keys():
            log.warning(found[queue], extra={"event": "code_disagrees", "queue": queue})
        for queue in self.found.keys() - found.keys():
            log.info(
                "queue %s: the farms on this database run one code for it again",
                queue,
                extra={"event": "code_agrees", "queue": queue},
            )
        self.found = found

    async def forget(self, task: asyncio.Task[None]) -> None:
        """At the stop: end `task` (the loop of `run`), then withdraw this process's reports,
        so that it stops counting at once, not when they expire."""
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        try:
            await farm_code.forget(self.pool, self.queries, self.worker)
        except DatabaseError as exc:
            log.debug("withdrawing the farm's code failed: %s", exc)

    async def run(self, every: float = EVERY, retry: float = RETRY) -> None:
        """Report every `every` seconds until cancelled; while the table is missing or may not
        be written, try again every `retry` seconds, said once, and once more when it works."""
        unable = False
        while True:
            try:
                await self.once()
            except PermanentError as exc:
                if not unable:
                    log.warning(
                        "the farms' code cannot be compared (%s): run `outbox-farm migrate` "
                        "(migration 0010; with --repair if it was applied and the table dropped "
                        "since), and grant this role SELECT, INSERT, UPDATE, DELETE on "
                        "outbox_farm_code; the farm runs on without it, and tries again every "
                        "%.0f s",
                        exc,
                        retry,
                        extra={"event": "code_not_compared"},
                    )
                unable = True
                self.found = {}
                await asyncio.sleep(retry)
                continue
            except DatabaseError as exc:
                log.debug("reporting the farm's code failed: %s", exc)
            else:
                if unable:
                    log.info("the farms' code is compared again", extra={"event": "code_compared"})
                unable = False
            await asyncio.sleep(every)
