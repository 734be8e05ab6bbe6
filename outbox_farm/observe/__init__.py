"""Observers: what the runtime reports, and the two observers every runtime has (Prometheus
metrics and structured logs). See `base.Observer` for the events."""

from __future__ import annotations

from collections.abc import Iterable

from .base import Observer, Observers
from .logs import LogObserver
from .prometheus import PrometheusObserver


def observers(extra: Iterable[Observer] = ()) -> Observers:
    """The runtime's observer: metrics and logs, then the user's `extra` ones."""
    return Observers([PrometheusObserver(), LogObserver(), *extra])


__all__ = ["LogObserver", "Observer", "Observers", "PrometheusObserver", "observers"]
