"""The DLQ commands' filters (--queue, --reason, --since, --until, --grep, --cause) and the rule
for what `replay` and `purge` select with them.

A filter given empty or blank, on the command line or as a variable set to nothing, is
refused, whichever filter it is: an empty text is in every row, and a script whose variable
was unset (`--grep "$PATTERN"`) would otherwise purge the whole DLQ.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from ..admin import DlqFilter, When
from ..admin.dlq import REASONS, Selection, check_reason
from ..errors import ConfigurationError
from .options import merged, when


def _filter(
    queue: str | None,
    reason: str | None,
    since: When | None,
    until: When | None,
    grep: str | None,
    cause: str | None,
) -> DlqFilter:
    return DlqFilter(queue=queue, reason=reason, since=since, until=until, grep=grep, cause=cause)


Callback = Callable[[click.Context, click.Parameter, Any], Any]


def _given(then: Callback | None = None) -> Callback:
    """A filter option's callback: refuse it empty or blank, given on the command line or as
    its variable (click drops an empty variable itself, so the environment is read here),
    then convert it with `then`."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        envvar = param.envvar if isinstance(param.envvar, str) else None
        text = value if value is not None else os.environ.get(envvar or "")
        if isinstance(text, str) and not text.strip():
            typed = ctx.get_parameter_source(param.name or "")
            where = (
                f"{envvar} is set but empty"
                if value is None or typed is not click.core.ParameterSource.COMMANDLINE
                else "it is empty"
            )
            raise click.BadParameter(
                f"{where}: an empty filter would select every row (or none). Give a value, "
                f"or leave the filter out{' and unset the variable' if envvar else ''}; "
                "to replay or purge every row, say --all",
                ctx,
                param,
            )
        return then(ctx, param, value) if then is not None else value

    return check


def _reason(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    try:
        check_reason(value)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None
    return value


# --queue, --reason, --since, --until, --grep and --cause as the command's one `where`.
filter_options = merged(
    "where",
    _filter,
    click.option(
        "--queue",
        callback=_given(),
        default=None,
        envvar="OUTBOX_FARM_QUEUE",
        help="Only rows of this queue. [env OUTBOX_FARM_QUEUE]",
    ),
    click.option(
        "--reason",
        callback=_given(_reason),
        default=None,
        metavar="REASON",
        envvar="OUTBOX_FARM_REASON",
        help=f"Only rows that failed for this reason: {', '.join(REASONS)}. "
        "[env OUTBOX_FARM_REASON]",
    ),
    click.option(
        "--since",
        callback=_given(when),
        default=None,
        metavar="WHEN",
        envvar="OUTBOX_FARM_SINCE",
        help="Only rows that failed at or after this: a duration ago (2h, 7d; on the "
        "database clock) or an ISO-8601 time. [env OUTBOX_FARM_SINCE]",
    ),
    click.option(
        "--until",
        callback=_given(when),
        default=None,
        metavar="WHEN",
        envvar="OUTBOX_FARM_UNTIL",
        help="Only rows that failed before this (same forms as --since). [env OUTBOX_FARM_UNTIL]",
    ),
    click.option(
        "--grep",
        callback=_given(),
        default=None,
        metavar="TEXT",
        envvar="OUTBOX_FARM_GREP",
        help="Only rows whose exception or headers contain TEXT (any case), or whose "
        "payload contains its bytes. [env OUTBOX_FARM_GREP]",
    ),
    click.option(
        "--cause",
        callback=_given(),
        default=None,
        metavar="CAUSE",
        envvar="OUTBOX_FARM_CAUSE",
        help="Only rows of this cause, exactly as `dlq list --group` shows it (the "
        "exception with ids and numbers replaced). [env OUTBOX_FARM_CAUSE]",
    ),
)
FILTERS = ("queue", "reason", "since", "until", "grep", "cause")


def selected(where: DlqFilter, ids: tuple[int, ...], every: bool, verb: str) -> DlqFilter:
    """`where` with the IDs; replay and purge never act on the whole DLQ by accident: IDs, a
    filter, or --all, on the command line. A filter read from the environment (say
    OUTBOX_FARM_QUEUE, set for `stats`) narrows the selection but never makes one."""
    context = click.get_current_context()
    typed = any(
        context.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
        for name in (*FILTERS, "older_than")  # purge's --older-than is a filter too
    )
    filters = "--queue, --reason, --since, --until, --grep, --cause"
    try:
        selection = Selection.of(
            ids,
            where,
            every,
            verb=verb,
            filtered=typed,
            every_is="--all",
            filters_are=filters + (", --older-than" if verb == "purge" else ""),
            asked_in=" on the command line",
        )
    except ConfigurationError as exc:
        raise click.UsageError(str(exc)) from None
    return selection.where
