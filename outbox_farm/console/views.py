"""The pages that read: overview, dead letters (list and row), farm, and the login form.

Each page gathers what it shows in one function run in Starlette's thread pool (the admin API
is synchronous), on one connection, through the same functions the CLI calls: `queue_stats`
as `stats`, `dlq_list` / `dlq_show` / `dlq_count` as `dlq list` / `show`, the xmin probe as
`doctor`. The live parts of the overview and farm pages are the same templates rendered alone,
fetched by htmx every few seconds.
"""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ..admin import DlqFilter, QueueStats, When, dlq_count, dlq_list, dlq_show, queue_stats
from ..db.operator import DoctorProbes, StatsReader, XminHolder
from ..dsn import scrub
from ..errors import ConfigurationError, ConnectionLost, OutboxFarmError
from ..outcome import Reason
from .farm import FarmView, Health, Unreachable, read_health
from .render import Chart, StoredException, correlation
from .security import COOKIE, LOOPBACK_NAME, Signer
from .session import set_session_cookie

log = logging.getLogger("outbox_farm.console")
FILTER_FIELDS = ("queue", "reason", "since", "until", "text")
REASONS = [reason.value for reason in Reason]
XMIN_LIMIT = 300.0  # seconds, as `doctor --max-xmin-age` by default


def page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    settings = request.app.state.settings
    context.update(
        request=request,
        who=getattr(request.state, "who", None),
        csrf=getattr(request.state, "csrf", ""),
        read_only=settings.read_only,
        tokens_required=settings.tokens.required,
        live_every_ms=int(settings.live_every * 1000),
    )
    templates = request.app.state.templates
    return templates.TemplateResponse(request, name, context, status_code=status)  # type: ignore[no-any-return]


# -- overview --------------------------------------------------------------------------------


@dataclass
class Overview:
    queues: list[QueueStats]
    farm: FarmView
    chart: Chart | None
    idle: set[str] = field(default_factory=set)


def _overview(request: Request) -> Overview:
    settings = request.app.state.settings
    farm: FarmView = request.app.state.sampler.view()
    seen: set[str] = request.app.state.seen  # every queue shown so far, kept for the process
    with settings.database.connection() as conn:
        stats = queue_stats(conn, settings.names)
        found = {q.queue for q in stats}
        from_farm = set(farm.latest.queues) if farm.latest else set()
        # A queue the farm handles, or one shown before that has drained since, stays on the
        # page with its zeros: an idle queue is news too.
        missing = sorted((from_farm | seen) - found - {""})
        for queue in missing:
            stats += queue_stats(conn, settings.names, queue)
    seen.update(found | from_farm)
    stats.sort(key=lambda q: q.queue)
    idle = {q.queue for q in stats if not any(c.value for c in q.counts.values())}
    return Overview(stats, farm, Chart.of(farm.points), idle)


async def overview(request: Request) -> Response:
    data = await run_in_threadpool(_overview, request)
    return page(request, "overview.html", o=data)


async def overview_live(request: Request) -> Response:
    data = await run_in_threadpool(_overview, request)
    return page(request, "_overview_live.html", o=data)


# -- dead letters ----------------------------------------------------------------------------


@dataclass
class Filter:
    """The DLQ filter as the form holds it (text, echoed back) and as the admin API takes it."""

    form: dict[str, str]
    where: DlqFilter
    error: str | None = None

    @property
    def empty(self) -> bool:
        return not any(self.form.values())

    def query(self, **extra: object) -> str:
        """The filter (and `extra`) as a query string for links."""
        items = {k: v for k, v in self.form.items() if v}
        items.update({k: str(v) for k, v in extra.items() if v is not None})
        return urllib.parse.urlencode(items)

    def describe(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self.form.items() if v]
        return " ".join(parts) or "every row"


def parse_filter(values: Any) -> Filter:
    """The filter from a query string or a form; a bad value is an `error` to show beside the
    form (the rest of the filter still applies nothing: an error matches no query)."""
    form = {name: str(values.get(name, "") or "").strip() for name in FILTER_FIELDS}
    try:
        if form["reason"] and form["reason"] not in REASONS:
            raise ConfigurationError(
                f"reason {form['reason']!r} is not one of {', '.join(REASONS)}"
            )
        where = DlqFilter(
            queue=form["queue"] or None,
            reason=form["reason"] or None,
            since=When.parse(form["since"]) if form["since"] else None,
            until=When.parse(form["until"]) if form["until"] else None,
            grep=form["text"] or None,
        )
        where.match()  # refuses a NUL character now, not in the middle of a page
    except ConfigurationError as exc:
        return Filter(form, DlqFilter(ids=()), str(exc))
    return Filter(form, where)


def _int(value: str | None, minimum: int) -> int | None:
    try:
        number = int(value) if value else None
    except ValueError:
        return None
    return number if number is not None and number >= minimum else None


def _dlq_page(request: Request, flt: Filter, before: int | None, number: int) -> dict[str, Any]:
    settings = request.app.state.settings
    with settings.database.connection() as conn:
        queues = StatsReader(conn, settings.names).queues()
        if flt.error:
            return {"rows": [], "total": (0, True), "queues": queues, "cap": settings.count_cap}
        rows = dlq_list(conn, settings.names, flt.where, settings.page_size + 1, before=before)
        total = dlq_count(conn, settings.names, flt.where, settings.count_cap)
    more = len(rows) > settings.page_size
    rows = rows[: settings.page_size]
    first = (number - 1) * settings.page_size + 1
    return {
        "rows": rows,
        "total": total,
        "queues": queues,
        "cap": settings.count_cap,
        "more": more,
        "first": first,
        "last": first + len(rows) - 1,
        "next": flt.query(before=rows[-1].id, page=number + 1) if more and rows else None,
    }


