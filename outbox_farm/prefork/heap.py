"""A worker's heap after boot, moved out of the cyclic collector's sight.

What a worker holds once its runtime has started (the modules, the app and its handlers, the
pool, the runtime's own parts) lives as long as the process, yet every full collection walks
all of it: with outbox_farm's own objects alone, 47,000 of them and a 13-24 ms stop of the
event loop (more with a large app), during which no handler starts and every message waiting
on a claim waits longer: a spike in the latency tail that `python -m loadtests.bench.tail`
shows. `gc.freeze()` moves what exists at that moment into a permanent generation that no
collection visits; a full collection then takes under 0.1 ms. What the worker allocates later
is collected as before, so garbage made while serving is still freed. One full collection
comes first, so that no garbage of the boot is frozen with the rest, for good.
"""

from __future__ import annotations

import gc


def freeze_boot_heap() -> int:
    """Collect once, then freeze everything still alive; how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
