"""The runtime's events, and the fan-out that hands each to every observer plugged in.

The fetcher, executors, ledger and completer report what happened through these methods and
nothing else: they neither count metrics nor log these events themselves. Prometheus metrics
and structured logs are the two observers every runtime has; a user's observer (tracing, an
audit trail, a test's recorder) is a third, passed to `farm.running(..., observers=[...])`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from ..decision import Notes
from ..message import Message
from ..outcome import Outcome

log = logging.getLogger("outbox_farm.observe")


class Observer:
    """Every event, as a method that does nothing: subclass and override the ones you need.

    Methods run on the event loop, inline with the work they report: keep them quick, and do
    not block. What one raises is logged once and otherwise ignored; it never changes a row.
    """

    # Events whose method catches and reports its own errors (`report_failure`), so that the
    # fan-out may call it directly: the built-in metrics observer's per-message events, where
    # one call more per message shows in the farm's throughput.
    _guarded: ClassVar[frozenset[str]] = frozenset()

    def serving(self, queues: list[str]) -> None:
        """The runtime starts on `queues`, before its first claim."""

    def claimed(self, queue: str, rows: int, seconds: float) -> None:
        """A claim statement of `queue` returned `rows` rows after `seconds`."""

    def held(self, queue: str, delta: int) -> None:
        """The rows of `queue` this process holds grew (or, negative, shrank) by `delta`."""

    def handler_started(self, msg: Message, lag: float) -> None:
        """The handler starts on `msg`, `lag` seconds after the row was due."""

    def handler_finished(self, queue: str, seconds: float) -> None:
        """A handler call of `queue` (a whole batch, for a batch handler) took `seconds`."""

    def decided(self, msg: Message, outcome: Outcome) -> None:
        """The verdict on `msg`: what will be written."""

    def noted(self, msg: Message, notes: Notes) -> None:
        """What explains a verdict that is not a plain success (a retry, a DLQ move, a row
        handed back unrun): called after `decided`, only when there is something to say."""

    def lease_lost(self, phase: str, queue: str, row_id: int, deliveries: int | None) -> None:
        """Another token holds the row (found by the heartbeat, or by a write in `phase`)."""

    def written(self, phase: str, queue: str, rows: int) -> None:
        """A flush's statement of `phase` (ack, retry, release, expire, terminal) changed
        `rows` rows of `queue`."""

    def dead_lettered(self, outcome: Outcome) -> None:
        """The row of `outcome` was moved to the DLQ."""

    def outcome_unconfirmed(self, phase: str, outcome: Outcome) -> None:
        """A write sent again after a lost connection found its row gone or free."""

    def write_failed(self, kind: str, queue: str, rows: int) -> None:
        """`rows` outcomes of `kind` were given up on unwritten (the rows come back later)."""

    def flushed(self, seconds: float, size: int) -> None:
        """The completer wrote a batch of `size` outcomes in `seconds`."""

    def claim_failed(self, queue: str, kind: str) -> None:
        """A claim of `queue` failed: `kind` is connection_lost, permanent, refused (any other
        database error) or internal (an error of outbox_farm itself)."""

    def stalled(self, queue: str, reason: str | None) -> None:
        """`queue` stalled (its claims keep failing, or a ready row ages while the farm is
        idle), `reason` saying why; None: it flows again."""

    def relay_sent(self, target: str, rows: int, seconds: float) -> None:
        """A relay sent a batch of `rows` messages to `target`; its last confirm came
        `seconds` after the first send."""

    def relay_settled(self, target: str, outcome: str, rows: int) -> None:
        """`rows` messages of a batch to `target` ended as `outcome` (confirmed, nacked,
        returned or unconfirmed)."""

    def relay_connection(self, target: str, up: bool) -> None:
        """The relay to `target` connected (`up`) or lost its broker."""

    def stopped(self) -> None:
        """The runtime stopped: nothing more is reported. An observer that buffers what it
        was told (the metrics one does, for a moment) writes it out here."""


_EVENTS = [name for name in vars(Observer) if not name.startswith("_")]


class Observers(Observer):
    """Several observers as one. Each event calls only the observers that override it, so an
    event nobody watches costs one call of an empty loop."""

    def __init__(self, observers: Iterable[Observer]) -> None:
        self.observers = list(observers)
        for observer in self.observers:
            if not isinstance(observer, Observer):
                raise TypeError(f"observers must subclass outbox_farm.Observer, got {observer!r}")
        self._failed: set[tuple[int, str]] = set()
        for event in _EVENTS:
            setattr(self, event, self._fan_out(event))

    def _fan_out(self, event: str) -> Callable[..., None]:
        """Every observer is guarded, the built-in ones too: a bug in the metrics observer must
        not end the executor task that reported a verdict. The guard costs nothing until
        something raises (a `try` is free in Python 3.11+)."""
        base = getattr(Observer, event)
        calls = [
            (observer, getattr(observer, event))
            for observer in self.observers
            if getattr(type(observer), event) is not base
        ]
        if not calls:
            return getattr(super(), event)  # type: ignore[no-any-return]
        if len(calls) == 1:
            observer, call = calls[0]
            if event in observer._guarded:
                return call  # type: ignore[no-any-return]

            def one(*args: Any) -> None:
                try:
                    call(*args)
                except Exception:
                    self._report(observer, event)

            return one

        def fan_out(*args: Any) -> None:
            for observer, call in calls:
                try:
                    call(*args)
                except Exception:
                    self._report(observer, event)

        return fan_out

    def _report(self, observer: Observer, event: str) -> None:
        report_failure(observer, event, self._failed)


def report_failure(observer: Observer, event: str, reported: set[tuple[int, str]]) -> None:
    """Log (with the traceback being handled) that `observer` raised on `event`, the first
    time only: `reported` remembers which failures were logged."""
    key = (id(observer), event)
    if key not in reported:
        reported.add(key)
        log.exception(
            "observer %r failed on %s; its later failures on it are not logged",
            observer,
            event,
            extra={"event": "observer_failed"},
        )
