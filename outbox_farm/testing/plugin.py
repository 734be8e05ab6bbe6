"""The pytest plugin of `outbox_farm.testing`, registered under the `pytest11` entry point.

Fixtures (none costs anything until a test asks for it):

- `outbox_server` (session): an admin DSN (see `databases.server`: `OUTBOX_FARM_TEST_DSN`,
  else testcontainers, else an embedded Postgres started for the session);
- `outbox_app`: the farm under test; override it in your `conftest.py` to return yours, so
  the database is migrated for its table names (default: a `Farm()` with the default tables);
- `outbox_dsn`: a fresh database, migrated for `outbox_app`'s tables, dropped after the test;
- `outbox_drain`: `drain` bound to `outbox_app` and `outbox_dsn`;
- `outbox_recorder`: `outbox_app`'s publishes recorded in memory for the test (no database).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial

import pytest

from ..farm import Farm
from .databases import Templates, server
from .drain import drain
from .recorder import Recorder, record
from .results import Drained


@pytest.fixture(scope="session")
def outbox_server() -> Iterator[str]:
    with server() as dsn:
        yield dsn


@pytest.fixture(scope="session")
def outbox_templates(outbox_server: str) -> Iterator[Templates]:
    templates = Templates(outbox_server)
    try:
        yield templates
    finally:
        templates.close()


@pytest.fixture
def outbox_app() -> Farm:
    return Farm()


@pytest.fixture
def outbox_dsn(outbox_templates: Templates, outbox_app: Farm) -> Iterator[str]:
    with outbox_templates.database(outbox_app.names) as dsn:
        yield dsn


@pytest.fixture
def outbox_drain(outbox_app: Farm, outbox_dsn: str) -> Callable[..., Drained]:
    bound: Callable[..., Drained] = partial(drain, outbox_app, outbox_dsn)
    return bound


@pytest.fixture
def outbox_recorder(outbox_app: Farm) -> Iterator[Recorder]:
    with record(outbox_app) as recorder:
        yield recorder
