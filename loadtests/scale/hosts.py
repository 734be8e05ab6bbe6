"""What runs on the hosts: a farm per farm host, the producer, the delaying proxy.

Each is a subprocess started through `ip netns exec` in a session of its own, so that one
`killpg` reaches a farm's arbiter and workers; every wait on one is bounded, and every one is
killed on the way out if it is still running (the namespace's teardown kills any straggler).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from loadtests.common.farmproc import get, log_tail
from loadtests.common.harness import CLI, Metrics, SetupError, kill_farm, stop_farm
from loadtests.common.waits import wait_until

from .dbserver import cpu_seconds
from .netns import Host

REPO = Path(__file__).resolve().parents[2]
APP = "loadtests.scale.scaleapp:farm"
METRICS_PORT = 9464
GRACEFUL = 10.0
BOOT_TIMEOUT = 60.0
PROXY_START_TIMEOUT = 30.0


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment without outbox_farm's settings (the command line here says
    how the farm runs, whatever the shell had set), plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OUTBOX_FARM_", "SCALE_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


@dataclass
class FarmHost:
    host: Host
    proc: subprocess.Popen[bytes]
    log: Path
    procs: int
    port: int = METRICS_PORT

    @property
    def url(self) -> str:
        return f"http://{self.host.address}:{self.port}"

    def health(self) -> tuple[int, dict[str, Any]] | None:
        got = get(self.url + "/healthz")
        if got is None:
            return None
        with contextlib.suppress(ValueError):
            return got[0], json.loads(got[1] or b"{}")
        return None

    def ready(self) -> bool:
        health = self.health()
        return health is not None and health[0] == 200 and health[1].get("alive") == self.procs

    def wait_ready(self, timeout: float = BOOT_TIMEOUT) -> None:
        if wait_until(self.ready, timeout, watch=self.proc):
            return
        if self.proc.poll() is not None:
            raise SetupError(f"{self.host.role}: the farm exited:\n{self.tail()}")
        raise SetupError(f"{self.host.role}: not ready within {timeout:g}s:\n{self.tail()}")

    def scrape(self, timeout: float = 5.0) -> Metrics | None:
        return Metrics.scrape(self.url + "/metrics", timeout=timeout)

    def cpu(self) -> float:
        """CPU seconds of the farm's arbiter (with its reaped children) and live children."""
        with contextlib.suppress(psutil.Error):
            main = psutil.Process(self.proc.pid)
            return cpu_seconds([main, *main.children(recursive=True)])
        return 0.0

    def stop(self) -> int | None:
        return stop_farm(self.proc, GRACEFUL + 20)

    def tail(self, lines: int = 20) -> str:
        return log_tail(self.log, lines)


