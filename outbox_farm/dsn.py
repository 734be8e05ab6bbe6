"""Where the database (or a broker) is, and how to name it in messages without its secret.

Masking the password in the DSN we print is not enough: libpq and the broker clients quote the
text they failed to parse (`invalid percent-encoded token: "..."`, `missing "=" after "..."`),
and a password holding an `@` moves part of itself into the host name they report. So every
message built from a connection or parse error goes through `scrub`, which masks each fragment
of the secret wherever it appears, whatever library wrote the text around it.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import unquote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .errors import ConfigurationError

MASK = "***"
# A fragment this short is masked only where it stands alone (not inside a longer word), so
# that a one-letter piece of a password does not blank out every word holding that letter.
SHORT = 4

_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*)://")
# The keys whose values are secrets, in key=value form or in a URI's query.
_SECRET_KEY = re.compile(r"(?:^|(?<=[\s?&]))(?:ssl)?password\s*=\s*", re.IGNORECASE)
# Where an unquoted key=value value ends: at the next `key=` (libpq stops at the first blank,
# but the user meant everything up to the next key, and libpq quotes the rest in its error).
_NEXT_KEY = re.compile(r"\s+[A-Za-z_]+\s*=")
# The characters libpq and URL parsers split on: each piece between them may be quoted alone.
_PIECES = re.compile(r"[\s@/:?#%&=,;'\"\\]+")
_POSTGRES_SCHEMES = ("postgresql", "postgres")
# Where a URI's query starts: a `?` followed by `key=` (a `?` inside a password is not one).
_QUERY = re.compile(r"\?(?=[A-Za-z_]+=)|#")


def secret_fragments(source: str) -> list[str]:
    """Every text of `source` (a DSN or broker URL) a message must not show, longest first.

    That is each secret value (a URI's password, which is everything between the user's colon
    and the last `@` before the host; a token user-info of a broker URL; a `password=` or
    `sslpassword=` value, quoted or not, up to the next key), raw and percent-decoded, and
    each piece of it between blanks and separators. A `passfile=` is a path, not a secret: the
    file's content never enters a DSN, so nothing of it can be quoted back.
    """
    found: set[str] = set()
    for value in [*_uri_secrets(source), *_keyword_secrets(source)]:
        for text in (value, unquote(value)):
            found.add(text)
            found.update(_PIECES.split(text))
    found.discard("")
    return sorted(found, key=lambda fragment: (-len(fragment), fragment))


def _uri_secrets(source: str) -> list[str]:
    """The user-info's secret of a URI: after the user's colon up to the last `@` before the
    query, since libpq (the first `@`) and URL parsers (the last) disagree on which ends it."""
    scheme = _SCHEME.match(source)
    if scheme is None:
        return []
    rest = source[scheme.end() :]
    query = _QUERY.search(rest)
    end = rest.rfind("@", 0, query.start() if query else len(rest))
    if end < 0:
        return []
    userinfo = rest[:end]
    user, colon, password = userinfo.partition(":")
    if colon:
        return [password]
    # nats://TOKEN@host: a user-info without a colon is a token, except for Postgres' user.
    return [] if scheme.group(1).lower() in _POSTGRES_SCHEMES else [user]


def _keyword_secrets(source: str) -> list[str]:
    """The `password=` (and `sslpassword=`) values, in key=value form or in a URI's query."""
    uri = _SCHEME.match(source) is not None
    values = []
    for key in _SECRET_KEY.finditer(source):
        rest = source[key.end() :]
        if rest.startswith("'"):
            closing = re.search(r"(?<!\\)'", rest[1:])
            raw = rest[1 : closing.start() + 1] if closing else rest[1:]
            values += [raw, re.sub(r"\\(.)", r"\1", raw)]
        elif uri:
            values.append(re.split(r"[&#]", rest, maxsplit=1)[0])
        else:
            following = _NEXT_KEY.search(rest)
            values.append((rest[: following.start()] if following else rest).strip())
    return values


@functools.lru_cache(maxsize=64)
def _pattern(fragments: frozenset[str]) -> re.Pattern[str]:
    """One alternation, longest fragment first, so the whole secret is masked before its
    pieces; short pieces only where no letter or digit touches them. Cached: the remembered
    secrets are the same for every log line."""
    return re.compile(
        "|".join(
            re.escape(f) if len(f) >= SHORT else rf"(?<![A-Za-z0-9]){re.escape(f)}(?![A-Za-z0-9])"
            for f in sorted(fragments, key=lambda fragment: (-len(fragment), fragment))
        )
    )


_remembered: set[str] = set()


def remember(source: str) -> None:
    """Keep `source`'s secret for `scrub` (and so for every log line) in this process and the
    processes it forks: a message built far from the DSN is masked too."""
    _remembered.update(secret_fragments(source))


def scrub(text: str, *sources: str) -> str:
    """`text` with every fragment of the secrets of `sources`, and of the remembered ones,
    replaced by `***`. Apply it to the whole message, after the library's text is in it."""
    fragments = _remembered.union(*(secret_fragments(source) for source in sources))
    if not fragments:
        return text
    return _pattern(frozenset(fragments)).sub(MASK, text)


def redact(dsn: str) -> str:
    """The DSN with any password replaced by `***`, for logs and error messages."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error:
        return scrub(dsn, dsn)
    if "password" in params:
        params["password"] = MASK
    return scrub(make_conninfo(**params), dsn)  # type: ignore[arg-type]


def redact_url(url: str) -> str:
    """A broker URL (amqp://, nats://, redis://) with any password or token replaced by `***`."""
    return scrub(url, url)


def check_dsn(dsn: str) -> str:
    """Refuse a DSN that libpq cannot even parse, with the reason (its secret masked)."""
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        message = f"invalid DSN {redact(dsn)!r}: {str(exc).strip()}"
        raise ConfigurationError(scrub(message, dsn)) from None
    return dsn
