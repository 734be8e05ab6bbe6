"""The tables the benchmarks print: one way to mark a target met, an absent figure, and the
code that was measured, so that reports read alike and can be compared line by line."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Row = tuple[str, str, str, str]  # measure, value, target, ok


def verdict(ok: bool | None) -> str:
    """`yes`, `NO`, or nothing when the measure has no target."""
    return {None: "", True: "yes", False: "NO"}[ok]


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def print_code(info: dict[str, Any]) -> None:
    """The commit measured, flagged when outbox_farm/ had local edits: a report of
    uncommitted code cannot be reproduced."""
    code = info["code"]
    if code["commit"]:
        print(
            f"code: {code['commit']}" + (" + local edits in outbox_farm/" if code["dirty"] else "")
        )


def print_measures(
    rows: Iterable[Row], widths: tuple[int, int, int] = (56, 16, 10), value: str = "value"
) -> None:
    """A measure / value / target / ok table under a header and a rule."""
    w_measure, w_value, w_target = widths
    header = f"{'measure':<{w_measure}} {value:>{w_value}} {'target':>{w_target}}  ok"
    print(header)
    print("-" * len(header))
    for measure, figure, target, ok in rows:
        print(f"{measure:<{w_measure}} {figure:>{w_value}} {target:>{w_target}}  {ok}")
