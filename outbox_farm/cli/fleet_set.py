"""A fleet's set of databases as the commands read it: the Fleet an app names, its set read
through the fleet's home database, and the database (or all of them) a command was given.

Its own module because it is the one part of the shared options that loads the app and reads
the database, and `fleet` and `console` read the set without the options built on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from .usage_errors import usage_error

if TYPE_CHECKING:
    from ..fleet import Fleet
    from ..fleet.databases import Listing

ALL_DATABASES = "all"


def load_fleet(app: str) -> Fleet:
    """The Fleet at `app` (as `start` takes it); a usage error for anything else."""
    from ..fleet import Fleet
    from ..prefork.app import load_farm

    with usage_error():
        loaded = load_farm(app)
    if not isinstance(loaded, Fleet):
        raise click.UsageError(
            f"{app!r} is a Farm, not a Fleet: the fleet's databases are named by the Fleet "
            "`start` runs (for one database, give its DSN instead)"
        )
    return loaded


def read_set(fleet: Fleet, home: str) -> Listing:
    """The fleet's set as its processes read it; a source's problem goes to stderr."""
    import asyncio

    from ..fleet.databases import Sources

    listing = asyncio.run(Sources(fleet.file, fleet.catalog, home).read())
    for source, problem in sorted(listing.problems.items()):
        click.echo(f"note: {source}: {problem}", err=True)
    return listing


def chosen(listing: Listing, database: str) -> dict[str, str]:
    """The databases `database` names in `listing`: one by its name, or all of them."""
    if database == ALL_DATABASES:
        return dict(sorted(listing.databases.items()))
    if database not in listing.databases:
        known = sorted(listing.databases)
        more = ", ..." if len(known) > 10 else ""
        raise click.UsageError(
            f"no database {database!r} in the fleet's set ({len(known)}: "
            f"{', '.join(known[:10]) or 'none'}{more})"
        )
    return {database: listing.databases[database]}
