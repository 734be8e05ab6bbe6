"""`demo`: see the farm move messages, in seconds, before writing any code."""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

import click

from ..demo.app import farm as demo_farm
from ..demo.run import publish, run_farm
from ..dsn import redact
from ..ops.embedded import data_dir
from ..ops.server import resolve
from ..settings import DEFAULT_BIND
from .options import EPILOG, demo_dsn_options
from .output import notice


def dlq_list_command(dsn: str | None) -> str:
    """The `outbox-farm dlq list` that reaches the server the demo ran on, given as the demo
    was given it: the same environment, the same --dsn-file, the same --dsn (its password
    masked), or the same embedded server (--embedded: the data directory is found from the
    working directory, so the command must run from the same one)."""
    command = f"outbox-farm dlq list --dlq-table {demo_farm.names.dlq}"
    context = click.get_current_context()
    typed = click.core.ParameterSource.COMMANDLINE
    if dsn is None:
        return f"{command} --embedded` (from this directory: the embedded server at {data_dir()})"
    if context.get_parameter_source("dsn_file") is typed:
        return f"{command} --dsn-file {shlex.quote(str(context.params['dsn_file']))}`"
    if context.get_parameter_source("dsn") is typed:
        shown = redact(dsn)
        masked = " (your password in place of ***)" if shown != dsn else ""
        return f"{command} --dsn {shlex.quote(shown)}`{masked}"
    return f"{command}` (with the same OUTBOX_FARM_DSN or OUTBOX_FARM_DSN_FILE)"


@click.command(epilog=EPILOG)
@demo_dsn_options
@click.option(
    "--messages",
    type=click.IntRange(1, 10_000_000),
    default=20_000,
    show_default=True,
    envvar="OUTBOX_FARM_DEMO_MESSAGES",
    help="Messages to publish and deliver. [env OUTBOX_FARM_DEMO_MESSAGES]",
)
@click.option(
    "--procs",
    type=click.IntRange(1, 64),
    default=2,
    show_default=True,
    envvar="OUTBOX_FARM_DEMO_PROCS",
    help="Worker processes of the demo farm. [env OUTBOX_FARM_DEMO_PROCS]",
)
def demo(dsn: str | None, messages: int, procs: int) -> None:
    """Publish messages and watch a real farm deliver them.

    Creates the demo's own tables (outbox_demo, outbox_demo_dlq; your outbox is not touched),
    publishes --messages messages, starts `outbox-farm start --procs N` on
    outbox_farm.demo.app (every 50th message fails once and is retried, every 1,000th goes to
    the DLQ), prints its progress every second from its /metrics, stops it and sums up.
    Without --dsn it runs on the embedded Postgres under ./.outbox-farm/.
    """
    with resolve(dsn, notice) as url, tempfile.TemporaryDirectory(prefix="outbox-farm-") as tmp:
        with click.progressbar(length=messages, label="publishing") as bar:
            publish(url, messages, bar.update)
        click.echo(f"starting outbox-farm start --procs {procs} on outbox_farm.demo.app ...")
        summary = run_farm(url, messages, procs, click.echo, Path(tmp))
    lag = (
        f"{summary.lag_p50 * 1000:,.0f} ms / {summary.lag_p99 * 1000:,.0f} ms"
        if summary.lag_p50 is not None and summary.lag_p99 is not None
        else "-"
    )
    rate = summary.messages / summary.seconds if summary.seconds > 0 else 0.0
    click.echo(
        f"\ndone: {summary.messages:,} messages in {summary.seconds:.1f}s "
        f"({rate:,.0f} msg/s with --procs {procs})\n"
        f"  acked {summary.acked:,.0f}, retried {summary.retried:,.0f}, "
        f"dead-lettered {summary.dead_lettered:,.0f}: see them with `{dlq_list_command(dsn)}\n"
        f"  delivery lag p50 / p99: {lag} (publish to handler start; the backlog waited)\n"
        f"  the demo farm served its metrics at {summary.metrics_url} (a free port) while it "
        f"ran; `outbox-farm start` serves /metrics and /healthz on {DEFAULT_BIND} unless told "
        "otherwise (--metrics-bind)"
    )
