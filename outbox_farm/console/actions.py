"""Replay and purge from the console: always two steps, the dry run first.

1. `preview` counts what the selection matches now, by queue and reason (`dlq_summary`, the
   count `dlq replay --dry-run` prints), names the rows a replay would normalise
   (`dlq_unfit`), and shows a confirmation form carrying the highest id counted (`upto`).
2. `run` does it, bounded by that `upto`: rows that failed after the preview are not touched,
   so what is done is what the operator was shown. Same functions as `outbox-farm dlq`, batch
   by batch, each batch committed.

A selection is one row (its page), the rows ticked on a page, or the whole filter; a whole
filter that is empty (every row of the DLQ) must be confirmed as such, like `--all`. Every
action is logged (logger `outbox_farm.console`, event `console_action`) with who did it,
the selection and how many rows it touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from ..admin import DlqFilter, Done, Summary, dlq_purge, dlq_replay, dlq_summary, parse_duration
from ..admin.dlq import Unfit, dlq_unfit
from ..errors import ConfigurationError
from .views import Filter, checked_form, page, parse_filter, who

log = logging.getLogger("outbox_farm.console")
ACTIONS = ("replay", "purge")
MAX_IDS = 10_000  # rows one ticked selection may name


@dataclass(frozen=True)
class Selection:
    """What the operator asked for, as read from the form."""

    action: str
    scope: str  # "ids" (one row, or those ticked) or "filter"
    ids: tuple[int, ...]
    flt: Filter
    to_queue: str | None
    delay: float
    delay_text: str

    @property
    def where(self) -> DlqFilter:
        return DlqFilter(ids=self.ids) if self.scope == "ids" else self.flt.where

    @property
    def everything(self) -> bool:
        return self.scope == "filter" and self.flt.empty

    def describe(self) -> str:
        if self.scope == "ids":
            return "ids " + ",".join(str(i) for i in self.ids)
        return self.flt.describe()


def _selection(form: Any) -> Selection:
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
    if scope == "ids":
        if not ids:
            raise ConfigurationError("no row is selected: tick the rows first")
        if len(ids) > MAX_IDS:
            raise ConfigurationError(f"at most {MAX_IDS} rows at once; use the filter instead")
    elif scope != "filter":
        raise ConfigurationError(f"unknown scope {scope!r}: ids or filter")
    flt = parse_filter(form)
    if scope == "filter" and flt.error:
        raise ConfigurationError(flt.error)
    to_queue = str(form.get("to_queue") or "").strip() or None
    if to_queue is not None and "\x00" in to_queue:
        raise ConfigurationError("the queue name holds a NUL character")
    delay_text = str(form.get("delay") or "").strip()
    delay = parse_duration(delay_text) if delay_text else 0.0
    if action == "purge":
        to_queue, delay, delay_text = None, 0.0, ""
    return Selection(action, scope, tuple(sorted(set(ids))), flt, to_queue, delay, delay_text)


def _refused(request: Request, message: str) -> Response:
    return page(request, "error.html", status=400, title="Not possible", message=message)


async def preview(request: Request) -> Response:
    form = await checked_form(request)
    try:
        chosen = _selection(form)
    except ConfigurationError as exc:
        return _refused(request, str(exc))
    settings = request.app.state.settings

    def count() -> tuple[Summary, Unfit | None]:
        with settings.database.connection() as conn:
            summary = dlq_summary(conn, settings.names, chosen.where)
            unfit = None
            if chosen.action == "replay" and summary.rows:
                unfit = dlq_unfit(conn, settings.names, chosen.where, upto=summary.upto)
            return summary, unfit

    summary, unfit = await run_in_threadpool(count)
    return page(request, "confirm.html", s=chosen, summary=summary, unfit=unfit)


async def run(request: Request) -> Response:
    form = await checked_form(request)
    try:
        chosen = _selection(form)
        upto = int(str(form.get("upto") or ""))
        shown = int(str(form.get("expected") or ""))
    except (ConfigurationError, ValueError) as exc:
        return _refused(request, f"{exc}; start again from the dead letters page")
    if form.get("confirm") != "yes":
        return _refused(request, "the action was not confirmed; nothing was changed")
    if chosen.everything and form.get("all_rows") != "yes":
        return _refused(
            request,
            "this would act on every row of the DLQ: tick \u201cyes, every row\u201d to confirm",
        )
    settings = request.app.state.settings
    actor = who(request)

    def act() -> Done:
        with settings.database.connection() as conn:
            if chosen.action == "replay":
                return dlq_replay(
                    conn,
                    settings.names,
                    chosen.where,
                    to_queue=chosen.to_queue,
                    delay=chosen.delay,
                    upto=upto,
                )
            return dlq_purge(conn, settings.names, chosen.where, upto=upto)

    done = await run_in_threadpool(act)
    target = f" to queue {chosen.to_queue}" if chosen.to_queue else ""
    delay = f", due in {chosen.delay_text}" if chosen.delay else ""
    log.info(
        "console %s by %s of %s (%d shown): %d row(s) in %d batch(es)%s%s",
        chosen.action,
        actor,
        chosen.describe(),
        shown,
        done.rows,
        done.batches,
        target,
        delay,
        extra={
            "event": "console_action",
            "who": actor,
            "action": chosen.action,
            "selection": chosen.describe(),
            "rows": done.rows,
            "shown": shown,
            "to_queue": chosen.to_queue,
            "delay": chosen.delay,
        },
    )
    return page(request, "done.html", s=chosen, done=done, shown=shown)
