"""Replay and purge from the console: always two steps, the dry run first, and the second
does only what the first showed.

1. `preview` resolves the selection (times given as "2h ago" become times on the database's
   clock), counts what it matches with `dlq_preview` (a count no row can join afterwards:
   see there), names the rows a replay would normalise (`dlq_unfit`), and shows a
   confirmation form carrying the *plan*: action, selection, absolute times, the id bound
   `upto` and the count, signed for this session by the console's `Signer`.
2. `run` refuses any plan it did not sign for this session, counts again within `upto` and
   refuses when more rows match than the dry run showed, then acts with the same functions
   as `outbox-farm dlq`, batch by batch, each batch committed. Fewer rows than shown is
   fine (someone replayed, purged or expired some meanwhile) and the done page says so.

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
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..admin import DlqFilter, Done, When, dlq_purge, dlq_replay, dlq_summary, parse_duration
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
from .login import checked_form, client_address, who
from .pages import page
from .security import Signer
from .views import Filter, parse_filter

log = logging.getLogger("outbox_farm.console")
ACTIONS = ("replay", "purge")
MAX_IDS = 10_000  # rows one ticked selection may name
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
            raise ConfigurationError(f"at most {MAX_IDS} rows at once; use the filter instead")
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


def _when(point: When | None) -> str | None:
    return point.at.isoformat() if point is not None and point.at is not None else None


def _plan(chosen: Choice, where: DlqFilter, preview: Preview) -> dict[str, Any]:
    return {
        "action": chosen.action,
        "scope": chosen.scope,
        "everything": chosen.everything,
        "ids": list(where.ids or ()),
        "queue": where.queue,
        "reason": where.reason,
        "since": _when(where.since),
        "until": _when(where.until),
        "grep": where.grep,
        "upto": preview.summary.upto,
        "expected": preview.summary.rows,
        "made": time.time(),
    }


def _where(plan: dict[str, Any]) -> DlqFilter:
    def point(text: Any) -> When | None:
        return When(at=datetime.fromisoformat(text)) if isinstance(text, str) else None

    return DlqFilter(
        ids=tuple(plan["ids"]) or None,
        queue=plan["queue"],
        reason=plan["reason"],
        since=point(plan["since"]),
        until=point(plan["until"]),
        grep=plan["grep"],
    )


async def preview(request: Request) -> Response:
    form = await checked_form(request)
    try:
        chosen = _choice(form)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    settings = request.app.state.settings

    def count() -> tuple[DlqFilter, Preview, Unfit | None]:
        with settings.database.connection() as conn:
            where = dlq_resolved(conn, settings.names, chosen.selection.where)
            found = dlq_preview(conn, settings.names, where)
            unfit = None
            if chosen.action == "replay" and found.summary.rows:
                unfit = dlq_unfit(conn, settings.names, where, upto=found.summary.upto)
            return where, found, unfit

    where, found, unfit = await run_in_threadpool(count)
    signer: Signer = request.app.state.signer
    plan = signer.sign_plan(request.state.session, _plan(chosen, where, found))
    return page(
        request,
        "confirm.html",
        s=chosen,
        selection=describe(where),
        where=where,
        summary=found.summary,
        settled=found.settled,
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
    plan = signer.read_plan(request.state.session, str(form.get("plan") or ""))
    if plan is None or time.time() - float(plan.get("made", 0)) > PLAN_SECONDS:
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
    action, upto, shown = str(plan["action"]), int(plan["upto"]), int(plan["expected"])
    try:
        to_queue, delay, delay_text = _target(form, action)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    where = _where(plan)
    selection = describe(where)
    settings = request.app.state.settings
    actor = who(request)
    tally = _Tally()

    def act() -> Done | int:
        """What was done; or, refused before anything was, how many rows match now."""
        with settings.database.connection(statement_timeout=settings.action_timeout) as conn:
            now = dlq_summary(conn, settings.names, where, upto=upto).rows
            if now > shown:
                return now
            if action == "replay":
                return dlq_replay(
                    conn,
                    settings.names,
                    where,
                    to_queue=to_queue,
                    delay=delay,
                    upto=upto,
                    progress=tally.add,
                )
            return dlq_purge(conn, settings.names, where, upto=upto, progress=tally.add)

    _log_start(request, actor, action, selection, plan)
    error: str | None = None
    try:
        done = await run_in_threadpool(act)
        if isinstance(done, int):
            error = f"refused: {done} rows match now, more than the {shown} shown"
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
    if isinstance(done, int):
        return _refused(
            request,
            f"{done} rows now match within the ids the dry run counted, more than the "
            f"{shown} it showed; nothing was changed: run the dry run again",
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
        back=_back(where),
    )


def _back(where: DlqFilter) -> str:
    """The dead letters page of the filter acted on (none for ids)."""
    if where.ids:
        return "/dlq"
    items = {
        "queue": where.queue,
        "reason": where.reason,
        "since": _when(where.since),
        "until": _when(where.until),
        "text": where.grep,
    }
    return "/dlq?" + urllib.parse.urlencode({k: v for k, v in items.items() if v})
