"""Writes reference/metrics.md from the collectors the code registers: the three registration
functions of `outbox_farm.metrics` are called and every collector they return is read back
(name, type, labels, help, how a gauge is merged across processes). Run by the `gen-files`
plugin at every build, so no name is copied by hand."""

from __future__ import annotations

import dataclasses
from typing import Any

import mkdocs_gen_files

from outbox_farm import metrics as registration
from outbox_farm.fleet.metrics import fleet_metrics

GROUPS = [
    (
        registration.metrics,
        "Every worker process",
        "Written by each worker, merged across the farm's processes at every scrape of "
        "`/metrics`. The database-derived gauges (`backlog`, `oldest_pending_age_seconds`, "
        "`dlq_rows`, `xmin_horizon_age_seconds`) are refreshed by one worker only.",
    ),
    (
        registration.relay_metrics,
        "Relays",
        "Made by the first relay batch of a process; `target` is the relay target's label "
        "(e.g. `rabbitmq:billing`, `kafka:orders.{queue}`).",
    ),
    (
        registration.supervisor_metrics,
        "The arbiter",
        "Written by the arbiter of `outbox-farm start` only.",
    ),
    (
        fleet_metrics,
        "A fleet's databases",
        "Written by the processes of a Fleet (many outboxes), each for the databases it "
        "serves: see the guide *Many outboxes* for their cardinality.",
    ),
]


def collectors(make: Any) -> list[Any]:
    """The collectors `make` registers: the fields of what it returns."""
    made = make()
    return [getattr(made, field.name) for field in dataclasses.fields(made)]


def kind(collector: Any) -> str:
    described = list(collector.describe())
    return described[0].type if described else collector._type


def exported(collector: Any) -> str:
    name = collector._name
    if kind(collector) == "counter":
        return f"{name}_total"
    return name


def row(collector: Any) -> str:
    labels = ", ".join(f"`{label}`" for label in collector._labelnames) or "-"
    typ = kind(collector)
    detail = ""
    if typ == "gauge":
        detail = f" (merged: `{collector._multiprocess_mode}`)"
    if typ == "histogram":
        bounds = ", ".join(f"{b:g}" for b in collector._upper_bounds if b != float("inf"))
        detail = f" (buckets: {bounds})"
    documentation = collector._documentation.replace("|", "\\|")
    return f"| `{exported(collector)}` | {typ}{detail} | {labels} | {documentation} |"


def render() -> str:
    out = [
        "# Metrics",
        "",
        "<!-- Generated from outbox_farm/metrics.py by docs/gen/metrics_reference.py. -->",
        "",
        "`outbox-farm start` serves these on `/metrics` (by default http://127.0.0.1:9464/metrics; "
        "`--metrics-bind`), every process's samples merged; `Farm.running()` registers them "
        "in the process's default registry. Histograms also export `_bucket`, `_sum` and "
        "`_count`. What to alert on: [Dashboards and alerts](../guides/dashboards.md).",
        "",
    ]
    for make, title, note in GROUPS:
        out += [f"## {title}", "", note, ""]
        out += ["| metric | type | labels | what it counts |", "|---|---|---|---|"]
        out += [row(c) for c in sorted(collectors(make), key=lambda c: c._name)]
        out.append("")
    return "\n".join(out)


with mkdocs_gen_files.open("reference/metrics.md", "w") as page:
    page.write(render())
