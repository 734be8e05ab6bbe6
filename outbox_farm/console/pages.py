"""How every answer of the console is rendered: a page (or, for htmx, a fragment), and the
one place where an error becomes what a person reads.

`page` fills in what every template needs (who is asking, the CSRF token, read-only). An
error reaches `database_error` from any route: a value the database refuses (a number or
time out of its range) is the operator's to fix, 400; a statement cut by the console's
`statement_timeout` asks for a narrower filter; anything else from the database is 503 (the
next request tries again). A request made by htmx for a live part gets a small fragment
instead of a whole page, so the part says what failed rather than freezing on its last
numbers (htmx is configured in `base.html` to swap error answers too).
"""

from __future__ import annotations

import logging
from html import escape
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from ..dsn import scrub
from ..errors import ConfigurationError, ConnectionLost

log = logging.getLogger("outbox_farm.console")
DATA_EXCEPTION = "22"  # SQLSTATE class: a value out of range, a bad time, ...
QUERY_CANCELED = "57014"  # statement_timeout ended the statement


def is_live(request: Request) -> bool:
    """Whether htmx asked, for a live part of a page: it wants a fragment, not a page."""
    return request.headers.get("hx-request") == "true"


def fragment(message: str, status: int) -> Response:
    """A live part's error, as a fragment htmx swaps in place of the part's numbers."""
    return HTMLResponse(
        f'<p class="bad live-error" id="live-error">{escape(message)}</p>', status_code=status
    )


def page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
    """Template `name` rendered with `context` and what every page needs: who is asking,
    the session's CSRF token, whether the console is read-only, the live refresh period."""
    settings = request.app.state.settings
    context.update(
        request=request,
        who=getattr(request.state, "who", None),
        csrf=getattr(request.state, "csrf", ""),
        read_only=settings.read_only,
        tokens_required=settings.tokens.required,
        live_every_ms=int(settings.live_every * 1000),
    )
    found = getattr(request.state, "picked", None)
    sets = request.app.state.sets
    context.setdefault("root", found.root if found is not None else "")
    context.setdefault("database", found.name if found is not None else None)
    context.setdefault("databases", sets.names() if sets is not None else None)
    templates = request.app.state.templates
    return templates.TemplateResponse(request, name, context, status_code=status)  # type: ignore[no-any-return]


def error_page(request: Request, status: int, title: str, message: str) -> Response:
    """An error as a page, or as a fragment when a live part asked."""
    if is_live(request):
        return fragment(f"{title}: {message}", status)
    return page(request, "error.html", status, title=title, message=message)


async def database_error(request: Request, exc: Exception) -> Response:
    """The database refused or could not be reached: what the operator can do about it. A
    page never names the server: its address is for the log."""
    if isinstance(exc, ConfigurationError):
        return error_page(request, 400, "Not possible", str(exc))
    sqlstate = getattr(exc, "sqlstate", None) or ""
    message = scrub(str(exc))
    if sqlstate.startswith(DATA_EXCEPTION):
        return error_page(request, 400, "The database refused a value", message)
    if sqlstate == QUERY_CANCELED:
        log.info("console: a statement ran out of time", extra={"event": "console_timeout"})
        return error_page(
            request,
            503,
            "That took too long",
            "The database stopped the query at the console's time limit: narrow the filter "
            "(a queue, a reason, a shorter time range) and try again.",
        )
    log.warning("console: %s", message, extra={"event": "console_database_error"})
    if isinstance(exc, ConnectionLost):  # its message names the server: the log has it
        message = "The database cannot be reached (the console's log says why); reload to retry."
    return error_page(request, 503, "The database did not answer", message)
