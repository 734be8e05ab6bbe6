"""Serving the console with uvicorn on a socket bound here, so that a bad --bind is reported
as the other commands report theirs (one line, what to change) before anything runs."""

from __future__ import annotations

import errno
import logging
import os
import socket
from dataclasses import dataclass

import uvicorn

from ..errors import ConfigurationError
from .app import ConsoleSettings, create_app
from .security import cookie_name

log = logging.getLogger("outbox_farm.console")


@dataclass(frozen=True)
class Tls:
    """The certificate chain and private key uvicorn serves HTTPS with (PEM files)."""

    cert: str
    key: str


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on `host`:`port` (an IPv4 or IPv6 address, or a name resolved
    here, its first address used), or ConfigurationError saying what to change."""
    host = host.strip("[]")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigurationError(
            f"--bind {host}:{port}: the name does not resolve ({exc.strerror}); give an "
            "address of this machine (127.0.0.1, ::1, or one of its interfaces)"
        ) from None
    family = found[0][0]
    try:
        return socket.create_server(
            (host, port), family=family, reuse_port=False, dualstack_ipv6=False
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            advice = "something else listens there (another console?): pick a free port"
        elif exc.errno == errno.EACCES:
            advice = "binding it needs privileges this process lacks: use a port above 1023"
        else:
            advice = "use an address of this machine (127.0.0.1, or one of its interfaces)"
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ConfigurationError(
            f"--bind {host}:{port}: cannot listen ({reason}); {advice}"
        ) from None


def serve(settings: ConsoleSettings, host: str, port: int, tls: Tls | None = None) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers: finish the requests under way);
    over HTTPS when `tls` is given. The session cookie is named for the port bound."""
    sock = listen(host, port)
    bound = sock.getsockname()
    settings.cookie = cookie_name(bound[1])
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    log.info(
        "console on %s://%s:%d/ (%s%s)",
        "https" if tls else "http",
        shown,
        bound[1],
        "token required" if settings.tokens.required else "loopback, no token",
        ", read-only" if settings.read_only else "",
        extra={"event": "console_listening", "port": bound[1]},
    )
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,  # the process's logging, as configured by the command
        access_log=False,
        server_header=False,
        proxy_headers=False,
        lifespan="on",
        ssl_certfile=tls.cert if tls else None,
        ssl_keyfile=tls.key if tls else None,
    )
    uvicorn.Server(config).run(sockets=[sock])
