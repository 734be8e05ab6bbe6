"""Where a fleet's set of databases comes from: a TOML file, a catalog query on the home
database, or both, read again by every process every few seconds.

The set is read while the farm runs, so reading it must never be what stops the farm: a file
saved half-written, a catalog table locked, a home database restarting, each keeps the set that
source gave last and says why (under `FILE` or `CATALOG`). One database whose entry is wrong
(a `${VAR}` not set, a DSN libpq cannot parse, a name the two sources disagree on) is left out
and said to be wrong under its own name; the others are served. Only what no reading can make
sense of (the file's TOML, an entry that is not `name = "dsn"` with a `NAME`) fails the whole
file.

Problems are one line each and never hold a secret: they go to logs, /healthz and the command
line.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..db.catalog import check_dsn, read_catalog
from ..dsn import MASK, scrub
from ..errors import ConfigurationError, DatabaseError
from ..problems import one_line

# A database's name is a metric label and a command-line argument: short, and nothing to quote.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
NAME_RULE = "1 to 63 of A-Z a-z 0-9 _ . -, starting with a letter or a digit"
FILE = "<file>"
CATALOG = "<catalog>"
DEFAULT = "default"  # the home database's name when neither source is given
# `${VAR}`, from the environment when the file is read (secrets stay out of the file);
# `$${VAR}` is the text `${VAR}` itself, for a password that holds it.
_REFERENCE = re.compile(r"\$(\$?)\{([A-Za-z_][A-Za-z0-9_]*)\}")
_TOML_TYPES = {dict: "table", list: "array", int: "integer", float: "float", bool: "boolean"}
_SHOWN = 8  # skipped catalog rows described one by one; the rest are counted


@dataclass(frozen=True)
class Listing:
    """A set of databases as read: `databases`, name to DSN, the ones that can be served;
    `problems`, name (or `FILE`, `CATALOG`) to a one-line reason, what is wrong and left out."""

    databases: dict[str, str] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)


def read_file(path: Path) -> Listing:
    """The `[databases]` table of the TOML file `path`, its `${VAR}`s expanded.

    `ConfigurationError`, saying what to fix, when the file as a whole cannot be used: it is
    missing or unreadable, not TOML, has no `[databases]` table, or one of its entries is not
    `name = "dsn"` with a `NAME`. An entry whose variable is not set, or whose DSN libpq cannot
    parse, is a problem of that database alone.
    """
    table = _databases_table(path)
    faults = []
    entries: dict[str, str] = {}
    for name, value in table.items():
        if not NAME.fullmatch(name):
            faults.append(f"name {name[:80]!r} is not {NAME_RULE}")
        elif not isinstance(value, str):
            kind = _TOML_TYPES.get(type(value), type(value).__name__)
            faults.append(f"{name} must be a DSN string (a URL or key=value text), not a {kind}")
        else:
            entries[name] = value
    if faults:
        raise ConfigurationError(f"databases file {path}: {'; '.join(faults)}")
    databases: dict[str, str] = {}
    problems: dict[str, str] = {}
    for name, value in entries.items():
        dsn, problem = _expanded(value)
        if problem is None:
            problem = _parse_problem(dsn, "in the file", value)
        if problem is None:
            databases[name] = dsn
        else:
            problems[name] = problem
    return Listing(databases, problems)


def _databases_table(path: Path) -> dict[str, object]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigurationError(
            f"databases file {path} does not exist: fix the path, or create it with a "
            '[databases] table of name = "dsn" lines'
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"cannot read databases file {path}: {exc.strerror or exc}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(f"databases file {path} is not UTF-8 text: {exc}") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"databases file {path} is not valid TOML: {exc}") from None
    table = document.get("databases")
    if not isinstance(table, dict):
        raise ConfigurationError(
            f"databases file {path} has no [databases] table: write the databases under a "
            '[databases] header, one name = "dsn" line each'
        )
    return table


def _expanded(value: str) -> tuple[str, str | None]:
    """`value` with its `${VAR}`s replaced from the environment, and the problem of the
    variables that are not set (named, never their values)."""
    unset: list[str] = []

    def replace(match: re.Match[str]) -> str:
        escaped, variable = match.groups()
        if escaped:
            return match.group(0)[1:]
        found = os.environ.get(variable)
        if found is None:
            unset.append(variable)
            return match.group(0)
        return found

    dsn = _REFERENCE.sub(replace, value)
    if not unset:
        return dsn, None
    names = ", ".join(dict.fromkeys(unset))
    if len(unset) == 1:
        return dsn, f"environment variable {names} is not set"
    return dsn, f"environment variables {names} are not set"


def _parse_problem(dsn: str, where: str, shown: str | None = None) -> str | None:
    """Why libpq cannot parse `dsn`, in one line masking its secret, and masking `shown` too:
    the text of the file before its variables were expanded, whose values may be secrets a
    parse error quotes wherever they stood in the DSN."""
    reason = check_dsn(dsn)
    if reason is None:
        return None
    return f"the DSN {where} cannot be parsed: {_mask_expansions(reason, shown)}"


def _mask_expansions(text: str, template: str | None) -> str:
    if template is None:
        return text
    values = [os.environ.get(m.group(2), "") for m in _REFERENCE.finditer(template)]
    for value in sorted(values, key=len, reverse=True):
        if value:
            text = text.replace(value, MASK)
    return text


def _catalog_listing(rows: list[tuple[str | None, str | None]]) -> Listing:
    """The rows of the catalog query as a listing: a row with no usable name is a problem of
    the catalog (there is no name to file it under); a name given two different DSNs is left
    out; one given the same DSN twice is served once."""
    databases: dict[str, str] = {}
    problems: dict[str, str] = {}
    skipped: list[str] = []
    seen: dict[str, str | None] = {}
    for name, dsn in rows:
        if name is None:
            skipped.append("a NULL name")
        elif not NAME.fullmatch(name):
            skipped.append(f"name {name[:80]!r} is not {NAME_RULE}")
        elif name in seen:
            if seen[name] != dsn:
                databases.pop(name, None)
                problems[name] = "the catalog has several rows of it with different DSNs"
        else:
            seen[name] = dsn
            if dsn is None:
                problems[name] = "its DSN is NULL in the catalog"
            elif (problem := _parse_problem(dsn, "of the catalog")) is not None:
                problems[name] = problem
            else:
                databases[name] = dsn
    if skipped:
        more = f"; and {len(skipped) - _SHOWN} more" if len(skipped) > _SHOWN else ""
        problems[CATALOG] = f"{len(skipped)} rows skipped: {'; '.join(skipped[:_SHOWN])}{more}"
    return Listing(databases, problems)


class Sources:
    """The set of databases of a fleet: the TOML `file`, the rows of the `catalog` query run
    on the home database `home_dsn`, or both; with neither, the home database alone, as
    `DEFAULT`.

    Each source's last good listing is kept here, so a source that fails to be read keeps
    giving it (with the failure as a problem) rather than dropping every database it named;
    one that never was read gives none. Not shared between tasks: one caller reads, round
    after round.
    """

    def __init__(self, file: Path | None, catalog: str | None, home_dsn: str) -> None:
        self.file = file
        self.catalog = catalog
        self.home_dsn = home_dsn
        self._from_file: Listing | None = None
        self._from_catalog: Listing | None = None

    async def read(self) -> Listing:
        """Both sources, read now and merged: a name both give with different DSNs is left
        out, a problem of that name, as is a name either of them says is wrong."""
        if self.file is None and self.catalog is None:
            return Listing({DEFAULT: self.home_dsn}, {})
        failures: dict[str, str] = {}
        if self.file is not None:
            try:
                self._from_file = read_file(self.file)
            except ConfigurationError as exc:
                failures[FILE] = _failed(one_line(exc), self._from_file)
        if self.catalog is not None:
            try:
                rows = await read_catalog(self.home_dsn, self.catalog)
            except (ConfigurationError, DatabaseError) as exc:
                reason = scrub(one_line(exc), self.home_dsn)
                failures[CATALOG] = _failed(reason, self._from_catalog)
            else:
                self._from_catalog = _catalog_listing(rows)
        return _merged(self._from_file or Listing(), self._from_catalog or Listing(), failures)


def _failed(reason: str, last: Listing | None) -> str:
    if last is None:
        return f"{reason} (nothing read from it yet)"
    count = len(last.databases)
    return f"{reason} (its last good list, {count} database{'' if count == 1 else 's'}, kept)"


def _merged(file: Listing, catalog: Listing, failures: dict[str, str]) -> Listing:
    problems = dict(catalog.problems)
    for name, problem in file.problems.items():
        problems[name] = f"{problems[name]}; {problem}" if name in problems else problem
    problems.update(failures)
    databases: dict[str, str] = {}
    for name, dsn in [*file.databases.items(), *catalog.databases.items()]:
        if name in problems:
            continue
        if databases.setdefault(name, dsn) != dsn:
            del databases[name]
            problems[name] = "the file and the catalog give it different DSNs; make them agree"
    return Listing(databases, problems)
