"""The pages that read: overview, dead letters (list and row), farm, and the login form.

Each page gathers what it shows in one function run in Starlette's thread pool (the admin API
is synchronous), on one connection, through the same functions the CLI calls: `queue_stats`
as `stats`, `dlq_list` / `dlq_show` / `dlq_count` as `dlq list` / `show`, the xmin probe as
`doctor`. The live parts of the overview and farm pages are the same templates rendered alone,
fetched by htmx every few seconds.
"""

from __future__ import annotations

import time
import urllib.parse
from dataclasses import dataclass, field
from datetime import UTC
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..admin import DlqFilter, QueueStats, When, dlq_count, dlq_list, dlq_show, queue_stats
from ..admin.dlq import MAX_ID, REASONS, CauseGroup, check_reason, dlq_causes, dlq_payload
from ..db.connect import Connection
from ..db.operator import DoctorProbes, StatsReader, XminHolder
from ..dsn import scrub
from ..errors import ConfigurationError, ConnectionLost, OutboxFarmError, SchemaError
from ..names import TableNames
from .limits import MAX_IDS
from .pages import error_page, log, page
from .picked import SEEN_FOR as SEEN_FOR  # where the tests and other modules find them
from .picked import SEEN_MAX as SEEN_MAX
from .picked import Recent as Recent
from .picked import picked
from .queues import Controls, read_controls
from .render import Chart, StoredException, correlation
from .telemetry import FarmView

FILTER_FIELDS = ("queue", "reason", "since", "until", "text", "cause")
XMIN_LIMIT = 300.0  # seconds, as `doctor --max-xmin-age` by default
PAYLOAD_SHOWN = 65536  # bytes of a payload a row's page shows; the rest is a download
IDLE_SHOWN = 20  # queues without rows the overview lists at most
CAUSES_SHOWN = 10  # groups of dead letters by cause a page shows
MAX_CAUSE = 1000  # characters of a cause filter: a group's cause is at most 200


# -- overview --------------------------------------------------------------------------------


@dataclass
class Overview:
    queues: list[QueueStats]
    farm: FarmView
    chart: Chart | None
    idle: set[str] = field(default_factory=set)
    hidden: int = 0  # queues without rows left off the page (past `IDLE_SHOWN`)
    causes: Causes | None = None
    controls: Controls = field(default_factory=Controls)


@dataclass
class Causes:
    """The biggest groups of dead letters by cause, or why there are none to show."""

    groups: list[CauseGroup]
    error: str | None = None


def _causes(conn: Connection, names: TableNames, where: DlqFilter) -> Causes | None:
    """The `CAUSES_SHOWN` biggest groups of the rows `where` matches (None: no DLQ); a DLQ
    that predates the counts (migration 0009) is a line saying what to run, not an error."""
    if names.dlq is None:
        return None
    try:
        return Causes(dlq_causes(conn, names, where, limit=CAUSES_SHOWN))
    except SchemaError:
        return Causes([], "run `outbox-farm migrate` to group dead letters by cause")


def _overview(request: Request, farm: FarmView) -> Overview:
    settings = request.app.state.settings
    chosen = picked(request)
    recent = chosen.recent
    with chosen.database.connection() as conn:
        stats = queue_stats(conn, settings.names)
        controls = read_controls(conn, settings.names)
        found = {q.queue for q in stats}
        # A queue paused or limited, one the farm handles, or one that drained (or was
        # resumed) lately stays on the page with its zeros (an idle queue is news too; a
        # paused one most of all: listed first), as many as `IDLE_SHOWN`: each costs a few
        # statements, and a farm may name thousands.
        held = [q for q in controls.active() if q not in found]
        seen = recent.note(found | set(held), time.monotonic())
        drained = sorted(seen - found - set(held))
        named = set(farm.latest.queues if farm.latest else ())
        named_only = sorted(named - found - set(drained) - set(held))
        missing = [q for q in held + drained + named_only if q]
        for queue in missing[:IDLE_SHOWN]:
            stats += queue_stats(conn, settings.names, queue)
        causes = _causes(conn, settings.names, DlqFilter())
    stats.sort(key=lambda q: q.queue)
    idle = {q.queue for q in stats if not any(c.value for c in q.counts.values())}
    hidden = max(len(missing) - IDLE_SHOWN, 0)
    return Overview(stats, farm, Chart.of(farm.points), idle, hidden, causes, controls)


async def overview(request: Request) -> Response:
    data = await run_in_threadpool(_overview, request, request.app.state.sampler.view())
    return page(request, "overview.html", o=data)


