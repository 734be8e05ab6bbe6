"""Replay and purge from the console: always two steps, the dry run first, and the second
does only what the first showed.

1. `preview` resolves the selection (times given as "2h ago" become times on the database's
   clock), counts what it matches with `dlq_preview` (waiting for writers that were open at
   the count: see there), reads the ids of those rows, names the rows a replay would
   normalise (`dlq_unfit`), and shows a confirmation form carrying the *plan*: action,
   selection, absolute times, the id bound `upto` and the set of rows (their ids, or their
   digest: `plans`), signed for this session by the console's `Signer`.
2. `run` refuses any plan it did not sign for this session, then acts on the plan's rows
   only, with the same functions as `outbox-farm dlq`, chunk by chunk, each committed; a
   digest plan is refused when the set it names changed. Fewer rows than shown is fine
   (someone replayed, purged or expired some meanwhile) and the done page says so; a row
   the dry run did not show is never touched.

A selection is one row (its page), the rows ticked on a page, or the whole filter; a whole
filter that is empty (every row of the DLQ) must be confirmed as such, like `--all`: the rule
is `admin.dlq.Selection`, the CLI's. Every action is logged (logger `outbox_farm.console`)
twice: `console_action_start` before anything is changed, and `console_action` when it ends,
however it ends, with who did it and from where, the selection, the rows done so far and the
error if any.
"""

from __future__ import annotations

import logging
import time
import urllib.parse
from dataclasses import dataclass, replace
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..admin import DlqFilter, Done, dlq_summary, parse_duration
from ..admin.dlq import (
    MAX_QUEUE,
    Preview,
    Selection,
    Unfit,
    dlq_preview,
    dlq_resolved,
    dlq_unfit,
)
from ..errors import ConfigurationError
from . import plans
from .limits import MAX_IDS, too_many_ids
from .login import checked_form, client_address, who
from .pages import page
from .picked import picked, plan_key, root
from .security import Signer
from .views import Filter, parse_filter

log = logging.getLogger("outbox_farm.console")
ACTIONS = ("replay", "purge")
PLAN_SECONDS = 3600.0  # a confirmation page older than this must be previewed again


@dataclass(frozen=True)
class Choice:
    """What the operator asked for: the action, the selection and (replay) where to."""

    action: str
    scope: str  # "ids" (one row, or those ticked) or "filter"
    selection: Selection
    flt: Filter  # as typed, for the links back
    to_queue: str | None
    delay: float
    delay_text: str

    @property
    def ids(self) -> tuple[int, ...]:
        return self.selection.where.ids or ()

    @property
    def everything(self) -> bool:
        return self.selection.everything

    def describe(self) -> str:
        return describe(self.selection.where)


def describe(where: DlqFilter) -> str:
    """A selection for the log and the pages, times absolute."""
    if where.ids:
        return "ids " + ",".join(str(i) for i in where.ids)
    parts = [
        f"{name}={value!r}"
        for name, value in (
            ("queue", where.queue),
            ("reason", where.reason),
            ("since", where.since.describe() if where.since else None),
            ("until", where.until.describe() if where.until else None),
            ("text", where.grep),
            ("cause", where.cause),
        )
        if value
    ]
    return " ".join(parts) or "every row"


def _target(form: Any, action: str) -> tuple[str | None, float, str]:
    """(to_queue, delay in seconds, delay as typed) of a replay; nothing for a purge."""
    if action == "purge":
        return None, 0.0, ""
    to_queue = str(form.get("to_queue") or "").strip() or None
    if to_queue is not None and ("\x00" in to_queue or len(to_queue) > MAX_QUEUE):
        raise ConfigurationError(
            f"the queue name must be at most {MAX_QUEUE} characters, without NUL characters"
        )
    delay_text = str(form.get("delay") or "").strip()
    delay = parse_duration(delay_text) if delay_text else 0.0
    return to_queue, delay, delay_text


def _choice(form: Any) -> Choice:
    action = str(form.get("action") or "")
    if action not in ACTIONS:
        raise ConfigurationError(f"unknown action {action!r}: replay or purge")
    scope = str(form.get("scope") or "")
    ids: list[int] = []
    for value in form.getlist("ids"):
        try:
            ids.append(int(value))
        except ValueError:
            raise ConfigurationError(f"{value!r} is not a row id") from None
    flt = parse_filter(form)
    if scope == "ids":
        if not ids:
            raise ConfigurationError("no row is selected: tick the rows first")
        if len(ids) > MAX_IDS:
            raise too_many_ids()
        selection = Selection.of(ids, DlqFilter(), False, verb=action)
    elif scope == "filter":
        if flt.error:
            raise ConfigurationError(flt.error)
        selection = Selection.of((), flt.where, flt.empty, verb=action)
    else:
        raise ConfigurationError(f"unknown scope {scope!r}: ids or filter")
    return Choice(action, scope, selection, flt, *_target(form, action))


def _refused(request: Request, message: str) -> Response:
    return page(request, "error.html", status=400, title="Not possible", message=message)


