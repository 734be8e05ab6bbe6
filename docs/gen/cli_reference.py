"""Writes reference/cli.md from the click commands themselves: every command, its arguments,
and every option with its environment variable, default and help. Run by the `gen-files`
plugin at every build, so the page cannot drift from the code."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator

import click
import mkdocs_gen_files

from outbox_farm.cli import main

ENV = re.compile(r"\s*\[env [A-Z0-9_]+\]")


def cell(text: object) -> str:
    """Text for one cell of a Markdown table."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def commands(
    group: click.Group, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    for name in group.list_commands(click.Context(group)):
        command = group.commands[name]
        yield (*path, name), command
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))


def default(option: click.Option) -> str:
    if isinstance(option.show_default, str):
        return f"{option.show_default}"
    if option.is_flag and not option.secondary_opts:
        return "off"
    value = option.default
    if callable(value) or value is None or value == "":
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "-"
    return f"`{value}`"


def names(option: click.Option) -> str:
    shown = [*option.opts, *option.secondary_opts]
    text = " / ".join(f"`{n}`" for n in shown)
    if not option.is_flag and option.metavar:
        text += f" {option.metavar}"
    elif not option.is_flag and not option.count:
        text += f" {option.type.name.upper()}" if option.type.name != "text" else " TEXT"
    return text


def render_command(path: tuple[str, ...], command: click.Command) -> list[str]:
    context = click.Context(command, info_name=" ".join(["outbox-farm", *path]))
    usage = command.collect_usage_pieces(context)
    out = [f"## `outbox-farm {' '.join(path)}`", ""]
    out += ["```text", f"outbox-farm {' '.join(path)} {' '.join(usage)}".rstrip(), "```", ""]
    help_text = inspect.cleandoc(command.help or "")
    if help_text:
        out += [click.unstyle(help_text), ""]
    if isinstance(command, click.Group):
        subcommands = command.list_commands(context)
        out += [
            "Subcommands: "
            + ", ".join(f"[`{n}`](#outbox-farm-{'-'.join(path)}-{n})" for n in subcommands),
            "",
        ]
        return out
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    for argument in arguments:
        env = f" (env `{argument.envvar}`)" if argument.envvar else ""
        out += [f"Argument `{argument.make_metavar(context)}`{env}.", ""]
    options = [p for p in command.params if isinstance(p, click.Option) and p.name != "help"]
    if options:
        out += ["| option | environment variable | default | what it does |", "|---|---|---|---|"]
        for option in options:
            env = f"`{option.envvar}`" if option.envvar else "command line only"
            choices = ""
            if isinstance(option.type, click.Choice):
                choices = " One of: " + ", ".join(f"`{c}`" for c in option.type.choices) + "."
            help_text = ENV.sub("", option.help or "").strip() + choices
            out.append(f"| {names(option)} | {env} | {cell(default(option))} | {cell(help_text)} |")
        out.append("")
    return out


def render() -> str:
    out = [
        "# Command line",
        "",
        "<!-- Generated from the click commands by docs/gen/cli_reference.py at every build. -->",
        "",
        "Every command reads its options from the command line or, where the table names one, "
        "from an environment variable (the command line wins). Options marked *command line "
        "only* select or confirm rows to change, or are choices of one run. `outbox-farm "
        "--version` prints the version; `-h` / `--help` works on every command.",
        "",
        inspect.cleandoc(main.help or ""),
        "",
    ]
    for path, command in commands(main):
        out += render_command(path, command)
    return "\n".join(out) + "\n"


with mkdocs_gen_files.open("reference/cli.md", "w") as page:
    page.write(render())
