"""Pause, resume, limit a queue, or close its open breaker, from the console: two steps, as a
replay (`actions`).

1. `preview` reads what the operator asked for (a pause's reason and how long; a rate such as
   `100/s`, a most running at once and a most running of each fair key), refuses a bad value
   beside the form it came from (a rate's error is `parse_rate`'s), reads the queue's controls
   now, and shows a confirmation page ("Pause queue emails? Every farm stops claiming it
   within a second; running handlers finish.") carrying the *plan*: the change, and when the
   controls it was shown against were last changed, signed for this session by the console's
   `Signer`.
2. `run` refuses any plan it did not sign for this session, or an unconfirmed one, or one
   whose queue's controls changed since it was shown (another operator resumed it, or set
   its limits: the page shown is no longer what would be changed); then makes the change with
   the same functions as `outbox-farm queue` (`admin.queues`), naming who did it.

A limit the database has no columns for yet (a most running of each fair key before migration
0014, any limit before 0012) is refused by the admin API whole, nothing changed: the refusal,
which names the migration to run, is shown beside the limits' form as typed, as a bad value is.
A most running of each fair key is written only when set, or cleared where one is in force, so
the rate and the most running are still set on a database without 0014.

Closing a breaker closes it as a probe's success would (`admin.queues.close_breaker`): every farm
claims the queue again within a second. One that closed by itself while the confirmation was
open is no error: the page says nothing was changed.

A pause "for 30m" lasts 30 minutes from the confirmation, on the database's clock (the clock
every farm judges a pause's end by); a pause "until 18:00" (UTC, as every page shows times,
unless the time says otherwise) ends then, and is refused when that time has passed.

Every change is logged (logger `outbox_farm.console`) as a replay is: `console_action_start`
before anything is changed, `console_action` when it ends, however it ends, with who did it
and from where, the queue and the change, and the error if any.
"""

from __future__ import annotations

import logging
import time

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..admin.queues import (
    UNCHANGED,
    QueueState,
    check_queue,
    close_breaker,
    limit_queue,
    pause_queue,
    queue_state,
    resume_queue,
)
from ..db.connect import Connection
from ..db.dlq import now as database_now
from ..errors import ConfigurationError, SchemaError
from ..names import TableNames
from . import queue_changes as changes
from .login import checked_form, client_address, who
from .pages import page
from .picked import picked, plan_key, root
from .queue_changes import Change
from .queues import NOT_MIGRATED, QueuePage, queue_path, render_queue
from .security import Signer

log = logging.getLogger("outbox_farm.console")
PLAN_SECONDS = 3600.0  # a confirmation page older than this must be asked for again


async def preview(request: Request) -> Response:
    form = await checked_form(request)
    typed = changes.typed(form)
    try:
        queue = check_queue(str(form.get("queue") or "").strip())
    except ConfigurationError as exc:
        return page(request, "error.html", status=400, title="Not possible", message=str(exc))
    settings = request.app.state.settings

    def read() -> tuple[Change | None, QueueState | None, str | None]:
        """(the change, the state it is shown against, None) or (None, state, why not)."""
        with picked(request).database.connection() as conn:
            try:
                state = queue_state(conn, settings.names, queue)
            except SchemaError:
                return None, None, NOT_MIGRATED
            try:
                change = changes.parse_change(
                    str(form.get("action") or ""), queue, typed, form.get("clear") == "yes"
                )
                if change.until is not None and change.until <= database_now(conn, settings.names):
                    raise ConfigurationError(
                        f"{change.until.isoformat()} has passed: pause until a time to come, "
                        "or for a duration (e.g. 30m)"
                    )
            except ConfigurationError as exc:
                return None, state, str(exc)
            return change, state, None

    change, state, refused = await run_in_threadpool(read)
    if state is None:  # no controls table: the queue's page says what to run
        return render_queue(request, QueuePage(queue, None, error=refused), status=503)
    if change is None:  # a bad value: refused beside its form, as typed
        shown = QueuePage(queue, state, refused=refused, form=typed)
        return render_queue(request, shown, status=400)
    signer: Signer = request.app.state.signer
    plan = signer.sign_plan(plan_key(request), changes.plan(change, state) | {"made": time.time()})
    return page(
        request,
        "queue_confirm.html",
        c=change,
        state=state,
        unchanged=changes.unchanged(change, state),
        plan=plan,
        back=root(request) + queue_path(queue),
    )


def _refused(
    request: Request, message: str, status: int = 400, back: str | None = None
) -> Response:
    """An error page whose Back link goes to `back`, or to the database's queues."""
    back = back if back is not None else root(request) + "/queues"
    return page(request, "error.html", status=status, title="Not done", message=message, back=back)


NOT_OPEN = (
    "its breaker was not open any more (a probe's success had closed it): nothing was changed"
)


