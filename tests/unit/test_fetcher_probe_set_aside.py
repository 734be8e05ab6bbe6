"""A breaker's probe that claims a row no client can load, on a farm without a DLQ, sets it
aside; when the store fails to, the fetcher backs off and says so as after any failed claim,
and probes again: it does not end (for its supervisor to restart). The row stays claimed under
its lease meanwhile. Over the in-memory store, whose set-aside here always fails as the
Postgres store's does when its connection breaks."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace

import pytest

from outbox_farm import Breaker, Farm, Message
from outbox_farm.errors import ConnectionLost, DatabaseError, PrivilegeError
from outbox_farm.storage import Claim
from outbox_farm.testing.memory import MemoryStore
from outbox_farm.worker.fetcher import Fetcher
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually


class Unloadable(MemoryStore):
    """Every row claimed is one no client could load (`Message.invalid`), and setting rows
    aside fails with `refusal` while one is set; counts the tries."""

    def __init__(self, farm: Farm) -> None:
        super().__init__(farm)
        self.set_aside_tries = 0
        self.refusal: DatabaseError | None = None

    async def claim(self, claim: Claim) -> list[Message]:
        taken = await super().claim(claim)
        return [replace(msg, invalid="payload is not valid JSON") for msg in taken]

    async def set_aside(self, ids: list[int], token: uuid.UUID, seconds: float) -> list[int]:
        self.set_aside_tries += 1
        if self.refusal is not None:
            raise self.refusal
        return await super().set_aside(ids, token, seconds)


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == event]


def probing(refusal: DatabaseError) -> Unloadable:
    """A store whose farm has no DLQ and one queue with a breaker probing every 50 ms, its
    set-aside refused with `refusal`."""
    farm = Farm(dlq_table=None)

    @farm.handler("q", breaker=Breaker(failures=1, probe_every=0.05))
    async def handle(msg: Message) -> None:
        pass

    store = Unloadable(farm)
    store.refusal = refusal
    return store


async def tripped_with_rows(store: Unloadable, runtime: Runtime) -> Fetcher:
    """The queue's breaker opened, three rows published: its fetcher, probing them."""
    fetcher = runtime.fetchers["q"]
    assert fetcher.breaker is not None
    await fetcher.breaker.trip("the test's downstream is out of reach")
    for n in range(3):
        store.publish({"n": n}, queue="q")
    return fetcher


def test_a_probe_whose_row_cannot_be_set_aside_backs_off_and_probes_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, "outbox_farm")
    store = probing(ConnectionLost("server closed the connection unexpectedly"))

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = await tripped_with_rows(store, runtime)
            await eventually(lambda: store.set_aside_tries >= 2, "a second probe's set-aside")
            assert events(caplog, "task_failed") == []
            assert events(caplog, "db_reconnect")  # the claim's warning, with its backoff
            assert fetcher.alive

    asyncio.run(scenario())


def test_a_probe_set_aside_refused_is_the_runtimes_problem_until_one_goes_through() -> None:
    """No other claim runs while the breaker is open: the probe's own claim, when its set-aside
    goes through, is what says the claims' problem is over."""
    store = probing(PrivilegeError("permission denied for table outbox"))

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = await tripped_with_rows(store, runtime)
            await eventually(lambda: runtime.problems.current is not None, "the problem")
            assert "permission denied" in (runtime.problems.current or "")
            store.refusal = None
            await eventually(lambda: runtime.problems.current is None, "the problem over")
            assert fetcher.breaker is not None
            assert fetcher.breaker.tripped is not None  # still open: only its probe claimed

    asyncio.run(scenario())
