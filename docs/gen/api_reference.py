"""Writes the Python API pages from each public module's `__all__`: one mkdocstrings entry per
exported name, so a name added to (or dropped from) the public API appears on (or leaves) its
page at the next build. The docstrings are rendered by mkdocstrings."""

from __future__ import annotations

import importlib

import mkdocs_gen_files

PAGES = [
    (
        "outbox_farm",
        "python-api",
        "Everything importable from `outbox_farm` itself. `farm.publish`, `publish_batch`, "
        "`apublish`, `apublish_batch`, `cancel_timer` and `acancel_timer` are the methods of "
        "the farm's producer, listed after `Farm`; the options of `@farm.handler` are those of "
        "`HandlerSpec`. Modules not listed on these pages are internal and may move between "
        "versions.",
        ["outbox_farm.producer.Producer", "outbox_farm.handler.HandlerSpec"],
    ),
    (
        "outbox_farm.relay",
        "relay-api",
        "The relay targets, and the interface of a target of your own. How relays behave: "
        "[Relays to brokers](../concepts/relays.md).",
        [],
    ),
    (
        "outbox_farm.testing",
        "testing-api",
        "The test kit: `drain`, `record` and what they return. The pytest fixtures "
        "(`outbox_dsn`, `outbox_drain`, `outbox_recorder`, `outbox_app`, `outbox_server`) are "
        "described in [Testing your handlers](../guides/testing.md).",
        [],
    ),
    (
        "outbox_farm.admin",
        "admin-api",
        "What `outbox-farm stats` and `outbox-farm dlq` run, for admin scripts. Every function "
        "takes a psycopg connection outside a transaction and the `TableNames` of the farm's "
        'tables (`TableNames.build("outbox", "outbox_dlq")`, or `farm.names`).',
        [],
    ),
]


def where(module: object, name: str) -> str:
    """Where `name` is defined, for mkdocstrings: classes and functions at their own module;
    the relay targets, imported lazily (their clients only when made), from `_TARGETS`
    without importing them."""
    found = vars(module).get(name)
    lazy = getattr(module, "_TARGETS", {})
    module_name = getattr(module, "__name__", "")
    if found is None and name in lazy:
        return f"{module_name}.{lazy[name]}.{name}"
    defined_in = getattr(found, "__module__", None)
    if defined_in and defined_in.startswith("outbox_farm") and hasattr(found, "__qualname__"):
        return f"{defined_in}.{found.__qualname__}"
    return f"{module_name}.{name}"


def render(module_name: str, intro: str, extra: list[str]) -> str:
    module = importlib.import_module(module_name)
    summary = (module.__doc__ or "").strip()
    out = [
        f"# Python API: `{module_name}`",
        "",
        "<!-- Generated from the module's __all__ by docs/gen/api_reference.py; the text is "
        "the docstrings. -->",
        "",
        intro,
        "",
        summary,
        "",
    ]
    for name in module.__all__:
        out += [f"::: {where(module, name)}", ""]
        if name == "Farm":
            out += [f"::: {path}" for path in extra] + [""]
    return "\n".join(out)


for module_name, page, intro, extra in PAGES:
    with mkdocs_gen_files.open(f"reference/{page}.md", "w") as out:
        out.write(render(module_name, intro, extra))
