"""What importing the command line costs: `outbox-farm --help`, `migrate` or `check` must not
pay for the metrics library (nor set up its multiprocess mode) before a command needs it.
Checked in a fresh interpreter, since this test process has imported everything already."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_cli_leaves_the_metrics_library_unimported() -> None:
    probe = "import sys, outbox_farm.cli; print('prometheus_client' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False", result.stdout + result.stderr
