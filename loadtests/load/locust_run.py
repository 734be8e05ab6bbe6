"""Locust, the load test's publishers (`locustfile.py`), run as a subprocess: its command
line, a run bounded in time that Ctrl-C ends cleanly, and its statistics as a table.

The driver hears back from Locust only through its exit status and the CSV files it writes,
so both are read here, beside the command that asks for them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from loadtests.common.harness import align

HERE = Path(__file__).resolve().parent
STOP_GRACE = 5  # Locust's --stop-timeout: a user finishes its transaction


def locust_command(args: argparse.Namespace, dsn: str, csv_prefix: Path) -> list[str]:
    """The load test's options go to the locustfile as Locust options, so that the web UI
    shows them too."""
    command = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(HERE / "locustfile.py"),
        "--host",
        dsn,
        "--users",
        str(args.users),
        "--spawn-rate",
        f"{args.spawn_rate:g}",
        "--queue-weights",
        args.queue_weights,
        "--flaky-failures",
        str(args.flaky_failures),
        "--rollback-ratio",
        f"{args.rollback_ratio:g}",
        "--publish-rate",
        f"{args.publish_rate:g}",
        "--stop-timeout",
        str(STOP_GRACE),
        "--csv",
        str(csv_prefix),
    ]
    if args.ui:
        return [*command, "--web-host", "127.0.0.1", "--web-port", str(args.web_port)]
    return [*command, "--headless", "--run-time", f"{args.duration}s", "--only-summary"]


def run_locust(
    args: argparse.Namespace, dsn: str, work: Path, say: Callable[[str], None]
) -> int | None:
    """Run Locust to its end; its exit status (None: a headless run had to be stopped).

    Locust runs in a session of its own, so a Ctrl-C reaches only this script (gevent's hub
    can swallow a KeyboardInterrupt and leave Locust running); this script then stops Locust
    with SIGTERM, which Locust handles cleanly, writing its statistics. In --ui mode a Ctrl-C
    ends the test and goes on to drain and check; in a headless run it aborts the run.
    """
    command = locust_command(args, dsn, work / "locust")
    env = {**os.environ, "LOADTEST_DSN": dsn}  # if the web UI's host field is emptied
    limit = args.ui_timeout if args.ui else args.duration + STOP_GRACE + 60
    if args.ui:
        say(f"Locust web UI: http://127.0.0.1:{args.web_port} (Ctrl-C here when done)")
        proc = subprocess.Popen(command, cwd=work, env=env, start_new_session=True)
    else:  # its own summary repeats ours; kept in the work folder
        with (work / "locust.log").open("wb") as log:
            proc = subprocess.Popen(
                command,
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    interrupted: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if args.ui:
        signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    try:
        deadline = time.monotonic() + limit
        for _ in range(int(limit / 0.5) + 2):
            if proc.poll() is not None or interrupted or time.monotonic() >= deadline:
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)
        if proc.poll() is None:
            why = "Ctrl-C" if interrupted else f"still running after {limit:g}s"
            say(f"stopping Locust ({why})")
            code = stop_locust(proc)
            return code if args.ui else None  # a headless run must end by itself
        return proc.returncode
    finally:
        signal.signal(signal.SIGINT, previous)
        if proc.poll() is None:  # this script was interrupted (headless Ctrl-C)
            stop_locust(proc)


def stop_locust(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM, then SIGKILL after 30 s; the exit status (None if it had to be killed)."""
    proc.terminate()
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return None


def locust_table(csv_prefix: Path) -> tuple[str, int]:
    """Locust's per-queue publish statistics as a table, and its failure count."""
    path = Path(f"{csv_prefix}_stats.csv")
    if not path.exists():
        return "(no Locust statistics were written)", 0
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    head = (
        "type",
        "queue",
        "requests",
        "failures",
        "req/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "max ms",
    )
    table = [head]
    failures = 0
    for r in rows:
        name = r["Name"] if r["Type"] else "TOTAL"
        if not r["Type"]:
            failures = int(r["Failure Count"])
        table.append(
            (
                r["Type"],
                name,
                r["Request Count"],
                r["Failure Count"],
                f"{float(r['Requests/s']):.1f}",
                r["50%"],
                r["95%"],
                r["99%"],
                f"{float(r['Max Response Time']):.0f}",
            )
        )
    lines = align(table)
    failures_path = Path(f"{csv_prefix}_failures.csv")
    if failures and failures_path.exists():
        with failures_path.open(newline="") as file:
            for r in list(csv.DictReader(file))[:10]:
                lines.append(f"  failure x{r['Occurrences']}: {r['Name']}: {r['Error'][:200]}")
    return "\n".join(lines), failures