@contextlib.contextmanager
def farm_host(
    host: Host,
    dsn: str,
    procs: int,
    work: Path,
    *,
    env: Mapping[str, str],
    options: Sequence[str] = (),
    app: str = APP,
    port: int = METRICS_PORT,
    name: str | None = None,
) -> Iterator[FarmHost]:
    """`outbox-farm start` of `app` (the scale app unless told) in `host`'s namespace, its
    /metrics on `port`, its log and metrics named `name` (the host's role unless told), ready
    (every worker alive) when yielded, killed on the way out if still running."""
    name = name or host.role
    log = work / f"{name}.log"
    command = [
        str(CLI),
        "start",
        app,
        "--dsn",
        dsn,
        "--procs",
        str(procs),
        "--metrics-bind",
        f"{host.address}:{port}",
        "--metrics-dir",
        str(work / f"{name}-metrics"),
        "--graceful-timeout",
        str(GRACEFUL),
        "--log-format",
        "json",
        *options,
    ]
    environ = clean_env({"TMPDIR": str(work), "SCALE_HOST": host.role, **env})
    with log.open("wb") as out:
        proc = subprocess.Popen(
            host.exec(command),
            cwd=REPO,
            env=environ,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    farm = FarmHost(host, proc, log, procs, port)
    try:
        farm.wait_ready()
        yield farm
    finally:
        if proc.poll() is None:
            kill_farm(proc)


def _producer_command(host: Host, dsn: str, commits: Path, args: Sequence[str]) -> list[str]:
    program = [sys.executable, "-m", "loadtests.scale.producer", "--dsn", dsn]
    return host.exec([*program, "--commits", str(commits), *args])


def run_to_end(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`command` from the repository, in the farm's clean environment, to its end (killed at
    `timeout`), its output captured."""
    return subprocess.run(
        command,
        cwd=REPO,
        env=clean_env({}),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def produce(host: Host, dsn: str, commits: Path, *args: str, timeout: float) -> dict[str, float]:
    """Run the producer in `host`'s namespace to its end (killed at `timeout`); its summary."""
    done = run_to_end(_producer_command(host, dsn, commits, args), timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SetupError(f"the producer failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return dict(json.loads(lines[-1]))


@contextlib.contextmanager
def producer(host: Host, dsn: str, commits: Path, *args: str) -> Iterator[subprocess.Popen[str]]:
    """The producer running in the background (steady load); killed on the way out."""
    command = _producer_command(host, dsn, commits, args)
    proc = subprocess.Popen(
        command,
        cwd=REPO,
        env=clean_env({}),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=10)


def finish(proc: subprocess.Popen[str], timeout: float) -> dict[str, float]:
    """Wait for a background producer to end; its summary."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SetupError(f"the producer did not finish within {timeout:g}s") from None
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SetupError(f"the producer failed ({proc.returncode}): {err.strip()[-2000:]}")
    return dict(json.loads(lines[-1]))


def netem_available(host: Host) -> str | None:
    """None when `tc qdisc ... netem` works in `host`'s namespace, else why not: tried on the
    namespace's loopback, then removed."""
    try:
        done = subprocess.run(
            host.exec(["tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]),
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"tc: {exc}"
    if done.returncode != 0:
        return (done.stderr or done.stdout).strip() or f"tc exited {done.returncode}"
    subprocess.run(host.exec(["tc", "qdisc", "del", "dev", "lo", "root"]), timeout=15, check=False)
    return None


@contextlib.contextmanager
def delay_proxy(
    host: Host, listen_port: int, target: str, delay: float, jitter: float, log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """The delaying proxy in `host`'s namespace on `listen_port`, to `target` (host:port)."""
    command = host.exec(
        [
            sys.executable,
            "-m",
            "loadtests.scale.delay",
            "--listen",
            f"{host.address}:{listen_port}",
            "--target",
            target,
            "--delay",
            str(delay),
            "--jitter",
            str(jitter),
        ]
    )
    with log.open("wb") as err:
        proc = subprocess.Popen(
            command,
            cwd=REPO,
            env=clean_env({}),
            stdout=subprocess.PIPE,
            stderr=err,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], PROXY_START_TIMEOUT)
        if not ready or proc.stdout.readline().strip() != b"listening":
            raise SetupError(f"the delaying proxy did not start: {log.read_text()[-1000:]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def netem(
    prefix: Sequence[str], device: str, delay_ms: float, jitter_ms: float
) -> subprocess.CompletedProcess[bytes]:
    """`tc qdisc replace dev <device> root netem delay ...`, run after `prefix` (`ip netns
    exec <ns>`, or nothing for the root namespace's end of a link)."""
    return subprocess.run(
        [
            *prefix,
            "tc",
            "qdisc",
            "replace",
            "dev",
            device,
            "root",
            "netem",
            "delay",
            f"{delay_ms:g}ms",
            f"{jitter_ms:g}ms",
        ],
        check=True,
        capture_output=True,
        timeout=15,
    )


def clear_netem(prefix: Sequence[str], device: str) -> None:
    subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], timeout=15, check=False)