async def dlq_list_page(request: Request) -> Response:
    flt = parse_filter(request.query_params)
    before = _int(request.query_params.get("before"), 1)
    number = _int(request.query_params.get("page"), 1) or 1
    if before is None:
        number = 1
    data = await run_in_threadpool(_dlq_page, request, flt, before, number)
    return page(
        request,
        "dlq.html",
        status=400 if flt.error else 200,
        flt=flt,
        reasons=REASONS,
        correlation=correlation,
        **data,
    )


async def dlq_row(request: Request) -> Response:
    settings = request.app.state.settings
    row_id = int(request.path_params["row_id"])

    def read() -> Any:
        with settings.database.connection() as conn:
            return dlq_show(conn, settings.names, row_id)

    entry = await run_in_threadpool(read)
    if entry is None:
        return page(
            request,
            "error.html",
            status=404,
            title="No such dead letter",
            message=f"There is no DLQ row {row_id}: it may have been replayed or purged.",
        )
    return page(
        request,
        "dlq_row.html",
        e=entry,
        correlation=correlation(entry.headers),
        exception=StoredException.parse(entry.last_exception),
    )


# -- farm ------------------------------------------------------------------------------------


@dataclass
class FarmPage:
    farm: FarmView
    health: Health | None
    health_error: str | None
    xmin: XminHolder | None
    xmin_error: str | None
    xmin_limit: float = XMIN_LIMIT


def _farm(request: Request) -> FarmPage:
    settings = request.app.state.settings
    farm: FarmView = request.app.state.sampler.view()
    health = health_error = None
    if settings.metrics_url:
        try:
            health = read_health(settings.metrics_url)
        except Unreachable as exc:
            health_error = str(exc)
    else:
        health_error = "no --metrics-url given"
    xmin = xmin_error = None
    try:
        with settings.database.connection() as conn:
            xmin = DoctorProbes(conn, settings.names).xmin_holder()
    except ConnectionLost:
        xmin_error = "the database cannot be reached (the console's log says why)"
        log.warning("console: the xmin probe failed", exc_info=True)
    except OutboxFarmError as exc:
        xmin_error = scrub(str(exc))
    return FarmPage(farm, health, health_error, xmin, xmin_error)


async def farm(request: Request) -> Response:
    return page(request, "farm.html", f=await run_in_threadpool(_farm, request))


async def farm_live(request: Request) -> Response:
    return page(request, "_farm_live.html", f=await run_in_threadpool(_farm, request))


# -- login -----------------------------------------------------------------------------------


def _next(value: str | None) -> str:
    """Where to go after logging in: a path of this console only, never another site."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"


async def login_form(request: Request) -> Response:
    if not request.app.state.settings.tokens.required:
        return RedirectResponse("/", status_code=303)
    return page(request, "login.html", next=_next(request.query_params.get("next")), error=None)


async def login(request: Request) -> Response:
    settings = request.app.state.settings
    if not settings.tokens.required:
        return RedirectResponse("/", status_code=303)
    form = await request.form()
    target = _next(str(form.get("next") or ""))
    who = settings.tokens.who(str(form.get("token") or ""))
    if who is None:
        log.warning("console login refused", extra={"event": "console_login_refused"})
        return page(
            request, "login.html", status=401, next=target, error="That token is not valid."
        )
    signer: Signer = request.app.state.signer
    response = RedirectResponse(target, status_code=303)
    set_session_cookie(response, signer.session(who), request.url.scheme == "https")
    log.info("console login: %s", who, extra={"event": "console_login", "who": who})
    return response


async def logout(request: Request) -> Response:
    await checked_form(request)
    response = RedirectResponse(
        "/login" if request.app.state.settings.tokens.required else "/", 303
    )
    response.delete_cookie(COOKIE, path="/")
    return response


async def checked_form(request: Request) -> Any:
    """The POSTed form, once its CSRF token proved it came from a page of this session."""
    form = await request.form()
    given = str(form.get("csrf") or request.headers.get("x-csrf-token") or "")
    signer: Signer = request.app.state.signer
    if getattr(request.state, "who", None) is None or not signer.check_csrf(
        request.state.session, given
    ):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
    return form


def who(request: Request) -> str:
    return str(getattr(request.state, "who", None) or LOOPBACK_NAME)


async def database_error(request: Request, exc: Exception) -> Response:
    """The database refused or could not be reached: a page saying so, status 503 (the next
    request tries again). A page never names the server: its address is for the log."""
    if isinstance(exc, ConfigurationError):
        return page(request, "error.html", 400, title="Not possible", message=str(exc))
    log.warning("console: %s", scrub(str(exc)), extra={"event": "console_database_error"})
    message = scrub(str(exc))
    if isinstance(exc, ConnectionLost):  # its message names the server: the log has it
        message = "The database cannot be reached (the console's log says why); reload to retry."
    return page(request, "error.html", 503, title="The database did not answer", message=message)
