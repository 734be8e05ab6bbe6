"""When a slot may have a worker again after one died, and when the farm gives up.

A worker that crashed (it died, or was killed for a silent heartbeat, by the OOM killer or by
an operator, booted or not yet) is replaced at once; its slot backs off only when its workers
keep dying faster than `QUICK_CRASH` apart, so one poison message cannot make the arbiter fork
in a tight loop. Only workers that reported a boot failure no retry can fix count toward giving
up: `MAX_BOOT_FAILURES` in a row mean the farm cannot start (an app that no longer imports, bad
settings, missing schema), whatever slot they were in. A database outage is none of these: the
workers wait for it. Times are monotonic, so a step of the wall clock moves no deadline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_BOOT_FAILURES = 5
QUICK_CRASH = 1.0  # a slot whose worker dies sooner than this after the last crash backs off
MAX_DELAY = 10.0  # seconds, the longest wait before a replacement
GIVING_UP = (  # the arbiter's last line before exit status 3, with the count of failures
    "workers failed to boot %d times in a row; giving up. The log lines above say why (the app "
    "no longer imports? bad settings? schema missing: run `outbox-farm migrate`? a privilege "
    "missing: run `outbox-farm check`); fix it, then start the farm again"
)


@dataclass
class RestartBackoff:
    """The arbiter's restart bookkeeping; written and read by the arbiter thread only.

    Times are `time.monotonic()` readings, passed in by the caller.
    """

    boot_failures: int = 0  # workers in a row that could not boot (exit status 3)
    _next_spawn_at: float = 0.0  # after a boot failure: for every slot
    _crashes: dict[int, tuple[int, float]] = field(default_factory=dict)  # slot: quick ones, last
    _slot_wait: dict[int, float] = field(default_factory=dict)  # slot: no spawn before this

    @property
    def given_up(self) -> bool:
        return self.boot_failures >= MAX_BOOT_FAILURES

    def crashed(self, slot: int, now: float) -> float:
        """A worker of `slot` crashed: the seconds its replacement waits (0: none)."""
        self.boot_failures = 0
        crashes, last = self._crashes.get(slot, (0, -QUICK_CRASH))
        crashes = crashes + 1 if now - last < QUICK_CRASH else 0
        self._crashes[slot] = (crashes, now)
        delay = min(0.25 * 2.0**crashes, MAX_DELAY) if crashes else 0.0
        self._slot_wait[slot] = now + delay
        return delay

    def boot_failed(self, now: float) -> float:
        """A worker could not boot: the seconds every slot waits before the next fork."""
        self.boot_failures += 1
        delay = min(0.5 * 2.0 ** (self.boot_failures - 1), MAX_DELAY)
        self._next_spawn_at = now + delay
        return delay

    def may_spawn(self, slot: int, now: float) -> bool:
        return now >= self._next_spawn_at and now >= self._slot_wait.get(slot, 0.0)
