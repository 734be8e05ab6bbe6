"""The fan-out of observers: every observer hears every event it overrides, in order; one that
raises is logged once per event and does not stop the others."""

from __future__ import annotations

import logging

import pytest

from outbox_farm.observe import Observer, Observers


class Tally(Observer):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def written(self, phase: str, queue: str, rows: int) -> None:
        self.log.append(f"{self.name}:{phase}:{queue}:{rows}")


class Faulty(Observer):
    def written(self, phase: str, queue: str, rows: int) -> None:
        raise ValueError("bug in an observer")


def test_every_observer_hears_the_event_in_order() -> None:
    heard: list[str] = []
    fan = Observers([Tally("a", heard), Observer(), Tally("b", heard)])
    fan.written("ack", "q", 3)
    assert heard == ["a:ack:q:3", "b:ack:q:3"]


def test_an_event_nobody_overrides_is_the_base_no_op() -> None:
    """No fan-out is built for it: the call is the base class's empty method itself."""
    heard: list[str] = []
    fan = Observers([Tally("a", heard)])
    assert fan.flushed.__func__ is Observer.flushed  # type: ignore[attr-defined]
    assert fan.flushed(0.1, 10) is None
    assert heard == []
    # Positive control: the event Tally overrides is fanned out to it.
    assert getattr(fan.written, "__func__", None) is not Observer.written
    fan.written("ack", "q", 1)
    assert heard == ["a:ack:q:1"]


def test_a_raising_observer_is_logged_once_and_the_others_still_hear(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[str] = []
    fan = Observers([Faulty(), Tally("after", heard)])
    with caplog.at_level(logging.ERROR, logger="outbox_farm.observe"):
        for _ in range(3):
            fan.written("retry", "q", 1)
    assert heard == ["after:retry:q:1"] * 3
    assert [r.event for r in caplog.records] == ["observer_failed"]  # type: ignore[attr-defined]


def test_only_observers_are_accepted() -> None:
    with pytest.raises(TypeError, match=r"subclass outbox_farm\.Observer"):
        Observers([object()])  # type: ignore[list-item]
