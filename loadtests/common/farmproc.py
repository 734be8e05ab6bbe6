"""The load test's farm as a subprocess: started, waited on until healthy, stopped, read.

`load/run_loadtest.py` runs one farm here (in relay mode behind the consumer it publishes to);
the chaos suite (`chaos/farms.py`) starts its farms through the same `farm_subprocess`, so
both give the farm the same environment, /metrics and JSON log, and neither can leave one
running.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests.common.harness import SetupError, free_port, kill_farm, start_farm, stop_farm
from loadtests.common.relaymode import Consumer, relay_consumer
from loadtests.common.waits import wait_until

# Farms start in the repository, their apps named by module, wherever the app lives.
ROOT = Path(__file__).resolve().parents[2]
APP = "loadtests.common.farmapp:farm"
RELAY_APP = "loadtests.common.relayapp:farm"
GRACEFUL = 10.0  # the farm's --graceful-timeout


@contextlib.contextmanager
def farm_subprocess(
    app: str,
    dsn: str,
    procs: int,
    work: Path,
    *,
    cwd: Path,
    log: Path,
    metrics_dir: Path,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`outbox-farm start app` with /metrics on a free port (yielded with the process) and a
    JSON log, killed on the way out if still running.

    Settings from the caller's environment (OUTBOX_FARM_*, PROMETHEUS_MULTIPROC_DIR) are left
    out of the farm's, so that it runs as the command line here says, whatever the shell had
    set. The app reads the database from LOADTEST_DSN and keeps its temporary files in `work`;
    `env` adds to that.
    """
    port = free_port()
    environ = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("OUTBOX_FARM_") and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    environ.update(LOADTEST_DSN=dsn, TMPDIR=str(work), **(env or {}))
    every = ["--metrics-bind", f"127.0.0.1:{port}", "--metrics-dir", str(metrics_dir)]
    every += ["--graceful-timeout", str(GRACEFUL), "--log-format", "json", *options]
    proc = start_farm(app, dsn, procs, cwd=cwd, log=log, options=every, env=environ)
    try:
        yield proc, port
    finally:
        if proc.poll() is None:
            kill_farm(proc)


def log_tail(log: Path, lines: int = 30) -> str:
    """The end of the farm's log, for a failure's message: the cause is usually there."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def get(url: str) -> tuple[int, bytes] | None:
    """Status and body whatever the status (/healthz answers 503 while unhealthy); None while
    nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()
    except (OSError, http.client.HTTPException):  # refused, reset, or cut off mid-reply
        return None


@dataclass
class FarmProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    procs: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)

    def events(self) -> Counter[str]:
        found: Counter[str] = Counter()
        if not self.log_path.exists():
            return found
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, AttributeError):
                found[str(json.loads(line).get("event", "-"))] += 1
        return found

    def healthy(self) -> bool:
        got = get(f"http://127.0.0.1:{self.port}/healthz")
        if got is None or got[0] != 200:
            return False
        health = json.loads(got[1])
        return bool(health.get("procs") == health.get("alive") == self.procs)

    def wait_healthy(self, timeout: float) -> None:
        if wait_until(self.healthy, timeout, watch=self.proc):
            return
        if self.proc.poll() is not None:
            raise SetupError(f"the farm exited ({self.proc.returncode}):\n{self.log_tail()}")
        raise SetupError(f"the farm was not healthy within {timeout:g}s:\n{self.log_tail()}")

    def stop(self) -> tuple[int | None, float]:
        """SIGTERM and wait; (exit status or None if it had to be killed, seconds)."""
        began = time.monotonic()
        return stop_farm(self.proc, GRACEFUL + 20), time.monotonic() - began


@contextlib.contextmanager
def farm_process(
    dsn: str, procs: int, work: Path, app: str = APP, **extra_env: str
) -> Iterator[FarmProcess]:
    log_path = work / "farm.log"
    with farm_subprocess(
        app, dsn, procs, work, cwd=ROOT, log=log_path, metrics_dir=work / "metrics", env=extra_env
    ) as (proc, port):
        yield FarmProcess(proc, port, log_path, procs)


@contextlib.contextmanager
def the_farm(
    args: argparse.Namespace, dsn: str, work: Path, say: Callable[[str], None]
) -> Iterator[tuple[FarmProcess, Consumer | None]]:
    """The load test's farm; in relay mode with the consumer it publishes to, started first."""
    if not args.relay:
        with farm_process(dsn, args.procs, work) as farm:
            yield farm, None
        return
    with relay_consumer(args, dsn, work) as consumer:
        say(f"relay mode: {consumer.where}, destination {consumer.exchange}")
        with farm_process(dsn, args.procs, work, RELAY_APP, **consumer.env) as farm:
            yield farm, consumer
