"""The console as an ASGI application: `create_app(settings)`.

Composition only: the settings, the signing key, the /metrics sampler (started and stopped
with the application's lifespan), the templates (autoescaped, always), the routes of
`views`, and the middleware that makes every request prove who it is (`security`) and caps
what it may send (`limits`). Served by uvicorn from `outbox-farm console`; a test drives it
with Starlette's TestClient.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import jinja2
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute, Mount, Route, Router
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from ..errors import OutboxFarmError
from ..names import TableNames
from . import actions, login, queue_actions, queues, render, sets, views
from .database import Database
from .limits import BodyLimit
from .pages import database_error
from .picked import Picked
from .security import COOKIE, Signer, Tokens
from .session import SessionMiddleware
from .sets import LINE_TIMEOUT, DatabaseSet, PickedDatabase
from .telemetry import TIMEOUT, Sampler

SAMPLE_EVERY = 5.0  # seconds between two readings of the farm's /metrics
LIVE_EVERY = 2.0  # seconds between two refreshes of a page's live part
PAGE_SIZE = 50
STATEMENT_TIMEOUT = 5.0  # seconds a page's statement may run: past it, "narrow the filter"
ACTION_TIMEOUT = 300.0  # seconds one batch of a replay or purge may run


@dataclass
class ConsoleSettings:
    """Everything a console serves from; made by the CLI (or a test)."""

    database: Database | None  # None: a fleet's console, its databases in `sets`
    names: TableNames
    sets: DatabaseSet | None = None  # a fleet's set: every database of it, under /db/NAME/
    tokens: Tokens = field(default_factory=lambda: Tokens({}))
    read_only: bool = False
    metrics_url: str | None = None
    sample_every: float = SAMPLE_EVERY
    live_every: float = LIVE_EVERY
    page_size: int = PAGE_SIZE
    count_cap: int = 10_000
    secure_cookie: bool = False  # served over TLS, here or by a proxy in front
    cookie: str = COOKIE  # the session cookie's name: `serve` names it for the port
    statement_timeout: float = STATEMENT_TIMEOUT
    action_timeout: float = ACTION_TIMEOUT
    farm_timeout: float = TIMEOUT  # seconds one whole read of /metrics or /healthz may take
    database_timeout: float = LINE_TIMEOUT  # seconds for one database on a fleet's overview


def _templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("outbox_farm.console", "templates"),
        autoescape=True,  # every page, every fragment: never per file extension
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(age=render.age, number=render.number, when=render.when)
    env.filters["pretty_json"] = render.pretty_json
    env.filters["queue_path"] = queues.queue_path
    return Jinja2Templates(env=env)


def _database_routes() -> list[BaseRoute]:
    """The pages of one database: at the root of a one-database console, under /db/NAME/ of
    a fleet's."""
    return [
        Route("/", views.overview, name="overview"),
        Route("/overview/live", views.overview_live, name="overview_live"),
        Route("/dlq", views.dlq_list_page, name="dlq"),
        Route("/dlq/{row_id:int}", views.dlq_row, name="dlq_row"),
        Route("/dlq/{row_id:int}/payload", views.dlq_row_payload, name="dlq_row_payload"),
        Route("/dlq/preview", actions.preview, methods=["POST"], name="dlq_preview"),
        Route("/dlq/run", actions.run, methods=["POST"], name="dlq_run"),
        Route("/queues", queues.queue_list, name="queues"),
        Route("/queues/preview", queue_actions.preview, methods=["POST"], name="queue_preview"),
        Route("/queues/run", queue_actions.run, methods=["POST"], name="queue_run"),
        Route("/queues/{queue:path}", queues.queue_page, name="queue"),
        Route("/farm", views.farm, name="farm"),
        Route("/farm/live", views.farm_live, name="farm_live"),
    ]


def _fleet_routes() -> list[BaseRoute]:
    """A fleet's console: the overview of every database, the picker, and each database's
    pages under /db/NAME/ (the name checked by `PickedDatabase` before any of them runs)."""
    return [
        Route("/", sets.overview, name="fleet"),
        Route("/all/live", sets.overview_live, name="fleet_live"),
        Route("/pick", sets.pick, name="pick"),
        Mount("/db/{database}", app=PickedDatabase(Router(_database_routes()))),
    ]


def create_app(settings: ConsoleSettings) -> Starlette:
    """The console serving `settings`: its routes behind `SessionMiddleware`, the farm's
    sampler run for as long as the application (its lifespan), the database's connections
    closed at the end. Errors of the database become pages (`pages.database_error`).

    With `settings.sets`, a fleet's set: its overview at `/`, each database's pages under
    `/db/NAME/`, the set read at start and every `recheck` seconds after (`sets`)."""
    fleet = settings.sets
    if fleet is None and settings.database is None:
        raise ValueError("ConsoleSettings needs a database, or a fleet's set")
    if settings.database is not None:
        settings.database.statement_timeout = settings.statement_timeout
    if fleet is not None:
        fleet.statement_timeout = settings.statement_timeout
    sampler = Sampler(settings.metrics_url, settings.sample_every, settings.farm_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(sampler.run(), name="console-sampler")
        try:
            if fleet is None:
                yield
            else:
                if fleet.read_at is None:
                    await fleet.refresh()
                async with sets.reading(fleet):
                    yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if settings.database is not None:
                settings.database.close()
            if fleet is not None:
                fleet.close()

    routes = _database_routes() if fleet is None else _fleet_routes()
    routes += [
        Route("/login", login.login_form, name="login"),
        Route("/login", login.login, methods=["POST"], name="login_post"),
        Route("/logout", login.logout, methods=["POST"], name="logout"),
        Mount("/static", StaticFiles(packages=[("outbox_farm.console", "static")]), name="static"),
    ]
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(BodyLimit),  # outermost: it caps what any route reads, whoever asks
            Middleware(SessionMiddleware),
        ],
        exception_handlers={OutboxFarmError: database_error},
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.signer = Signer()
    app.state.sampler = sampler
    app.state.templates = _templates()
    app.state.sets = fleet
    app.state.single = None if settings.database is None else Picked(settings.database)
    return app
