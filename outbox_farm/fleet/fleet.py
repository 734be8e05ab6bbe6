"""`Fleet`: what `outbox-farm start app:fleet` runs when one farm serves many outboxes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

from ..errors import ConfigurationError
from ..farm import Farm
from ..handler import HandlerSpec
from .databases import NAME, NAME_RULE


class Fleet:
    """Several outbox tables (`farms`, each with its own DLQ, queues and handlers or relays),
    served in every database of a set, by processes that share the set out among themselves.

    The set: the databases of the TOML file `databases` (a `[databases]` table of `name =
    "dsn"`), and/or the rows `(name, dsn)` of the `catalog` query, run on the home database
    (the one `--dsn` names, which also keeps the fleet's leases: migration 0015). Both are read
    again every `recheck` seconds by every process, so a database added to or removed from
    them is served or let go without restarting anything else; `kill -HUP` to the arbiter has
    every process read them at once. With neither, the fleet serves the home database alone,
    under the name `default`: several outboxes of one database.

    Sharing out: each database is served by one process at a time, whichever holds its lease:
    it claims the database's rows, holds its connections and runs its chores. Every process
    renews its leases and takes free ones up to its share, the set's size divided by the live
    processes of the fleet (of every host), rounded up, and at most `max_databases`; a process
    above its share (one joined) drains and gives the excess up. A process that stops gives its
    databases up at once; one that died is given up for by its arbiter; a dead host's are
    served again within `lease` seconds of its last renewal (they expire three quarters of it
    after, and are taken at the others' next round, every quarter). `name` tells fleets sharing
    a home database apart.
    """

    def __init__(
        self,
        *farms: Farm,
        databases: str | Path | None = None,
        catalog: str | None = None,
        name: str = "default",
        lease: float = 15.0,
        recheck: float = 10.0,
        max_databases: int | None = None,
    ) -> None:
        if not farms or not all(isinstance(farm, Farm) for farm in farms):
            raise ConfigurationError("Fleet(...) takes one or more outbox_farm.Farm objects")
        tables = [str(farm.names.outbox) for farm in farms]
        twice = sorted({table for table in tables if tables.count(table) > 1})
        if twice:
            raise ConfigurationError(f"a fleet serves each outbox table once: {twice} twice")
        if not all(farm.handlers for farm in farms):
            empty = [t for t, farm in zip(tables, farms, strict=True) if not farm.handlers]
            raise ConfigurationError(f"farms of tables {empty} have no handlers")
        if not NAME.fullmatch(name):
            raise ConfigurationError(f"fleet name {name!r}: {NAME_RULE}")
        if not 3.0 <= lease <= 3600.0:
            raise ConfigurationError(f"lease must be 3 to 3600 seconds, got {lease!r}")
        if not 0.5 <= recheck <= 3600.0:
            raise ConfigurationError(f"recheck must be 0.5 to 3600 seconds, got {recheck!r}")
        if max_databases is not None and max_databases < 1:
            raise ConfigurationError(f"max_databases must be at least 1, got {max_databases!r}")
        if catalog is not None and not catalog.strip():
            raise ConfigurationError("catalog must be a query returning (name, dsn) rows")
        self.farms = farms
        self.file = Path(databases) if databases is not None else None
        self.catalog = catalog
        self.name = name
        self.lease = lease
        self.recheck = recheck
        self.max_databases = max_databases

    @property
    def handlers(self) -> dict[str, HandlerSpec]:
        """Every handler of every farm, keyed `table:queue` (for what lists a farm's code)."""
        return {
            f"{farm.names.outbox}:{queue}": spec
            for farm in self.farms
            for queue, spec in farm.handlers.items()
        }

    def specs(self) -> Iterator[HandlerSpec]:
        for farm in self.farms:
            yield from farm.handlers.values()

    @property
    def round_every(self) -> float:
        """Seconds between two rounds of a process: a quarter of the lease."""
        return self.lease / 4

    @property
    def expiry(self) -> float:
        """Seconds a lease lasts past its renewal: the lease less one round, so a dead
        holder's database, taken at the next round after it expires, is served again within
        `lease`; still three rounds, so one lost round trip never lets a lease lapse."""
        return self.lease - self.round_every

    def share(self, databases: int, members: int) -> int:
        """How many of `databases` one of `members` live processes serves."""
        share = math.ceil(databases / max(members, 1))
        return share if self.max_databases is None else min(share, self.max_databases)