async def overview_live(request: Request) -> Response:
    data = await run_in_threadpool(_overview, request, request.app.state.sampler.view())
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
    form (the rest of the filter still applies nothing: an error matches no query). A time
    typed without a zone is UTC, the zone every page shows."""
    form = {name: str(values.get(name, "") or "").strip() for name in FILTER_FIELDS}
    try:
        check_reason(form["reason"] or None)
        if len(form["queue"]) > 255:
            raise ConfigurationError("a queue name is at most 255 characters")
        if len(form["cause"]) > MAX_CAUSE:
            raise ConfigurationError(f"a cause is at most {MAX_CAUSE} characters")
        where = DlqFilter(
            queue=form["queue"] or None,
            reason=form["reason"] or None,
            since=When.parse(form["since"], UTC) if form["since"] else None,
            until=When.parse(form["until"], UTC) if form["until"] else None,
            grep=form["text"] or None,
            cause=form["cause"] or None,
        )
        where.match()  # refuses a NUL character now, not in the middle of a page
    except ConfigurationError as exc:
        return Filter(form, DlqFilter(ids=()), str(exc))
    return Filter(form, where)


def _int(value: str | None, what: str) -> int | None:
    """A positive bigint from the query string (None when absent); anything else is refused,
    saying so, rather than sent to the database."""
    if not value:
        return None
    try:
        number = int(value)
    except ValueError:
        raise ConfigurationError(f"{what} {value[:40]!r} is not a whole number") from None
    if not 1 <= number <= MAX_ID:
        raise ConfigurationError(f"{what} must be between 1 and {MAX_ID}")
    return number


def _dlq_page(request: Request, flt: Filter, before: int | None, number: int) -> dict[str, Any]:
    settings = request.app.state.settings
    with picked(request).database.connection() as conn:
        queues = StatsReader(conn, settings.names).queues()
        if flt.error:
            return {
                "rows": [],
                "total": (0, True),
                "queues": queues,
                "cap": settings.count_cap,
                "causes": None,
            }
        rows = dlq_list(conn, settings.names, flt.where, settings.page_size + 1, before=before)
        # A text search reads every row it cannot rule out: counting its matches would cost
        # as much again, so its pages say "not counted" rather than make the operator wait.
        total = (
            None
            if flt.where.grep is not None
            else dlq_count(conn, settings.names, flt.where, settings.count_cap)
        )
        # The groups of what the filter matches, until one is chosen (then the list is it),
        # and only where the kept counts answer (queue, reason): a text, time or id filter
        # would group every row it matches, through the cause function, on every page.
        where = flt.where
        counted = where.cause is None and where.grep is None and where.ids is None
        counted = counted and where.since is None and where.until is None
        causes = _causes(conn, settings.names, where) if counted else None
    more = len(rows) > settings.page_size
    rows = rows[: settings.page_size]
    first = (number - 1) * settings.page_size + 1
    return {
        "rows": rows,
        "total": total,
        "queues": queues,
        "cap": settings.count_cap,
        "causes": causes,
        "more": more,
        "first": first,
        "last": first + len(rows) - 1,
        "next": flt.query(before=rows[-1].id, page=number + 1) if more and rows else None,
    }


async def dlq_list_page(request: Request) -> Response:
    flt = parse_filter(request.query_params)
    before = _int(request.query_params.get("before"), "before")
    number = _int(request.query_params.get("page"), "page") or 1
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
        max_ids=MAX_IDS,
        **data,
    )


def _gone(request: Request, row_id: int) -> Response:
    return error_page(
        request,
        404,
        "No such dead letter",
        f"There is no DLQ row {row_id}: it may have been replayed or purged.",
    )


async def dlq_row(request: Request) -> Response:
    """A row's page; its payload shown up to `PAYLOAD_SHOWN` bytes, the whole a download."""
    settings = request.app.state.settings
    row_id = _int(str(request.path_params["row_id"]), "a row id") or 0

    def read() -> Any:
        with picked(request).database.connection() as conn:
            return dlq_show(conn, settings.names, row_id, payload_cap=PAYLOAD_SHOWN)

    entry = await run_in_threadpool(read)
    if entry is None:
        return _gone(request, row_id)
    return page(
        request,
        "dlq_row.html",
        e=entry,
        cut=entry.payload_bytes > PAYLOAD_SHOWN,
        shown_bytes=PAYLOAD_SHOWN,
        correlation=correlation(entry.headers),
        exception=StoredException.parse(entry.last_exception),
    )


async def dlq_row_payload(request: Request) -> Response:
    """A row's payload, whole, as a download: never rendered by the browser (octet-stream,
    attachment, nosniff), whatever its content type claims."""
    settings = request.app.state.settings
    row_id = _int(str(request.path_params["row_id"]), "a row id") or 0

    def read() -> bytes | None:
        with picked(request).database.connection() as conn:
            return dlq_payload(conn, settings.names, row_id)

    body = await run_in_threadpool(read)
    if body is None:
        return _gone(request, row_id)
    return Response(
        body,
        media_type="application/octet-stream",
        headers={
            "Content-Disposition": f'attachment; filename="dlq-{row_id}-payload.bin"',
            "X-Content-Type-Options": "nosniff",
        },
    )


# -- farm ------------------------------------------------------------------------------------


@dataclass
class FarmPage:
    farm: FarmView  # with the farm's health: the sampler's last reading of /healthz
    xmin: XminHolder | None
    xmin_error: str | None
    xmin_limit: float = XMIN_LIMIT


def _farm(request: Request, farm: FarmView) -> FarmPage:
    settings = request.app.state.settings
    xmin = xmin_error = None
    try:
        with picked(request).database.connection() as conn:
            xmin = DoctorProbes(conn, settings.names).xmin_holder()
    except ConnectionLost:
        xmin_error = "the database cannot be reached (the console's log says why)"
        log.warning("console: the xmin probe failed", exc_info=True)
    except OutboxFarmError as exc:
        xmin_error = scrub(str(exc))
    return FarmPage(farm, xmin, xmin_error)


async def farm(request: Request) -> Response:
    """The farm's processes, restarts, relays and health as last read by the sampler (never
    read here: a slow farm must not hold a page), and the database's xmin horizon."""
    view = request.app.state.sampler.view()
    return page(request, "farm.html", f=await run_in_threadpool(_farm, request, view))


async def farm_live(request: Request) -> Response:
    view = request.app.state.sampler.view()
    return page(request, "_farm_live.html", f=await run_in_threadpool(_farm, request, view))
