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

from ..db.connect import Connection, connect
from ..db.fleet import has_tables
from ..errors import ConfigurationError, SchemaError
from ..fleet.fleet import Fleet
from ..ops.readiness import check_ready
from ..ops.server import located
from ..settings import SupervisorSettings
from .app import App, AppLoader
from .arbiter import Arbiter


def load_app(
    path: str, concurrency: int | None, queues: tuple[str, ...] | None
) -> tuple[AppLoader, App]:
    """The app at `path`, loaded once, and its loader for the workers: every handler's
    concurrency set to `concurrency` when given (in every worker too). ConfigurationError when
    the app has no handler for one of `queues`; AppImportError when it does not load.
    """
    loader = AppLoader(path, _concurrency(concurrency))
    farm = loader.load()
    if isinstance(farm, Fleet) and queues:
        raise ConfigurationError(
            "--queues picks queues of one farm; a fleet runs every queue of its farms "
            "(make a Fleet of the farms you want this deployment to run)"
        )
    unknown = sorted(set(queues or ()) - set(farm.handlers))
    if unknown:
        raise ConfigurationError(f"--queues names queues with no handler: {', '.join(unknown)}")
    return loader, farm


def _concurrency(concurrency: int | None) -> Callable[[App], App]:
    def adjust(app: App) -> App:
        if concurrency is not None:
            for farm in app.farms if isinstance(app, Fleet) else (app,):
                farm.handlers = {
                    q: dataclasses.replace(spec, concurrency=concurrency)
                    for q, spec in farm.handlers.items()
                }
        return app

    return adjust


def run_farm(
    farm: App,
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
        migrating = migrate or (migrate is None and not dsn)
        with connect(server.url, name=server.name) as conn:
            if isinstance(farm, Fleet):
                _check_home(conn, farm, migrating, log)
            else:
                check_ready(conn, farm.names, migrating, log)
        with tempfile.TemporaryDirectory(prefix="outbox-farm-state-") as state:
            return Arbiter(farm, server.url, Path(state), settings, loader).run()


def _check_home(conn: Connection, fleet: Fleet, migrate: bool, log: logging.Logger) -> None:
    """A fleet's home database: migrated if asked (its farms' tables, and with them the
    fleet's leases of migration 0015), and refused without the leases' tables. A fleet that
    serves the home database alone needs its farms' tables there too; the databases of a set
    are checked as each is served (one not migrated is that database's problem, reported by
    name, not the fleet's)."""
    alone = fleet.file is None and fleet.catalog is None
    for farm in fleet.farms:
        if migrate or alone:
            check_ready(conn, farm.names, migrate, log)
    if not has_tables(conn):
        raise SchemaError(
            "the fleet's tables (migration 0015) do not exist on the home database: run "
            "`outbox-farm migrate` on it first"
        )
