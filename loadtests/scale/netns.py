"""The hosts' network: one namespace per host, each joined to a bridge by a veth pair.

Everything made here is named after the harness's own pid (`ofsc-<pid>-<host>` for the
namespaces, `ofsc<pid>b` for the bridge, `ofsc<pid>v<n>` for the bridge's end of each veth), so
that a run that died (SIGKILL, power cut) is recognised by the next one from the dead pid in
the names and removed, while a run going on beside it is left alone.

The harness process itself stays in the root namespace, with an address on the bridge: it
reaches the database and each farm's /metrics over the same network the hosts use.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

PREFIX = "ofsc"
IP_TIMEOUT = 15.0  # seconds for one `ip` command: they take milliseconds unless the box is stuck
_OURS = re.compile(rf"^{PREFIX}-?(\d+)")


class NetworkUnavailable(Exception):
    """Network namespaces cannot be made here (not root, no iproute2, no veth or bridge)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One `ip` command, bounded in time; its output as text."""
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=check
    )


def _failed(what: str, exc: BaseException) -> str:
    if isinstance(exc, subprocess.CalledProcessError):
        return f"`{what}` failed: {(exc.stderr or exc.stdout or '').strip() or exc}"
    return f"`{what}` failed: {exc}"


def preflight() -> None:
    """Make and remove a namespace, a bridge and a veth pair; NetworkUnavailable naming what
    is missing when any of it cannot be done, before anything else is started."""
    if shutil.which("ip") is None:
        raise NetworkUnavailable("the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        raise NetworkUnavailable(
            "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN): run as root"
        )
    probe = f"{PREFIX}-{os.getpid()}-probe"
    bridge, veth = f"{PREFIX}{os.getpid()}p", f"{PREFIX}{os.getpid()}q"
    steps: list[tuple[str, Sequence[str]]] = [
        ("ip netns add", ("netns", "add", probe)),
        ("ip link add type bridge", ("link", "add", bridge, "type", "bridge")),
        (
            "ip link add type veth",
            ("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", probe),
        ),
    ]
    try:
        for what, args in steps:
            try:
                ip(*args)
            except (subprocess.SubprocessError, OSError) as exc:
                raise NetworkUnavailable(_failed(what, exc)) from None
    finally:
        ip("link", "del", veth, check=False)
        ip("link", "del", bridge, check=False)
        ip("netns", "del", probe, check=False)


def _owner_alive(name: str) -> bool:
    match = _OURS.match(name)
    if match is None:
        return True  # not ours: never touched
    pid = int(match.group(1))
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """Every namespace whose name says it is this harness's (any run's)."""
    out = ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{PREFIX}-")]


def ours() -> list[str]:
    """The namespaces of this run that still exist (none once the bed is removed)."""
    mine = f"{PREFIX}-{os.getpid()}-"
    return [name for name in namespaces() if name.startswith(mine)]


def _links() -> list[str]:
    out = ip("-o", "link", "show", check=False).stdout
    names = [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith(PREFIX)]


def kill_namespace_processes(name: str, timeout: float = 10.0) -> None:
    """SIGKILL every process still in namespace `name` and wait for them to go: a namespace
    with a process in it outlives `ip netns del`, and so would the server's port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [int(p) for p in ip("netns", "pids", name, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def clean_stale() -> list[str]:
    """Remove the namespaces and links of earlier runs whose harness is gone; their names."""
    removed = []
    for name in namespaces():
        if not _owner_alive(name):
            kill_namespace_processes(name)
            ip("netns", "del", name, check=False)
            removed.append(name)
    for link in _links():
        if not _owner_alive(link):
            ip("link", "del", link, check=False)
            removed.append(link)
    return removed


def _used_prefixes() -> set[ipaddress.IPv4Network]:
    used: set[ipaddress.IPv4Network] = set()
    text = ip("-4", "-o", "addr", "show", check=False).stdout
    text += ip("-4", "route", "show", "table", "all", check=False).stdout
    for token in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?\b", text):
        with contextlib.suppress(ValueError):
            used.add(ipaddress.IPv4Network(token, strict=False))
    return used


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.213.0.0/16 that no address or route on this machine overlaps (the pid
    picks where to start looking, so that two runs side by side pick different ones)."""
    used = _used_prefixes()
    start = os.getpid() % 256
    for step in range(256):
        candidate = ipaddress.IPv4Network(f"10.213.{(start + step) % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return candidate
    raise NetworkUnavailable("no free /24 in 10.213.0.0/16 for the hosts' network")


@dataclass
class Host:
    """One namespace: its name, its address on the bridge, and the bridge's end of its veth
    (taken down to cut the host off, as a pulled cable)."""

    role: str
    netns: str
    address: str
    link: str

    def exec(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def cut(self) -> None:
        """Partition: the bridge's end of the host's cable down. Nothing reaches the host or
        leaves it; its sockets stay open, as on a real partition, and retransmit until healed."""
        ip("link", "set", self.link, "down")

    def heal(self) -> None:
        ip("link", "set", self.link, "up")


@dataclass
class Network:
    """The bridge, the root namespace's address on it, and the hosts; `close()` removes all."""

    subnet: ipaddress.IPv4Network
    bridge: str
    gateway: str
    hosts: dict[str, Host] = field(default_factory=dict)

    def add(self, role: str, octet: int) -> Host:
        pid = os.getpid()
        host = Host(
            role,
            f"{PREFIX}-{pid}-{role}",
            str(self.subnet.network_address + octet),
            f"{PREFIX}{pid}v{octet}",
        )
        self.hosts[role] = host  # before the first command: close() removes a half-made host
        prefix = self.subnet.prefixlen
        ip("netns", "add", host.netns)
        ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
        ip("link", "set", host.link, "master", self.bridge)
        ip("link", "set", host.link, "up")
        inside = ("netns", "exec", host.netns, "ip")
        ip(*inside, "link", "set", "lo", "up")
        ip(*inside, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        return host

    def close(self) -> None:
        for host in self.hosts.values():
            kill_namespace_processes(host.netns)
            ip("link", "del", host.link, check=False)
            ip("netns", "del", host.netns, check=False)
        ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def network(roles: Sequence[tuple[str, int]]) -> Iterator[Network]:
    """The bridge and one host per (role, last octet); everything removed on the way out,
    whatever happened, processes left in the namespaces included."""
    subnet = free_subnet()
    gateway = str(subnet.network_address + 1)
    net = Network(subnet, f"{PREFIX}{os.getpid()}b", gateway)
    try:
        ip("link", "add", net.bridge, "type", "bridge")
        ip("addr", "add", f"{gateway}/{subnet.prefixlen}", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        for role, octet in roles:
            net.add(role, octet)
        yield net
    finally:
        net.close()
