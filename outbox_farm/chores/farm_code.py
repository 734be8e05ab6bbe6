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

The fingerprint is the handler's qualified name and source text (its bytecode when the source
cannot be read), with the settings that decide what happens to a row: deliveries, retry
strategy, ack policy, timeout, lease, batch, transactional. Source, not bytecode: two farms on
different Python versions running the same code must agree. Only the handler's own text: a
change in a function it calls is not seen. Concurrency and prefetch are left out, as farms may
differ in them on purpose (`start --concurrency`).

With its fingerprints a process reports a note on its code when it has one: its farm's last
reload failed, so the code it runs is not the code on disk (the arbiter's error line). `doctor`
shows it.

A database without the table (migration 0010 not applied yet: deploy order must not matter),
or a role that may not write it, costs the comparison only: said once, and the reports stop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import logging
import os
import socket
from collections import defaultdict
from collections.abc import Callable

from ..db import farm_code
from ..db.farm_code import CodeSeen
from ..db.pool import Pool
from ..errors import DatabaseError, PermanentError
from ..handler import HandlerSpec
from ..queries import Queries

log = logging.getLogger("outbox_farm.farm_code")
EVERY = 10.0  # seconds between two reports of one process
TTL = 35.0  # seconds a report counts: a process that missed three is gone
GRACE = 120.0  # seconds two codes for one queue are a rolling deploy under way, not a problem


def fingerprint(spec: HandlerSpec) -> str:
    """12 hex digits that differ when the queue's handler or its row policy does (see above)."""
    func = spec.func
    code_of = func if inspect.isfunction(func) or inspect.ismethod(func) else type(func)
    name = f"{getattr(code_of, '__module__', '')}.{getattr(code_of, '__qualname__', '')}"
    try:
        code = inspect.getsource(code_of)
    except (OSError, TypeError):
        code = getattr(getattr(code_of, "__code__", None), "co_code", b"").hex()
    retry = spec.retry
    # A strategy of the user's without a repr of its values would differ in every process.
    retry_text = repr(retry) if dataclasses.is_dataclass(retry) else type(retry).__qualname__
    policy = (spec.max_deliveries, retry_text, spec.ack, spec.timeout, spec.lease_ttl)
    text = "\0".join((name, code, repr((*policy, spec.batch, spec.transactional))))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


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
        self.worker = f"{socket.gethostname()} pid {os.getpid()}"
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

    async def run(self, every: float = EVERY) -> None:
        """Report every `every` seconds until cancelled; stop for good, said once, when the
        table is missing or may not be written."""
        while True:
            try:
                await self.once()
            except PermanentError as exc:
                log.warning(
                    "the farms' code cannot be compared (%s): run `outbox-farm migrate` "
                    "(migration 0010), and grant this role SELECT, INSERT, UPDATE, DELETE on "
                    "outbox_farm_code; the farm runs on without it",
                    exc,
                    extra={"event": "code_not_compared"},
                )
                self.found = {}
                return
            except DatabaseError as exc:
                log.debug("reporting the farm's code failed: %s", exc)
            await asyncio.sleep(every)
