"""A real `outbox-farm start` whose arbiter hits a bug of its own: it stops every worker, closes
/metrics and exits with status 4, leaving no process behind.

The bug is injected from outside the product: the farm is started by a launcher that imports
outbox_farm, replaces one step of the arbiter's loop (`_manage`) with one that raises once a
file the test creates exists, and then runs the command line's own `main`.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import psutil
import pytest

from tests.acceptance import test_farm
from tests.acceptance.test_farm import FARMAPP, farm_process
from tests.steps import wait_for

pytestmark = pytest.mark.slow

LAUNCHER = """\
#!{python}
import os
import sys
from pathlib import Path

from outbox_farm.cli import main
from outbox_farm.prefork.arbiter import Arbiter

manage = Arbiter._manage
fault = Path(os.environ["FAULT_AT"])


def faulty(self):
    if fault.exists():
        raise RuntimeError("injected fault in the arbiter's loop")
    manage(self)


Arbiter._manage = faulty
sys.exit(main())
"""


@pytest.fixture
def launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The app, and the launcher standing in for the `outbox-farm` script in `farm_process`;
    the fault fires once the returned path exists."""
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    script = tmp_path / "faulty-outbox-farm"
    script.write_text(LAUNCHER.format(python=sys.executable))
    script.chmod(0o755)
    monkeypatch.setattr(test_farm, "CLI", script)
    return tmp_path / "fault"


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (a zombie is not: it only waits for its parent)."""
    running = set()
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.add(pid)
    return running


def test_an_error_in_the_arbiters_loop_stops_every_worker_and_exits_4(
    launcher: Path, dsn: str
) -> None:
    with farm_process(launcher.parent, dsn, FAULT_AT=str(launcher)) as farm:
        # Positive control: the patched loop supervises as usual until the fault.
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 60, farm)
        workers = farm.children()
        assert len(workers) == 2
        family = {p.pid for p in psutil.Process(farm.pid).children(recursive=True)}
        assert workers < family  # the /metrics server too
        launcher.touch()
        code = farm.proc.wait(timeout=30)
        log = farm.log()
        assert code == 4, farm.log_tail()
        assert "event=arbiter_failed" in log
        assert "RuntimeError: injected fault in the arbiter's loop" in log  # the traceback
        assert "event=arbiter_stopped" in log
        assert wait_for(lambda: not alive(family), "no process of the farm left", 10) is True
        assert farm.get("/healthz") is None
