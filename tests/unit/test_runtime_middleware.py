"""Middleware chains, over the in-memory store: the farm's wraps the queue's own, outermost
first, around async and sync handlers; it may short-circuit, replace the exception or transform
the result; what escapes it is decided like a handler's exception, under the handler's timeout.
The store keeps the Postgres store's rules (`tests/contract/`), so this is the runtime's doing."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from outbox_farm import (
    CallNext,
    ConfigurationError,
    DeadLetter,
    Farm,
    Kind,
    Message,
    NoRetry,
    Outcome,
    Reason,
)
from outbox_farm.middleware import chain
from outbox_farm.testing import MemoryStore
from tests.steps import eventually


def dead(store: MemoryStore) -> list[tuple[int, str, str]]:
    """The DLQ as (original id, reason, the exception's repr: last_exception's first line)."""
    return [
        (d.original_id, d.failure_reason, (d.last_exception or "").split("\n")[0])
        for d in store.dead_letters
    ]


def test_middleware_runs_outermost_first_on_the_loop_around_async_and_sync_handlers() -> None:
    """The farm's middleware is outside the queue's own; each sees the message and the result
    of the rest of the chain, and may transform it. A sync handler runs in its thread, its
    middleware on the event loop."""
    seen: list[tuple[str, str, Any]] = []

    def tracer(name: str, bump: int = 0) -> Any:
        async def middleware(msg: Message, call_next: CallNext) -> Any:
            seen.append((name, "in", threading.current_thread() is threading.main_thread()))
            result = await call_next(msg)
            seen.append((name, "out", result))
            return result + bump

        return middleware

    farm = Farm(middleware=[tracer("farm-1"), tracer("farm-2")])
    aq, sq = "mw_async", "mw_sync"

    @farm.handler(aq, middleware=[tracer("own", bump=1)])
    async def handle_async(msg: Message) -> int:
        seen.append(("handler", msg.text(), threading.current_thread() is threading.main_thread()))
        return 40

    @farm.handler(sq, middleware=[tracer("own", bump=1)])
    def handle_sync(msg: Message) -> int:
        seen.append(("handler", msg.text(), threading.current_thread() is threading.main_thread()))
        return 40

    store = MemoryStore(farm)

    async def scenario(queue: str) -> None:
        async with store.running(queues=[queue]):
            store.publish(queue, queue=queue)
            await eventually(lambda: not store.rows, "the ack")

    for queue, on_loop in ((aq, True), (sq, False)):
        seen.clear()
        asyncio.run(scenario(queue))
        assert seen == [
            ("farm-1", "in", True),
            ("farm-2", "in", True),
            ("own", "in", True),
            ("handler", queue, on_loop),
            ("own", "out", 40),
            ("farm-2", "out", 41),
            ("farm-1", "out", 41),
        ], queue


def test_middleware_may_short_circuit_and_its_exceptions_are_handler_failures() -> None:
    """A middleware that does not call on acks the row unrun; one that replaces the handler's
    exception decides the row by its own; one that raises before the handler fails the row
    like a handler would (retry strategy, DLQ, on_failure hook)."""
    ran: list[bytes] = []
    hooked: list[tuple[bytes, str, Kind, Reason | None]] = []

    def hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        hooked.append((msg.body, type(exc).__name__, outcome.kind, outcome.reason))

    async def gate(msg: Message, call_next: CallNext) -> Any:
        if msg.body == b"skip":
            return None
        if msg.body == b"broken":
            raise ValueError("middleware bug")
        try:
            return await call_next(msg)
        except KeyError as exc:
            raise DeadLetter(f"unknown sku {exc}") from exc

    farm = Farm(on_failure=hook)

    @farm.handler("q", retry=NoRetry(), middleware=[gate])
    async def handle(msg: Message) -> None:
        ran.append(msg.body)
        if msg.body == b"sku":
            raise KeyError("X-1")

    store = MemoryStore(farm)
    bodies = ["skip", "broken", "sku", "ok"]
    ids = dict(zip(bodies, store.publish_batch(bodies, queue="q"), strict=True))

    async def scenario() -> None:
        async with store.running():
            await eventually(lambda: not store.rows, "every row to be done")

    asyncio.run(scenario())
    assert dead(store) == [
        (ids["broken"], "retry_terminal", repr(ValueError("middleware bug"))),
        (ids["sku"], "rejected", repr(DeadLetter("unknown sku 'X-1'"))),
    ]
    assert sorted(ran) == [b"ok", b"sku"]
    assert sorted(hooked) == [
        (b"broken", "ValueError", Kind.TERMINAL, Reason.RETRY_TERMINAL),
        (b"sku", "DeadLetter", Kind.TERMINAL, Reason.REJECTED),
    ]


def test_the_timeout_covers_the_middleware_too() -> None:
    ran: list[int] = []

    async def hang(msg: Message, call_next: CallNext) -> Any:
        await asyncio.Event().wait()  # set by nothing: the handler's timeout cancels it
        return await call_next(msg)

    farm = Farm()

    @farm.handler("q", timeout=0.2, retry=NoRetry(), middleware=[hang])
    async def handle(msg: Message) -> None:
        ran.append(msg.id)

    store = MemoryStore(farm)
    row_id = store.publish("x", queue="q")

    async def scenario() -> None:
        async with store.running():
            await eventually(lambda: store.dead_letters, "the DLQ row")

    asyncio.run(scenario())
    assert [(i, r, e.split("(")[0]) for i, r, e in dead(store)] == [
        (row_id, "retry_terminal", "HandlerTimeout")
    ]
    assert ran == []


async def _noop(msg: Message) -> None:
    return None


async def _pass(msg: Message, call_next: CallNext) -> Any:
    return await call_next(msg)


def test_middleware_must_be_a_list_of_callables() -> None:
    with pytest.raises(ConfigurationError, match="the farm's middleware must be callables"):
        Farm(middleware=[_pass, "tracing"])  # type: ignore[list-item]
    with pytest.raises(ConfigurationError, match="middleware must be a list"):
        Farm().handler("q", middleware=_pass)(_noop)  # type: ignore[arg-type]
    farm = Farm(middleware=(_pass,))
    farm.handler("q", middleware=[_pass, _pass])(_noop)
    assert farm.handlers["q"].middleware == (_pass, _pass, _pass)


def test_no_middleware_is_no_link_at_all() -> None:
    """A queue without middleware calls its handler directly: not a coroutine more per run."""
    assert chain((), _noop) is _noop
    assert chain((_pass,), _noop) is not _noop
