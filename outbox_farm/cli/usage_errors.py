"""How a value the user gave is refused: a usage error (exit status 2) naming the option.

Anything that fails later is an `OutboxFarmError`, which the `outbox-farm` group reports as one
line with exit status 1. Its own module because the shared options, the reading of a fleet's
set (which the options are built on) and the commands all refuse a value this one way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click

from ..errors import ConfigurationError, OutboxFarmError

T = TypeVar("T")


@contextmanager
def usage_error(hint: str | None = None) -> Iterator[None]:
    """A ConfigurationError in the block is the user's value at fault: a usage error, naming
    the option (`hint`) when one is to blame."""
    try:
        yield
    except ConfigurationError as exc:
        if hint is None:
            raise click.UsageError(str(exc)) from None
        raise click.BadParameter(str(exc), param_hint=hint) from None


def parsed(parse: Callable[[str], T]) -> Callable[[click.Context, click.Parameter, Any], T | None]:
    """An option callback: the value through `parse`, whose OutboxFarmError is a bad value of
    this option; a missing value stays None."""

    def callback(ctx: click.Context, param: click.Parameter, value: str | None) -> T | None:
        if value is None:
            return None
        try:
            return parse(value)
        except OutboxFarmError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None

    return callback
