"""`start --reload`: notice that the app's source files changed, so the arbiter replaces its
workers (development only).

Polled from the arbiter's main loop, about once a second: no thread, no inotify, nothing the
arbiter would hold across a fork.
"""

from __future__ import annotations

from pathlib import Path

from .app import AppLoader

SHOWN = 3  # changed files named in the log line


class SourceWatcher:
    """The mtimes of the app's `.py` files at the last look; owned by the arbiter thread."""

    def __init__(self, loader: AppLoader) -> None:
        self.loader = loader
        self.seen: dict[Path, float] = loader.sources()

    def changes(self) -> str | None:
        """The files added, removed or modified since the last call, for a log line; None when
        nothing changed."""
        now = self.loader.sources()
        if now == self.seen:
            return None
        changed = sorted(str(p) for p in set(now) ^ set(self.seen)) or sorted(
            str(p) for p in now if now[p] != self.seen.get(p)
        )
        self.seen = now
        return ", ".join(changed[:SHOWN]) + (" ..." if len(changed) > SHOWN else "")
