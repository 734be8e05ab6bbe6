"""The multi-host harness's smoke run (`python -m loadtests.scale --smoke`): farm hosts in
network namespaces, one of them cut off from the database while it holds rows, then healed.

It must find nothing lost, every duplicate explained, the cut-off host's late acks refused by
the lease token, and leave nothing behind: no namespace, link, server or temporary directory.
Skipped, saying why, only where network namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from loadtests.scale import netns

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 240  # the smoke run takes ~30 s; every step of it has its own deadline too


def _why_not() -> str | None:
    try:
        netns.preflight()
    except netns.NetworkUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.one_server
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 30)
def test_a_partitioned_host_loses_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    why = _why_not()
    if why is not None:
        pytest.skip(f"network namespaces are not permitted here: {why}")
    out = tmp_path / "summary.json"
    env = {**os.environ, "CI": "true"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtests.scale", "--smoke", "--json", str(out)],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the harness removes its hosts on SIGTERM
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()  # the next run removes what this one left
            stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"the smoke run took over {RUN_TIMEOUT}s:\n{stderr[-3000:]}")
    assert out.exists(), f"no summary (exit {proc.returncode}):\n{stderr[-3000:]}"
    summary = json.loads(out.read_text())
    (result,) = summary["scenarios"]
    detail = f"{stdout}\n{stderr[-3000:]}"

    assert result["scenario"] == "partition", detail
    assert "error" not in result, detail
    # Positive controls: load was applied, the host was cut while it held rows, and the
    # others took its rows over (without them, "nothing lost" proves nothing).
    assert result["published"] > 100, detail
    assert result["held_rows_when_cut"] > 0, detail
    assert result["first_takeover_after_cut_s"] is not None, detail
    assert result["published"] == result["expected_rows"] == result["handled"], detail
    assert result["lost"] == 0, detail
    assert result["unexplained_count"] == 0, detail
    assert result["duplicates"] <= sum(result["lease_lost_by_host"].values()), detail
    cut = result["partitioned_host"]
    assert result["lease_lost_by_host"][cut] > 0 or result["late_acks_refused"], detail
    assert result["checker_ok"], detail
    assert summary["ok"], detail
    assert proc.returncode == 0, detail

    # Nothing of the run is left: its names carry its pid.
    mine = f"{netns.PREFIX}-{proc.pid}-"
    assert summary["leftover_namespaces"] == [], detail
    assert not [n for n in netns.namespaces() if n.startswith(mine)]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=15)
    assert f"{netns.PREFIX}{proc.pid}" not in links.stdout
    left = [
        p.name
        for folder in {Path(tempfile.gettempdir()), Path("/tmp")}
        for p in folder.glob(f"outbox-farm-scale-{proc.pid}-*")
    ]
    assert left == []
