"""A stop step is bounded whatever its parts do: one that fails is logged and the others still
end; one still running at its time is cancelled, again while it shrugs that off, and left
behind once `CANCEL_GRACE` has passed, so the stop goes on without it."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from outbox_farm.worker.runtime import stop_steps
from outbox_farm.worker.runtime.stop_steps import step


def events(caplog: pytest.LogCaptureFixture) -> list[tuple[str, object]]:
    return [(r.name, getattr(r, "event", None)) for r in caplog.records]


def test_a_part_that_fails_is_logged_and_the_others_end(caplog: pytest.LogCaptureFixture) -> None:
    ended = asyncio.Event()

    async def fails() -> None:
        raise ValueError("broken")

    async def ends() -> None:
        ended.set()

    asyncio.run(step("both", None, fails(), ends()))
    assert ended.is_set()
    [record] = caplog.records
    assert (record.name, getattr(record, "event", None)) == ("outbox_farm.runtime", "stop_failed")
    assert record.exc_info is not None
    assert isinstance(record.exc_info[1], ValueError)


def test_a_part_past_its_time_is_cancelled_until_it_ends(caplog: pytest.LogCaptureFixture) -> None:
    cancelled = 0

    async def shrugs_once() -> None:
        nonlocal cancelled
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled += 1  # caught: the step cancels it again
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled += 1
            raise

    asyncio.run(step("slow", time.monotonic(), shrugs_once()))
    assert cancelled == 2
    assert events(caplog) == [("outbox_farm.runtime", "stop_overrun")]


def test_a_part_that_never_ends_is_left_behind(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="outbox_farm.runtime")

    async def scenario() -> None:
        stubborn = True
        left: list[asyncio.Task[object]] = []

        async def refuses() -> None:
            task = asyncio.current_task()
            assert task is not None
            left.append(task)
            while True:
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    if not stubborn:
                        raise

        started = time.monotonic()
        await step("stuck", started, refuses())
        assert time.monotonic() - started >= stop_steps.CANCEL_GRACE
        [task] = left
        assert not task.done()
        stubborn = False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert events(caplog) == [
        ("outbox_farm.runtime", "stop_overrun"),
        ("outbox_farm.runtime", "stop_abandoned"),
    ]