async def preview(request: Request) -> Response:
    form = await checked_form(request)
    try:
        chosen = _choice(form)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    settings = request.app.state.settings

    def count() -> tuple[DlqFilter, Preview, Unfit | None, dict[str, Any]]:
        with picked(request).database.connection() as conn:
            where = dlq_resolved(conn, settings.names, chosen.selection.where)
            found = dlq_preview(conn, settings.names, where)
            upto = found.summary.upto
            ids = plans.read_ids(conn, settings.names, where, upto) if found.summary.rows else []
            # What the page shows is the set the plan names, whatever happened between the
            # count and the read of the ids.
            shown = replace(where, ids=tuple(ids))
            found = replace(found, summary=dlq_summary(conn, settings.names, shown, upto=upto))
            unfit = None
            if chosen.action == "replay" and ids:
                unfit = dlq_unfit(conn, settings.names, shown, upto=upto)
            made = plans.make(chosen.action, chosen.scope, chosen.everything, where, upto, ids)
            return where, found, unfit, made

    try:
        where, found, unfit, made = await run_in_threadpool(count)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    signer: Signer = request.app.state.signer
    plan = signer.sign_plan(plan_key(request), made | {"made": time.time()})
    return page(
        request,
        "confirm.html",
        s=chosen,
        selection=describe(where),
        where=where,
        summary=found.summary,
        settled=found.settled,
        carried=made["rows"] is not None,
        unfit=unfit,
        plan=plan,
    )


class _Tally:
    """Rows done so far by a running action: written by its worker thread, read by the
    request's coroutine once the thread has ended (or been abandoned)."""

    def __init__(self) -> None:
        self.rows = 0

    def add(self, rows: int) -> None:
        self.rows += rows


def _log_start(
    request: Request, actor: str, action: str, selection: str, plan: dict[str, Any]
) -> None:
    address = client_address(request)
    log.info(
        "console %s by %s from %s of %s started (%d shown, ids up to %d)",
        action,
        actor,
        address,
        selection,
        plan["expected"],
        plan["upto"],
        extra={
            "event": "console_action_start",
            "who": actor,
            "database": picked(request).name,
            "client": address,
            "action": action,
            "selection": selection,
            "shown": plan["expected"],
            "upto": plan["upto"],
        },
    )


async def run(request: Request) -> Response:
    form = await checked_form(request)
    signer: Signer = request.app.state.signer
    plan = signer.read_plan(plan_key(request), str(form.get("plan") or ""))
    if (
        plan is None
        or plan.get("action") not in ACTIONS  # a plan of another page (a queue's pause)
        or time.time() - float(plan.get("made", 0)) > PLAN_SECONDS
    ):
        return _refused(
            request,
            "this confirmation does not come from a dry run of this session (or is over an "
            "hour old); nothing was changed: start again from the dead letters page",
        )
    if form.get("confirm") != "yes":
        return _refused(request, "the action was not confirmed; nothing was changed")
    if plan["everything"] and form.get("all_rows") != "yes":
        return _refused(
            request,
            "this would act on every row of the DLQ: tick \u201cyes, every row\u201d to confirm",
        )
    action, shown = str(plan["action"]), int(plan["expected"])
    try:
        to_queue, delay, delay_text = _target(form, action)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    selection = describe(plans.where_of(plan))
    if picked(request).name is not None:  # a fleet's console: the log names the database
        selection = f"database {picked(request).name}: {selection}"
    settings = request.app.state.settings
    actor = who(request)
    tally = _Tally()

    def act() -> Done | None:
        """What was done; None when the set of a digest plan changed (nothing was done)."""
        with picked(request).database.connection(statement_timeout=settings.action_timeout) as conn:
            ids = plans.planned_ids(conn, settings.names, plan)
            if ids is None:
                return None
            return plans.act(
                conn, settings.names, plan, ids, to_queue=to_queue, delay=delay, progress=tally.add
            )

    _log_start(request, actor, action, selection, plan)
    error: str | None = None
    try:
        done = await run_in_threadpool(act)
        if done is None:
            error = f"refused: the {shown} rows shown are no longer the rows that match"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        address = client_address(request)
        log.info(
            "console %s by %s from %s of %s (%d shown): %d row(s) done%s",
            action,
            actor,
            address,
            selection,
            shown,
            tally.rows,
            f", then failed: {error}" if error else "",
            extra={
                "event": "console_action",
                "who": actor,
                "database": picked(request).name,
                "client": address,
                "action": action,
                "selection": selection,
                "rows": tally.rows,
                "shown": shown,
                "to_queue": to_queue,
                "delay": delay,
                "error": error,
            },
        )
    if done is None:
        return _refused(
            request,
            f"the rows this filter matches (within the ids the dry run counted) are no longer "
            f"the {shown:,} it showed; nothing was changed: run the dry run again",
        )
    return page(
        request,
        "done.html",
        action=action,
        to_queue=to_queue,
        delay=delay,
        delay_text=delay_text,
        done=done,
        shown=shown,
        back=root(request) + _back(plans.where_of(plan)),
    )


def _back(where: DlqFilter) -> str:
    """The dead letters page of the filter acted on (none for ids)."""
    if where.ids:
        return "/dlq"
    items = {
        "queue": where.queue,
        "reason": where.reason,
        "since": plans.iso(where.since),
        "until": plans.iso(where.until),
        "text": where.grep,
        "cause": where.cause,
    }
    return "/dlq?" + urllib.parse.urlencode({k: v for k, v in items.items() if v})
