"""Typed, frozen settings: validated once where they are made, then passed down unchanged.

The CLI, `Farm.running()` and the tests build these; the arbiter and the runtime only read
them. A bad value fails here, with the option's name, before any process or connection starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ConfigurationError
from .retry import check_seconds
from .tokens import check_worker_id

DEFAULT_BIND = "127.0.0.1:9464"  # where `start` serves /metrics and /healthz
_EXAMPLE = "e.g. 127.0.0.1:9464, [::1]:9464, or empty to turn /metrics and /healthz off"


def parse_bind(bind: str) -> tuple[str, int]:
    """`host:port` as `socket.create_server` takes it; refused with the reason otherwise.

    An IPv6 host goes in brackets; an empty host (`:9464`) is loopback, never every interface:
    /metrics says how busy the farm is and should not face the network by accident. The host
    is resolved only when binding.
    """
    host, colon, port = bind.strip().rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or int(port) > 65535:
        raise ConfigurationError(
            f"{bind!r} is not host:port with a port from 0 to 65535 ({_EXAMPLE})"
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigurationError(f"{bind!r}: put an IPv6 address in brackets ({_EXAMPLE})")
    return host or "127.0.0.1", int(port)


# The arbiter judges a worker by a heartbeat file touched about once a second: any shorter
# timeout would kill healthy workers.
MIN_HEARTBEAT_TIMEOUT = 1.0


def _whole(value: object, what: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{what} must be a whole number >= {minimum}, got {value!r}")


def _flag(value: object, what: str) -> None:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{what} must be True or False, got {value!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeSettings:
    """How one process runs its handlers (see `Runtime`).

    `queues`: a subset of the farm's queues (None: all). `poll_interval`: seconds between
    claims while idle (NOTIFY and known due times wake sooner). `flush_interval` /
    `flush_size`: the completer's batch limits. `graceful_timeout`: how long a stop lets
    running handlers finish. `listen`: False polls only. `gauges_interval`,
    `vacuum_interval`, `dlq_retention`: the table-wide chores (refresh the database-derived
    gauges, VACUUM the outbox when it needs it, delete DLQ rows older than so many seconds);
    None or 0 turns one off; a farm runs them in one process only. `worker_id`: carried in
    every lease token, so that a supervisor can free a dead worker's rows.
    """

    queues: tuple[str, ...] | None = None
    poll_interval: float = 0.5
    flush_interval: float = 0.01
    flush_size: int = 1000
    graceful_timeout: float = 30.0
    listen: bool = True
    gauges_interval: float | None = None
    vacuum_interval: float | None = 10.0
    dlq_retention: float | None = None
    worker_id: int | None = None

    def __post_init__(self) -> None:
        if self.queues is not None:
            if isinstance(self.queues, str) or not isinstance(self.queues, Iterable):
                raise ConfigurationError(f"queues must be a list of names, got {self.queues!r}")
            object.__setattr__(self, "queues", tuple(self.queues))
            for queue in self.queues:
                if not isinstance(queue, str) or not queue:
                    raise ConfigurationError(f"queues must be queue names, got {queue!r}")
        check_seconds(self.poll_interval, "poll_interval", positive=True)
        check_seconds(self.flush_interval, "flush_interval")
        _whole(self.flush_size, "flush_size", 1)
        check_seconds(self.graceful_timeout, "graceful_timeout")
        _flag(self.listen, "listen")
        for what in ("gauges_interval", "vacuum_interval", "dlq_retention"):
            check_seconds(getattr(self, what), what, allow_none=True)
        if self.worker_id is not None:
            check_worker_id(self.worker_id)

    def for_worker(
        self, worker_id: int, *, housekeeper: bool, gauges_interval: float
    ) -> RuntimeSettings:
        """One supervised worker's copy: its id, and the chores only if it is the housekeeper,
        so that N processes do not repeat the same table-wide work."""
        if housekeeper:
            return dataclasses.replace(self, worker_id=worker_id, gauges_interval=gauges_interval)
        return dataclasses.replace(
            self,
            worker_id=worker_id,
            gauges_interval=None,
            vacuum_interval=None,
            dlq_retention=None,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SupervisorSettings:
    """How the arbiter runs a farm of worker processes (see `Arbiter`).

    `procs`: worker processes at start (TTIN / TTOU then move the arbiter's own count).
    `graceful_timeout`: the farm's drain deadline, one value for the arbiter and its workers,
    so the arbiter never kills a worker still within its time: it replaces
    `runtime.graceful_timeout`. `heartbeat_timeout`: how long a worker's event loop may stay
    silent before the worker is killed and replaced. `metrics_bind`: `host:port` for /metrics
    and /healthz, None for neither. `preload`: fork workers from the farm the arbiter loaded
    instead of importing the app afresh in each (faster forks, but a HUP keeps the old code).
    `reload`: replace every worker when a source file of the app changes (development).
    `runtime`: what every worker gets, before `RuntimeSettings.for_worker` makes it its own.
    """

    procs: int = 1
    graceful_timeout: float = 30.0
    heartbeat_timeout: float = 30.0
    metrics_bind: str | None = DEFAULT_BIND
    preload: bool = False
    reload: bool = False
    runtime: RuntimeSettings = dataclasses.field(default_factory=RuntimeSettings)

    def __post_init__(self) -> None:
        _whole(self.procs, "procs", 1)
        check_seconds(self.graceful_timeout, "graceful_timeout")
        check_seconds(self.heartbeat_timeout, "heartbeat_timeout")
        if self.heartbeat_timeout < MIN_HEARTBEAT_TIMEOUT:
            raise ConfigurationError(
                f"heartbeat_timeout must be >= {MIN_HEARTBEAT_TIMEOUT:g}, the workers' heartbeat "
                f"interval, got {self.heartbeat_timeout!r}"
            )
        if self.metrics_bind is not None:
            if not isinstance(self.metrics_bind, str):
                raise ConfigurationError(
                    f"metrics_bind must be host:port or None, got {self.metrics_bind!r}"
                )
            try:
                parse_bind(self.metrics_bind)
            except ConfigurationError as exc:
                raise ConfigurationError(f"metrics_bind {exc}") from None
        _flag(self.preload, "preload")
        _flag(self.reload, "reload")
        if not isinstance(self.runtime, RuntimeSettings):
            raise ConfigurationError(f"runtime must be a RuntimeSettings, got {self.runtime!r}")
        runtime = dataclasses.replace(self.runtime, graceful_timeout=self.graceful_timeout)
        object.__setattr__(self, "runtime", runtime)
