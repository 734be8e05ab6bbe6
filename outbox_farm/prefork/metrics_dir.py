"""The directory of the farm's own where every process writes its metric files.

prometheus_client's multiprocess mode reads PROMETHEUS_MULTIPROC_DIR when it is first
imported, so this runs in the arbiter before anything imports it, and the arbiter's children
inherit the setting. The files of an earlier run must go (their counters would be summed into
this run's), so the farm empties the directory at every start; it therefore only takes a
directory that is new, empty, or one it marked itself holding nothing but metric files. A web
app's metrics directory is refused, never wiped.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
from pathlib import Path

from ..errors import ConfigurationError

MARKER = ".outbox-farm-metrics"
# The files prometheus_client's multiprocess mode writes: <type>_<pid>.db.
_METRIC_FILE = re.compile(r"^(counter|histogram|summary|gauge_[a-z]+)_\d+\.db$")


def prepare_metrics_dir(path: str | None) -> str:
    """Point PROMETHEUS_MULTIPROC_DIR at `path`, emptied of the metric files of earlier runs;
    with no `path`, at a new temporary directory, removed again when this process exits.

    ConfigurationError when `path` holds files the farm did not write, or cannot be used.
    """
    if path is None:
        path = _temporary()
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        entries = sorted(entry.name for entry in folder.iterdir())
        foreign = [name for name in entries if name != MARKER and not _METRIC_FILE.match(name)]
        if entries and (MARKER not in entries or foreign):
            shown = ", ".join((foreign or entries)[:5])
            raise ConfigurationError(
                f"{folder} holds files outbox-farm did not write ({shown}); the farm empties "
                "its metrics directory at every start, so give it one of its own (new or "
                "empty), or leave the option out for a temporary one"
            )
        (folder / MARKER).write_text("outbox-farm metrics; emptied at every start\n")
        for name in entries:
            if _METRIC_FILE.match(name):
                (folder / name).unlink()
    except OSError as exc:
        raise ConfigurationError(f"cannot use {folder}: {exc}") from None
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    return str(folder)


def _temporary() -> str:
    made, owner = tempfile.mkdtemp(prefix="outbox-farm-metrics-"), os.getpid()

    def remove() -> None:
        if os.getpid() == owner:  # never from a forked worker
            shutil.rmtree(made, ignore_errors=True)

    atexit.register(remove)
    return made
