"""The `outbox-farm` command line.

Each command lives in the module of its kind (`schema`, `start`, `ops`, `queues`, `dlq`) and
only reads options and prints; what it runs lives outside this package, all but the log set-up
(`log_setup`), which only the commands that run a process need. The group below is the one
place where the library's errors become the command line's: one line, exit status 1, with
every fragment of the DSN's secret masked (whatever libpq or a client library quoted).
"""

from __future__ import annotations

from typing import Any

import click

from ..dsn import scrub
from ..errors import OutboxFarmError
from .console import console
from .demo import demo
from .dlq import dlq
from .fleet import fleet
from .ops import doctor_command, stats
from .options import EPILOG
from .queues import queue
from .schema import check, migrate_command, sql
from .start import start


class _Commands(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except OutboxFarmError as exc:
            raise click.ClickException(scrub(str(exc))) from None


@click.group(cls=_Commands, epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox-farm")
def main() -> None:
    """outbox_farm: deliver every committed outbox row to its handler, at least once."""


COMMANDS = (
    migrate_command,
    check,
    sql,
    start,
    demo,
    stats,
    queue,
    dlq,
    doctor_command,
    console,
    fleet,
)
for command in COMMANDS:
    main.add_command(command)
