"""Where the database is, and how to name it in logs without its password."""

from __future__ import annotations

import re

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .errors import ConfigurationError

_URL_PASSWORD = re.compile(r"(://[^:/@]*:)[^@]*@")
_KV_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&]*)", re.IGNORECASE)


def redact(dsn: str) -> str:
    """The DSN with any password replaced by `***`, for logs and error messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return _KV_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", dsn))
    if "password" in params:
        params["password"] = "***"
    return make_conninfo(**params)  # type: ignore[arg-type]


def redact_url(url: str) -> str:
    """A broker URL (amqp://, nats://, redis://) with any password replaced by `***`."""
    return _URL_PASSWORD.sub(r"\1***@", url)


def check_dsn(dsn: str) -> str:
    """Refuse a DSN that libpq cannot even parse, with the reason."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigurationError(f"invalid DSN {redact(dsn)!r}: {exc}") from None
    return dsn