def _act(
    conn: Connection, names: TableNames, change: Change, now: QueueState, by: str
) -> tuple[QueueState, str | None]:
    """Make `change` to the controls `now`: the controls after it, and a note when it changed
    nothing."""
    if change.action == "close-breaker":
        closed = close_breaker(conn, names, change.queue, by=by)
        return closed.state, None if closed.was_open else NOT_OPEN
    if change.action == "limit":
        try:
            return _limit(conn, names, change, now, by), None
        except SchemaError as exc:
            raise Unmigrated(now, str(exc)) from exc
    return _change(conn, names, change, by), None


def _limit(
    conn: Connection, names: TableNames, change: Change, now: QueueState, by: str
) -> QueueState:
    """The limits of `change`; the most running of each fair key only when it is set or one in
    force is cleared: a database without migration 0014 refuses any write of it."""
    limits = change.limits
    keep_keys = limits.key_max_running is None and now.limits.key_max_running is None
    return limit_queue(
        conn,
        names,
        change.queue,
        rate=limits.rate,
        max_running=limits.max_running,
        key_max_running=UNCHANGED if keep_keys else limits.key_max_running,
        by=by,
    )


def _change(conn: Connection, names: TableNames, change: Change, by: str) -> QueueState:
    if change.action == "pause":
        return pause_queue(
            conn,
            names,
            change.queue,
            until=change.until,
            seconds=change.lasting,
            reason=change.reason,
            by=by,
        )
    return resume_queue(conn, names, change.queue, by=by)


class Moved(Exception):
    """The queue's controls changed since the confirmation was shown: nothing was done."""

    def __init__(self, state: QueueState) -> None:
        super().__init__("its controls changed since this confirmation was shown")
        self.state = state


class Unmigrated(Exception):
    """The database lacks the columns of a limit (the admin API's SchemaError, whose message
    says which migration to run): nothing was done. `state`: the controls, unchanged."""

    def __init__(self, state: QueueState, message: str) -> None:
        super().__init__(message)
        self.state = state


def _log(request: Request, actor: str, change: Change, event: str, error: str | None) -> None:
    address = client_address(request)
    ending = "started" if event == "console_action_start" else "done"
    if error:
        ending = f"failed: {error}"
    log.info(
        "console %s by %s from %s of queue %r%s (%s): %s",
        change.action,
        actor,
        address,
        change.queue,
        "" if picked(request).name is None else f" of database {picked(request).name}",
        change.describe(),
        ending,
        extra={
            "event": event,
            "who": actor,
            "database": picked(request).name,
            "client": address,
            "action": change.action,
            "selection": f"queue {change.queue!r}",
            "queue": change.queue,
            "change": change.describe(),
            "error": error,
        },
    )


async def run(request: Request) -> Response:
    form = await checked_form(request)
    signer: Signer = request.app.state.signer
    plan = signer.read_plan(plan_key(request), str(form.get("plan") or ""))
    if (
        plan is None
        or plan.get("kind") != changes.KIND
        or time.time() - float(plan.get("made", 0)) > PLAN_SECONDS
    ):
        return _refused(
            request,
            "this confirmation does not come from a page of this session (or is over an hour "
            "old); nothing was changed: start again from the queue's page",
        )
    change = changes.change_of(plan)
    back = root(request) + queue_path(change.queue)
    if form.get("confirm") != "yes":
        return _refused(request, "the change was not confirmed; nothing was changed", back=back)
    settings = request.app.state.settings
    actor = who(request)

    def act() -> tuple[QueueState, str | None]:
        with picked(request).database.connection() as conn:
            now = queue_state(conn, settings.names, change.queue)
            # Another operator's change since the page was shown: what the page promised is
            # no longer what this would do. (A change in the instant between this read and
            # the write below is not caught: the log names both.)
            if changes.iso(now.changed_at) != plan["seen"]:
                raise Moved(now)
            return _act(conn, settings.names, change, now, actor)

    _log(request, actor, change, "console_action_start", None)
    error: str | None = None
    try:
        state, note = await run_in_threadpool(act)
    except Moved as exc:
        error = "refused: " + str(exc)
        by = f" by {exc.state.changed_by}" if exc.state.changed_by else ""
        message = (
            f"the controls of queue {change.queue} changed since this confirmation was shown"
            f"{by}: nothing was changed; look at them again on the queue's page"
        )
        return _refused(request, message, 409, back)
    except Unmigrated as exc:  # beside the limits' form, as typed, to send again once migrated
        error = f"refused: {exc}"
        form = changes.limits_form(change.limits)
        shown = QueuePage(change.queue, exc.state, refused=str(exc), form=form)
        return render_queue(request, shown, status=503)
    except SchemaError as exc:  # its message names the migration missing, and what to run
        error = f"refused: {exc}"
        return _refused(request, str(exc), 503, back)
    except ConfigurationError as exc:  # a pause's end that passed while the page was open
        error = f"refused: {exc}"
        return _refused(request, str(exc), 400, back)
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        _log(request, actor, change, "console_action", error)
    return page(request, "queue_done.html", c=change, state=state, note=note, back=back)
