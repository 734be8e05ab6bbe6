"""The test kit decides as production does: the same handlers, through the recorder (no
database) and through a real runtime on Postgres (`drain`), give the same verdict for every
message: the same status, DLQ reason and exception type, attempt after attempt."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox_farm import ConstantBackoff, DeadLetter, Farm, Message
from outbox_farm.testing import drain, record

Verdicts = list[tuple[str, int, str, str | None, str | None]]


def make_farm() -> Farm:
    """Handlers of every kind of ending: async and plain, returned, raised, a DeadLetter, a
    timeout (async and plain), a BaseException, and a middleware that rewrites an error."""
    farm = Farm(dlq_table="outbox_dlq")
    retry = ConstantBackoff(1.0, max_attempts=2)

    @farm.handler("async_ok", retry=retry)
    async def async_ok(msg: Message) -> None:
        return None

    @farm.handler("sync_raises", retry=retry)
    def sync_raises(msg: Message) -> None:
        raise ValueError(f"bad {msg.body!r}")

    @farm.handler("dead", retry=retry)
    async def dead(msg: Message) -> None:
        raise DeadLetter("never")

    @farm.handler("slow_async", retry=retry, timeout=0.05)
    async def slow_async(msg: Message) -> None:
        await asyncio.sleep(5)  # past its timeout, which cancels it

    @farm.handler("slow_sync", retry=retry, timeout=0.05)
    def slow_sync(msg: Message) -> None:
        time.sleep(0.5)  # past its timeout: a sync handler cannot be cancelled, only abandoned

    @farm.handler("interrupt", retry=retry)
    async def interrupt(msg: Message) -> None:
        raise KeyboardInterrupt

    async def rewrite(msg: Message, call_next: Callable[[Message], Any]) -> Any:
        try:
            return await call_next(msg)
        except ValueError as exc:
            raise DeadLetter(f"rewritten: {exc}") from exc

    @farm.handler("rewritten", retry=retry, middleware=[rewrite])
    def rewritten(msg: Message) -> None:
        raise ValueError("x")

    return farm


QUEUES = (
    "async_ok",
    "sync_raises",
    "dead",
    "slow_async",
    "slow_sync",
    "interrupt",
    "rewritten",
)


def publish_to_every_queue(farm: Farm, conn: Any) -> None:
    """One row for each queue, through the farm's own call: the recorder (no connection) keeps
    it in memory, the database gets it on `conn`."""
    for queue in QUEUES:
        farm.publish(conn, {"q": queue}, queue=queue)


def verdicts(runs: list[Any]) -> Verdicts:
    out = [
        (
            r.queue,
            r.message.deliveries_count,
            r.status.value if hasattr(r.status, "value") else str(r.status),
            r.reason.value if r.reason is not None else None,
            type(r.error).__name__ if r.error is not None else None,
        )
        for r in runs
    ]
    return sorted(out)


def test_the_recorder_and_the_runtime_give_the_same_verdicts(dsn: str) -> None:
    farm = make_farm()
    with record(farm) as recorder:
        publish_to_every_queue(farm, None)
        recorded = verdicts(recorder.run(within=60).runs)
    farm = make_farm()
    with psycopg.connect(dsn) as conn:
        publish_to_every_queue(farm, conn)
    real = verdicts(drain(farm, dsn, within=60).runs)
    assert real == recorded
    assert {v[0] for v in real} == set(QUEUES)
    assert ("slow_sync", 1, "retried", None, "HandlerTimeout") in real
    assert any(v[0] == "interrupt" and v[4] == "KeyboardInterrupt" for v in real)
