"""The harness's one wait: a condition asked until it holds, for a bounded time, given up
early when the process that was to make it hold has exited.

The load test, the chaos and scale suites, their farms and brokers all wait this way: a
wait that gives up says so (False) and its caller says what did not happen, so that no
run hangs and none reads a timeout as a success.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any


def wait_until(
    condition: Callable[[], object],
    timeout: float,
    *,
    every: float = 0.2,
    watch: subprocess.Popen[Any] | None = None,
) -> bool:
    """Whether `condition()` came true within `timeout` seconds, asked every `every` s and once
    more at the deadline (one that came true as time ran out is not missed). With `watch`,
    False as soon as that process has exited: what it was to do will not happen."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if watch is not None and watch.poll() is not None:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(every, left))
