"""The harness's tables, named once: the outbox and DLQ of every scratch database the load
test, the chaos and scale suites and the benchmarks make.

A farm under test, a producer, a check and a benchmark's own SQL must all mean the same
tables; `query` writes them into a statement as quoted identifiers, so that none is spelled
by hand.
"""

from __future__ import annotations

import re

from outbox_farm.names import TableNames

OUTBOX = "outbox"
DLQ = "outbox_dlq"
NAMES = TableNames.build(OUTBOX, DLQ)

_QUOTED = {key: value.as_string(None) for key, value in NAMES.identifiers().items()}
_FIELD = re.compile(r"\{(\w+)\}")


def query(text: str) -> str:
    """`text` with `{outbox}`, `{dlq}` and the DLQ's derived objects (`{dlq_causes}`,
    `{dlq_cause_fn}`, ...: `TableNames.identifiers`) written in. Other braces, a JSON literal's,
    are left alone, so a statement keeps its `%s` and `%(name)s` parameters and its literals."""
    return _FIELD.sub(lambda field: _QUOTED.get(field.group(1), field.group(0)), text)
