"""The two steps nearly every test takes, written once: put rows in the outbox (`publish`), and
wait for what becomes of them (`eventually` in a coroutine, `wait_for` in plain code, `poll`
where a test notes a failed wait and goes on, `run_until` to run a farm until a condition,
`Claims` for a fetcher's next look).

One module for both, so that a test reads as its scenario and a wait means the same thing
everywhere: a condition polled until a generous deadline, never a fixed sleep guessing how long
the condition takes. It is named for the steps it holds, not `helpers`: reading this process's
metrics (`tests.samples`) and finding system packages (`tests.tools`) are other concerns and
keep modules of their own.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, Unpack

import psycopg
import pytest

from outbox_farm import Farm, Observer
from outbox_farm.producer import BatchOptions
from outbox_farm.settings import RuntimeSettings

T = TypeVar("T")
PRODUCER = Farm()  # the tables of every test database: outbox and outbox_dlq


def publish(
    where: str | psycopg.Connection[Any],
    bodies: Sequence[object] | int,
    **options: Unpack[BatchOptions],
) -> list[int]:
    """Publish `bodies` through the producer API, as an application does (one `publish_batch`:
    one statement, one NOTIFY); their ids, in order.

    `where` is a DSN, on which the rows are committed before this returns, or the caller's
    connection, whose transaction they join. `bodies` may be a count, for a test that only
    needs rows: that many numbered byte bodies (b"0", b"1", ...)."""
    payloads = [b"%d" % n for n in range(bodies)] if isinstance(bodies, int) else bodies
    if isinstance(where, str):
        with psycopg.connect(where) as conn:
            return PRODUCER.publish_batch(conn, payloads, **options)
    return PRODUCER.publish_batch(where, payloads, **options)


async def eventually(check: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `check` (sync, or returning an awaitable) until it returns something truthy, which
    is returned; fail at the deadline naming `what`. The deadline is generous on purpose: it
    only matters when the condition never comes, and a busy machine must not fail a test that
    would pass on an idle one."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last {result!r})")
        await asyncio.sleep(0.02)


def run_until(
    farm: Farm,
    dsn: str,
    condition: Callable[[], Any],
    what: str,
    settings: RuntimeSettings | None = None,
    timeout: float = 30.0,
) -> Any:
    """Run `farm` on `dsn` until `condition` (as `eventually` takes it) holds, then stop it; the
    condition's result. Leaving `running` is the graceful stop: running handlers finish and the
    completer's last flush writes every outcome, so what the test reads next sees them all."""

    async def run() -> Any:
        async with farm.running(dsn, settings):
            return await eventually(condition, what, timeout)

    return asyncio.run(run())


class Watched(Protocol):
    """A subprocess a wait gives up on as soon as it exits (a farm, a console), showing the end
    of its log."""

    proc: subprocess.Popen[bytes]

    def log_tail(self) -> str: ...


def wait_for(
    condition: Callable[[], T],
    what: str,
    timeout: float = 30.0,
    process: Watched | None = None,
    every: float = 0.1,
) -> T:
    """`eventually` for code without an event loop (a test driving subprocesses): poll
    `condition` every `every` seconds until it returns something truthy (returned); fail at the
    deadline, or at once when `process` exited meanwhile."""
    last = poll(condition, timeout, every, process)
    if last:
        return last
    tail = process.log_tail() if process is not None else ""
    if process is not None and process.proc.poll() is not None:
        pytest.fail(f"exited ({process.proc.returncode}) while waiting for {what}\n{tail}")
    pytest.fail(f"no {what} within {timeout}s (last: {last!r})\n{tail}")


def poll(
    condition: Callable[[], T],
    timeout: float,
    every: float = 0.1,
    process: Watched | None = None,
) -> T:
    """The loop under `wait_for`, for a test that notes a wait that came to nothing and goes on
    (to report every problem at the end): `condition`'s first truthy result, or its last falsy
    one once `timeout` seconds passed or `process` exited."""
    deadline = time.monotonic() + timeout
    while True:
        last = condition()
        if last or time.monotonic() > deadline:
            return last
        if process is not None and process.proc.poll() is not None:
            return last
        time.sleep(every)


class Claims(Observer):
    """When each of the fetchers' claims began (monotonic), empty ones too: a test that needs a
    fetcher to have looked, and gone back to rest, waits for a claim begun after some moment
    rather than sleeping and hoping it did."""

    def __init__(self) -> None:
        self.begun: list[float] = []

    def claimed(self, queue: str, rows: int, seconds: float) -> None:
        self.begun.append(time.monotonic() - seconds)

    def since(self, moment: float) -> int:
        """How many claims began at or after `moment` and have ended."""
        return sum(begun >= moment for begun in self.begun)
