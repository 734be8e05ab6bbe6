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
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from ..errors import OutboxFarmError
from ..names import TableNames
from . import actions, login, queue_actions, queues, render, views
from .database import Database
from .limits import BodyLimit
from .pages import database_error
from .security import COOKIE, Signer, Tokens
from .session import SessionMiddleware
from .telemetry import TIMEOUT, Sampler

SAMPLE_EVERY = 5.0  # seconds between two readings of the farm's /metrics
LIVE_EVERY = 2.0  # seconds between two refreshes of a page's live part
PAGE_SIZE = 50
STATEMENT_TIMEOUT = 5.0  # seconds a page's statement may run: past it, "narrow the filter"
ACTION_TIMEOUT = 300.0  # seconds one batch of a replay or purge may run


@dataclass
class ConsoleSettings:
    """Everything a console serves from; made by the CLI (or a test)."""

    database: Database
    names: TableNames
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


def create_app(settings: ConsoleSettings) -> Starlette:
    """The console serving `settings`: its routes behind `SessionMiddleware`, the farm's
    sampler run for as long as the application (its lifespan), the database's connections
    closed at the end. Errors of the database become pages (`pages.database_error`)."""
    settings.database.statement_timeout = settings.statement_timeout
    sampler = Sampler(settings.metrics_url, settings.sample_every, settings.farm_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(sampler.run(), name="console-sampler")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            settings.database.close()

    routes = [
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
    app.state.recent = views.Recent()
    return app
