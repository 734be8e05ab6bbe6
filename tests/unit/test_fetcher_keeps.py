"""What a fetcher's claims keep in the store for the next one (`Claim.keep`: on Postgres, the
connection): kept from claim to claim while NOTIFYs keep coming, and given back (`Store.rest`)
before any other wait: a claim held back by a full ledger, an operator's hold, an open breaker's
probe, paused claims, and the stop. A connection kept through a long wait is one a server's idle
timeout or a NAT may drop, and one the pool lacks meanwhile. Over the in-memory store, which
records what it was told."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from outbox_farm import Breaker, Farm, Message
from outbox_farm.errors import DatabaseError, PrivilegeError
from outbox_farm.storage import Claim
from outbox_farm.testing import MemoryStore
from outbox_farm.worker.fetcher import Fetcher
from tests.steps import eventually


class Keeping(MemoryStore):
    """Records whether something is kept (a claim with `keep` since the last `rest`) and how
    many claims came while something was kept (each one a claim that skipped the pool); runs
    `after[n]`, if any, right after the n-th claim (awaited, if it is a coroutine function).

    A fetcher looks for the next NOTIFY after a claim that came back short only once it has
    looked for stranded rows, which it does after its first short claim and every two seconds:
    so the scenarios below keep from their second short claim on."""

    def __init__(self, farm: Farm) -> None:
        super().__init__(farm)
        self.keeping = False
        self.reused = 0
        self.claims = 0
        self.after: dict[int, Callable[[], Awaitable[None] | None]] = {}

    async def claim(self, claim: Claim) -> list[Message]:
        taken = await super().claim(claim)
        self.claims += 1
        self.reused += self.keeping
        self.keeping = self.keeping or claim.keep
        then = self.after.pop(self.claims, None)
        if then is not None:
            done = then()
            if inspect.isawaitable(done):
                await done
        return taken

    async def rest(self, queue: str) -> None:
        self.keeping = False

    def next_row(self, fetcher: Fetcher) -> Callable[[], None]:
        """A hook that publishes one more row of "q" and wakes `fetcher`, as the row's NOTIFY
        would."""

        def hook() -> None:
            self.publish({"n": self.claims}, queue="q")
            fetcher.wake()

        return hook


def run(scenario: Callable[[], Any]) -> None:
    asyncio.run(scenario())


def stream(rows: int) -> tuple[Farm, Keeping, list[int]]:
    """A farm over a `Keeping` store holding one row of "q", whose handler publishes the next
    row until `rows` are handled: each NOTIFY comes within the fetcher's look after a claim.
    The ids handled, as they are."""
    farm = Farm()
    store = Keeping(farm)
    done: list[int] = []

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        done.append(msg.id)
        if len(done) < rows:
            store.publish({"n": len(done)}, queue="q")

    store.publish({"n": 0}, queue="q")
    return farm, store, done


def test_a_stream_claims_on_what_the_last_claim_kept() -> None:
    """Claims find the last one's connection kept (each one whose look saw the next NOTIFY);
    once the stream ends, the fetcher gives it back before it rests until its next poll."""
    _, store, done = stream(40)

    async def scenario() -> None:
        async with store.running(flush_interval=0.01):
            await eventually(lambda: len(done) == 40, "the stream handled")
            assert store.reused > 0
            await eventually(lambda: not store.keeping, "what was kept given back")

    run(scenario)


def test_a_fetcher_held_by_a_full_ledger_gives_back_what_it_kept() -> None:
    """Capacity 4, claims of 2, three rows claimed one at a time, each next one published (or
    a NOTIFY come) within the look: after the third, the next claim waits for slots that only
    the blocked handlers free."""
    farm = Farm()
    go = asyncio.Event()

    @farm.handler("q", concurrency=2, prefetch=2)
    async def handle(msg: Message) -> None:
        await go.wait()

    store = Keeping(farm)
    store.publish({"n": 0}, queue="q")

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = runtime.fetchers["q"]
            store.after = {1: store.next_row(fetcher), 2: store.next_row(fetcher), 3: fetcher.wake}
            try:
                await eventually(lambda: store.claims >= 3 and fetcher.starved, "a full ledger")
                await eventually(lambda: not store.keeping, "what was kept given back")
                assert store.reused > 0  # the third claim did find the second's kept
            finally:
                go.set()  # the handlers end, so the stop need not wait them out

    run(scenario)


def test_a_fetcher_held_by_an_operator_gives_back_what_it_kept() -> None:
    """The pause comes with a NOTIFY, both within the look after a claim that took rows."""
    farm = Farm()

    @farm.handler("q", concurrency=2)
    async def handle(msg: Message) -> None:
        pass

    store = Keeping(farm)
    store.publish({"n": 0}, queue="q")

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = runtime.fetchers["q"]

            def pause() -> None:
                fetcher.hold("paused by the test")
                fetcher.wake()

            store.after = {1: store.next_row(fetcher), 2: pause}
            await eventually(lambda: fetcher.held_by is not None, "the queue held")
            await eventually(lambda: not store.keeping, "what was kept given back")

    run(scenario)


def test_a_fetcher_held_by_an_open_breaker_gives_back_what_it_kept() -> None:
    """The breaker opens, and the fetcher is woken (as the controls' watcher does when it
    learns of it), within the look after a claim that took rows: the fetcher waits for the
    breaker's probe, an hour on."""
    farm = Farm()

    @farm.handler("q", concurrency=2, breaker=Breaker(probe_every=3600))
    async def handle(msg: Message) -> None:
        pass

    store = Keeping(farm)
    store.publish({"n": 0}, queue="q")

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = runtime.fetchers["q"]
            breaker = fetcher.breaker
            assert breaker is not None

            async def trip() -> None:
                await breaker.trip("the test's downstream is out of reach")
                fetcher.wake()

            store.after = {1: store.next_row(fetcher), 2: trip}
            await eventually(lambda: breaker.tripped is not None, "the breaker open")
            await eventually(lambda: not store.keeping, "what was kept given back")

    run(scenario)


