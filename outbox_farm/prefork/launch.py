"""What `outbox-farm start` does before and around the arbiter.

Everything that can be refused is refused here, once, in the one process: the app that does
not import, queues it has no handler for, an unreachable database, missing tables or
privileges. A worker that failed on any of these would only be restarted into the same failure.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..db.connect import connect
from ..errors import ConfigurationError
from ..farm import Farm
from ..ops.readiness import check_ready
from ..ops.server import located
from ..settings import SupervisorSettings
from .app import AppLoader
from .arbiter import Arbiter


def load_app(
    path: str, concurrency: int | None, queues: tuple[str, ...] | None
) -> tuple[AppLoader, Farm]:
    """The app at `path`, loaded once, and its loader for the workers: every handler's
    concurrency set to `concurrency` when given (in every worker too). ConfigurationError when
    the app has no handler for one of `queues`; AppImportError when it does not load.
    """
    loader = AppLoader(path, _concurrency(concurrency))
    farm = loader.load()
    unknown = sorted(set(queues or ()) - set(farm.handlers))
    if unknown:
        raise ConfigurationError(f"--queues names queues with no handler: {', '.join(unknown)}")
    return loader, farm


def _concurrency(concurrency: int | None) -> Callable[[Farm], Farm]:
    def adjust(farm: Farm) -> Farm:
        if concurrency is not None:
            farm.handlers = {
                q: dataclasses.replace(spec, concurrency=concurrency)
                for q, spec in farm.handlers.items()
            }
        return farm

    return adjust


def run_farm(
    farm: Farm,
    loader: AppLoader,
    dsn: str | None,
    settings: SupervisorSettings,
    migrate: bool | None,
    log: logging.Logger,
) -> int:
    """Check the database, then supervise the farm until it stops; the exit status.

    Without `dsn` the embedded server is used and, unless `migrate` is False, migrated; with
    one, only when `migrate` is True. `log` takes the start-up lines. A server that cannot be
    reached is named as every command names it: the DSN with its secret masked, or the
    embedded server and its data directory.
    """

    def say(line: str) -> None:
        log.info(line, extra={"event": "embedded"})

    with located(dsn, say) as server:
        with connect(server.url, name=server.name) as conn:
            check_ready(conn, farm.names, migrate or (migrate is None and not dsn), log)
        with tempfile.TemporaryDirectory(prefix="outbox-farm-state-") as state:
            return Arbiter(farm, server.url, Path(state), settings, loader).run()
