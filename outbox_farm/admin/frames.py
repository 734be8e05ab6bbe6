"""What `outbox-farm stats` shows, one frame at a time: the queues' figures from the database
and, when the farm's /metrics is given, its rates.

A rate needs two scrapes of the farm's counters. The first frame waits until `RATE_WINDOW`
has passed since the first scrape; under `every`, each frame's second scrape is the next
frame's first, so the window is the refresh interval and nothing waits.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from ..db.connect import Connection
from ..errors import OutboxFarmError
from ..names import TableNames
from .rates import Scrape, rates, scrape
from .stats import queue_stats

RATE_WINDOW = 1.0  # seconds between the two scrapes of a one-shot `stats`


def _served(reading: Scrape) -> set[str]:
    """The queues a scrape of the farm has series for: every queue it serves, idle or not."""
    return ({queue for _, queue in reading.totals} | set(reading.buckets)) - {""}


def stats_frames(
    conn: Connection,
    names: TableNames,
    *,
    queue: str | None,
    exact_limit: int,
    metrics_url: str,
    every: float | None,
    known: Iterable[str] = (),
) -> Iterator[dict[str, Any]]:
    """One frame, or with `every`, a frame every so many seconds until the caller stops.

    A frame is `{"queues": [QueueStats...], "farm": {"url", and "window_seconds" and "queues"
    (QueueRates by queue), or "error"}}`; a farm that cannot be scraped is an error in the
    frame, not an exception. `metrics_url` empty leaves the rates out. The queues are those
    with rows, those of `known` (the app's registered queues) and those the farm serves (each
    has its series from the start), so an idle queue shows with zeros.
    """

    def read_farm() -> Scrape | str:
        try:
            return scrape(metrics_url)
        except OutboxFarmError as exc:
            return str(exc)

    before = read_farm() if metrics_url else None
    first = True
    while True:
        served = _served(before) if isinstance(before, Scrape) else set()
        queues = queue_stats(conn, names, queue, exact_limit, known={*known, *served})
        farm: dict[str, Any] = {"url": metrics_url or None}
        after: Scrape | str | None = None
        if isinstance(before, str):
            farm["error"] = before
        elif before is not None:
            if first:  # a rate needs time between its two readings
                time.sleep(max(0.0, RATE_WINDOW - (time.monotonic() - before.at)))
            after = read_farm()
            if isinstance(after, str):
                farm["error"] = after
            else:
                farm["window_seconds"] = round(after.at - before.at, 3)
                farm["queues"] = rates(before, after)
        yield {"queues": queues, "farm": farm}
        if every is None:
            return
        if metrics_url:
            before = after if isinstance(after, Scrape) else read_farm()
        first = False
        time.sleep(every)
