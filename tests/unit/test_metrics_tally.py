"""The per-message histograms are tallied in the process and flushed in one go: what a scrape
reads afterwards must be what observing each value on its own would have given."""

from __future__ import annotations

import asyncio
import math

import pytest
from prometheus_client import CollectorRegistry, Histogram

from outbox_farm.metrics import LATENCY_BUCKETS, metrics
from outbox_farm.observe.prometheus import FLUSH_EVERY, PrometheusObserver, Tally
from tests.steps import eventually

VALUES = [
    0.0,
    0.0005,  # on a bound: that bucket, as `amount <= bound`
    0.00050001,
    0.003,
    1.0,
    299.9,
    300.0,
    300.1,  # past the last bound: +Inf only
    -1.0,
    math.inf,
    -math.inf,
    math.nan,  # the sum only, no bucket
    *[i / 997 for i in range(500)],
]


def samples(histogram: Histogram) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels.get("le", "")): s.value
        for metric in histogram.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or math.isclose(a, b, rel_tol=1e-9)


def test_a_flushed_tally_reads_as_the_values_observed_one_by_one() -> None:
    registry = CollectorRegistry()
    direct = Histogram("direct", "d", buckets=LATENCY_BUCKETS, registry=registry)
    tallied = Histogram("tallied", "t", buckets=LATENCY_BUCKETS, registry=registry)
    tally = Tally(tallied)
    for value in VALUES:
        direct.observe(value)
        tally.values.append(value)  # as the observer's events add a value
    assert samples(tallied)[("tallied_count", "")] == 0  # nothing until the flush
    tally.flush()
    assert tally.values == []
    want = {(name.replace("direct", "tallied"), le): v for (name, le), v in samples(direct).items()}
    got = samples(tallied)
    assert got.keys() == want.keys()
    assert all(same(got[k], want[k]) for k in want), (got, want)
    tally.flush()  # a second flush adds nothing
    assert all(same(samples(tallied)[k], want[k]) for k in want)


def test_without_a_nan_every_value_still_reaches_its_bucket() -> None:
    """The NaN filter runs only when the sum says there is one; infinities of one sign alone
    leave the sum infinite, not NaN, and must still land in their buckets."""
    registry = CollectorRegistry()
    direct = Histogram("direct2", "d", buckets=LATENCY_BUCKETS, registry=registry)
    tallied = Histogram("tallied2", "t", buckets=LATENCY_BUCKETS, registry=registry)
    tally = Tally(tallied)
    for value in [math.inf, 0.002, 0.0, 7.0, math.inf, 0.0005]:
        direct.observe(value)
        tally.values.append(value)
    tally.flush()
    want = {(n.replace("direct2", "tallied2"), le): v for (n, le), v in samples(direct).items()}
    assert samples(tallied) == want


def handler_count(queue: str) -> float:
    """outbox_farm_handler_seconds_count of `queue`, as a scrape would read it."""
    metrics().handler_seconds.labels(queue)
    return next(
        s.value
        for m in metrics().handler_seconds.collect()
        for s in m.samples
        if s.name.endswith("_count") and s.labels["queue"] == queue
    )


def test_the_observer_flushes_within_its_interval_and_at_the_stop() -> None:
    def count() -> float:
        return handler_count("tally-q")

    before = count()

    async def scenario() -> None:
        observer = PrometheusObserver()
        observer.handler_finished("tally-q", 0.01)
        observer.handler_finished("tally-q", 0.02)
        assert count() == before  # tallied, not yet written
        await eventually(lambda: count() == before + 2, "the flush", FLUSH_EVERY * 40)
        observer.handler_finished("tally-q", 0.03)
        observer.stopped()  # the stop writes what is left at once
        assert count() == before + 3

    asyncio.run(scenario())


def test_outside_an_event_loop_an_observation_is_written_at_once() -> None:
    observer = PrometheusObserver()
    before = handler_count("tally-sync")
    observer.handler_finished("tally-sync", 0.5)
    assert handler_count("tally-sync") == before + 1


def test_a_flush_that_fails_keeps_the_tallies_it_did_not_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tally registers for a flush only as its first value comes: one a failed flush dropped
    while it still held values would never be flushed again, and grow for ever."""

    async def scenario() -> None:
        observer = PrometheusObserver()
        observer.handler_finished("tally-fail-a", 0.01)
        observer.handler_finished("tally-fail-b", 0.02)
        first, second = observer._dirty
        flush = Tally.flush

        def failing(self: Tally) -> None:
            if self is first:
                raise RuntimeError("injected")
            flush(self)

        monkeypatch.setattr(Tally, "flush", failing)
        before = handler_count("tally-fail-b")
        with pytest.raises(RuntimeError, match="injected"):
            observer.flush()
        assert observer._dirty == [second]
        assert second.values == [0.02]
        monkeypatch.setattr(Tally, "flush", flush)
        observer.flush()
        assert handler_count("tally-fail-b") == before + 1

    asyncio.run(scenario())
