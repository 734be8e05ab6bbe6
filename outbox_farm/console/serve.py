"""Serving the console with uvicorn on a socket bound here, so that a bad --bind is reported
as the other commands report theirs (one line, what to change) before anything runs."""

from __future__ import annotations

import errno
import logging
import os
import socket

import uvicorn

from ..errors import ConfigurationError
from .app import ConsoleSettings, create_app

log = logging.getLogger("outbox_farm.console")


def listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), reuse_port=False)
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


def serve(settings: ConsoleSettings, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers: finish the requests under way)."""
    sock = listen(host, port)
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    log.info(
        "console on http://%s:%d/ (%s%s)",
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
    )
    uvicorn.Server(config).run(sockets=[sock])
