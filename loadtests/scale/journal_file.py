"""The journal file of one farm process: where the scale apps note every run they end, on the
host's disk rather than in a database a partition could cut off (see `scaleapp`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import IO

# pid -> this process's journal, opened on its first run (after the fork: never shared).
_journals: dict[int, IO[str]] = {}


def journal(directory: str, host: str) -> IO[str] | None:
    """This process's journal in `directory`, named for `host` and the pid, opened on first
    use and written a line at a time; None when `directory` is empty (no journal kept)."""
    if not directory:
        return None
    pid = os.getpid()
    if pid not in _journals:
        path = Path(directory) / f"{host}-{pid}.tsv"
        _journals[pid] = path.open("a", buffering=1, encoding="utf-8")
    return _journals[pid]
