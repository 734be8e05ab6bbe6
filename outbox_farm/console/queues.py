"""The pages of the queues' controls: every queue an operator paused or limited, or whose
breaker is open or counting (`/queues`), and one queue's page (`/queues/{queue}`) with its
state and the forms that pause, resume and limit it (a rate, a most running, a most running of
each fair key) and close its open breaker (the actions themselves are `queue_actions`).

The state comes from the same functions as `outbox-farm queue list` (`admin.queues`). A
database not yet migrated to the controls' table is no error page: every page that shows
controls says "run `outbox-farm migrate`" where they would be, and offers no action
(`Controls.error`), while the rest of the page (the overview's counts) is served as before.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from ..admin.queues import QueueState, check_queue, queue_state, queue_states
from ..db.connect import Connection
from ..errors import ConfigurationError, SchemaError
from ..names import TableNames
from .pages import page
from .picked import picked, root

NOT_MIGRATED = (
    "this database has no table of queue controls yet (or an older one): run "
    "`outbox-farm migrate` to pause, resume and limit queues here"
)


@dataclass
class Controls:
    """The controls of the queues read for a page, by queue, or why none could be read."""

    by_queue: dict[str, QueueState] = field(default_factory=dict)
    error: str | None = None

    def of(self, queue: str) -> QueueState | None:
        return self.by_queue.get(queue)

    def active(self) -> list[str]:
        """The queues paused now, limited or held by an open breaker: the ones a page must
        never leave out."""
        return sorted(q for q, s in self.by_queue.items() if s.paused or s.limits or s.breaker.open)


def read_controls(conn: Connection, names: TableNames) -> Controls:
    """Every queue's controls; a database without their table is `Controls.error`, not an
    exception, so the page that shows them still renders."""
    try:
        return Controls({s.queue: s for s in queue_states(conn, names)})
    except SchemaError:
        return Controls(error=NOT_MIGRATED)


def queue_path(queue: str) -> str:
    """The path of a queue's page: any name, '/' and '?' included, quoted whole."""
    return "/queues/" + urllib.parse.quote(queue, safe="")


@dataclass
class QueuePage:
    """One queue's page: its state (None: not read, see `error`) and the limits' form as
    shown, typed values echoed back after a refusal."""

    queue: str
    state: QueueState | None
    error: str | None = None  # the controls could not be read: what to do
    refused: str | None = None  # what the operator typed was refused: why
    form: dict[str, str] = field(default_factory=dict)

    def value(self, name: str) -> str:
        """A field of the forms: as typed when refused, else what is in force now."""
        if name in self.form:
            return self.form[name]
        limits = self.state.limits if self.state is not None else None
        if name == "rate" and limits is not None and limits.rate is not None:
            return str(limits.rate)
        if name == "max_running" and limits is not None and limits.max_running is not None:
            return str(limits.max_running)
        if name == "key_max_running" and limits is not None and limits.key_max_running is not None:
            return str(limits.key_max_running)
        return ""


def read_queue(request: Request, queue: str) -> tuple[QueueState | None, str | None]:
    """(the state of `queue`, None) or (None, why it cannot be read)."""
    settings = request.app.state.settings
    with picked(request).database.connection() as conn:
        try:
            return queue_state(conn, settings.names, queue), None
        except SchemaError:
            return None, NOT_MIGRATED


def render_queue(request: Request, shown: QueuePage, status: int = 200) -> Response:
    return page(request, "queue.html", status=status, q=shown)


async def queue_page(request: Request) -> Response:
    try:
        queue = check_queue(str(request.path_params["queue"]))
    except ConfigurationError as exc:
        return page(request, "error.html", status=400, title="No such queue", message=str(exc))
    state, error = await run_in_threadpool(read_queue, request, queue)
    return render_queue(request, QueuePage(queue, state, error))


async def queue_list(request: Request) -> Response:
    """Every queue with controls (paused, limited, or once so); `?queue=NAME` opens a queue's
    page, for a queue that has none yet (a pause may be set ahead of its first row)."""
    wanted = str(request.query_params.get("queue") or "").strip()
    if wanted:
        try:
            return RedirectResponse(
                root(request) + queue_path(check_queue(wanted)), status_code=303
            )
        except ConfigurationError as exc:
            return page(request, "error.html", status=400, title="No such queue", message=str(exc))
    settings = request.app.state.settings

    def read() -> Controls:
        with picked(request).database.connection() as conn:
            return read_controls(conn, settings.names)

    controls = await run_in_threadpool(read)
    states = [controls.by_queue[q] for q in sorted(controls.by_queue)]
    return page(request, "queues.html", controls=controls, states=states)