def test_a_fetcher_whose_claims_are_paused_gives_back_what_it_kept() -> None:
    """The queue's acks are refused for want of a privilege, and the fetcher is woken, within
    the look after a claim that took rows: its claims are paused, and what was kept is given
    back before the probe of the refused write, which here waits for the test."""
    farm = Farm()

    @farm.handler("q", concurrency=2)
    async def handle(msg: Message) -> None:
        pass

    store = Keeping(farm)
    store.publish({"n": 0}, queue="q")
    probing = asyncio.Event()
    passes = asyncio.Event()

    async def probe() -> DatabaseError | None:
        probing.set()
        await passes.wait()
        return None  # the write passes again: claims resume

    async def scenario() -> None:
        async with store.running(flush_interval=0.01) as runtime:
            fetcher = runtime.fetchers["q"]

            def refuse() -> None:
                refused = PrivilegeError("permission denied for table outbox")
                log = logging.getLogger(__name__)
                fetcher.problems.write_refused("ack", "q", refused, probe, log, {})
                fetcher.wake()

            store.after = {1: store.next_row(fetcher), 2: refuse}
            try:
                await eventually(probing.is_set, "the probe of the refused write")
                assert not store.keeping
            finally:
                passes.set()  # the probe ends, so the stop need not wait for it

    run(scenario)


class WithoutRest:
    """A store written before `Store.rest`: every other method is the memory store's."""

    def __init__(self, inner: Keeping) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "rest":
            raise AttributeError(name)
        return getattr(self.inner, name)


def test_a_store_without_rest_is_given_no_claim_to_keep() -> None:
    farm, inner, done = stream(20)

    async def scenario() -> None:
        async with farm.running(None, store=WithoutRest(inner), flush_interval=0.01):
            await eventually(lambda: len(done) == 20, "the stream handled")

    run(scenario)
    assert inner.claims > 0
    assert inner.keeping is False  # no claim asked to keep
