"""Who may use the console, and proof that a POST came from one of its own pages.

The console can move and delete dead letters, so the policy is strict and written once here:

- **Bind.** Loopback (127.0.0.0/8, ::1, `localhost`) needs no token: whoever can reach it is
  on this machine already. Any other address refuses to start without a token file, so the
  console never faces a network unauthenticated by accident.
- **Tokens.** A token file holds one token a line; blank lines and `#` comments are skipped.
  A line is `name:token` only when it holds exactly one `:` and the part before it is a
  non-empty name of letters, digits, `_`, `.` and `-`; any other line is a bare token, whole
  (named `token`), so a token that contains `:` is never split by accident. A token is
  compared in constant time (`hmac.compare_digest`) on every request: an
  `Authorization: Bearer` header (scripts), or the session cookie the login form sets
  (browsers: HttpOnly, SameSite=Strict, signed, named for the console's port:
  `cookie_name`). The file is read at start: to revoke a
  token, remove it and restart the console (which also ends every session).
- **Sessions and CSRF.** A session is a signed cookie naming who it is (a token's name, or
  `loopback`); the signing key is made at start and lives in this process only, so a restart
  logs everyone out and no key sits on disk. Every POST carries a CSRF token, an HMAC of the
  session under that key, checked in constant time. A request authenticated by an
  `Authorization` header needs no CSRF token: a browser never adds that header to a forged
  cross-site request. A request whose `Origin` is another site is refused too. Logging out
  revokes the session's nonce in this process, so a copy of the cookie is refused afterwards.
- **Plans.** A replay or purge runs only what its dry run showed: the confirmation form
  carries the plan (action, selection, absolute times, `upto`, the rows' ids or their digest:
  see `plans`) signed for the session, and `/dlq/run` refuses any plan whose signature does
  not match.
- **Transport.** Any other address also needs TLS: served here (`--tls-cert`/`--tls-key`),
  or by a proxy in front (`--behind-tls-proxy`). Either way the session cookie is `Secure`.
- **Host.** Without a token, only loopback host names are served: a page of another site
  whose name resolves to 127.0.0.1 (DNS rebinding) gets a 400, not the console.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ..errors import ConfigurationError

TOKEN_ENV = "OUTBOX_FARM_CONSOLE_TOKEN_FILE"
COOKIE = "outbox_farm_console"
SESSION_SECONDS = 12 * 3600.0
MIN_TOKEN_LENGTH = 16
LOOPBACK_NAME = "loopback"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
MAKE_ONE = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


def cookie_name(port: int) -> str:
    """The session cookie of the console on `port`. Browsers keep cookies by host, never by
    port: two consoles on one host under one name would overwrite each other's session at
    every visit (a login to one logs out of the other)."""
    return f"{COOKIE}_{port}"


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine
    only. Names other than `localhost` are not resolved: they might resolve elsewhere later."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Tokens:
    """The accepted tokens by name; empty: no token file (loopback only)."""

    by_name: dict[str, str]

    @classmethod
    def load(cls, path: str | None) -> Tokens:
        """The tokens of the file at `path` (None: none). Refused, saying how to fix it: an
        unreadable or empty file, a token shorter than `MIN_TOKEN_LENGTH`, a name twice."""
        if path is None:
            return cls({})
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(
                f"cannot read the token file {path}: {exc}; point --token-file at a readable file"
            ) from None
        found: dict[str, str] = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            name, token = split_token_line(line)
            where = f"{path} line {number}"
            if len(token) < MIN_TOKEN_LENGTH:
                raise ConfigurationError(
                    f"{where}: the token of {name!r} is shorter than {MIN_TOKEN_LENGTH} "
                    f"characters; make one with {MAKE_ONE}"
                )
            if name in found:
                raise ConfigurationError(f"{where}: the name {name!r} is given twice")
            found[name] = token
        if not found:
            raise ConfigurationError(
                f"the token file {path} holds no token; write one a line (name:token or token), "
                f"e.g. made with {MAKE_ONE}"
            )
        return cls(found)

    @property
    def required(self) -> bool:
        """Whether every request must prove a token: true as soon as the file named one."""
        return bool(self.by_name)

    def who(self, given: str) -> str | None:
        """The name of the token `given`, or None. Every token is compared, each in constant
        time, so the time taken says nothing about which one nearly matched."""
        match = None
        for name, token in self.by_name.items():
            if hmac.compare_digest(given.encode(), token.encode()):
                match = name
        return match


def split_token_line(line: str) -> tuple[str, str]:
    """(name, token) of one stripped line of a token file: `name:token` when the line holds
    exactly one `:` and a valid name before it, else the whole line is the token (`token`)."""
    name, colon, token = line.partition(":")
    if colon and ":" not in token and _NAME.match(name.strip()) and token.strip():
        return name.strip(), token.strip()
    return "token", line


def check_bind(host: str, tokens: Tokens) -> None:
    """Refuse a bind the network can reach unless a token protects it."""
    if not is_loopback(host) and not tokens.required:
        raise ConfigurationError(
            f"--bind {host} is reachable from other machines and the console can replay and "
            f"delete dead letters: give --token-file PATH (or {TOKEN_ENV}) with a token a line "
            f"(name:token; make one with {MAKE_ONE}), or bind 127.0.0.1"
        )


def check_transport(host: str, tls: bool, behind_tls_proxy: bool) -> None:
    """Refuse a bind the network can reach unless its tokens and cookies travel encrypted:
    TLS served here (--tls-cert/--tls-key), or a TLS proxy in front (--behind-tls-proxy)."""
    if not is_loopback(host) and not (tls or behind_tls_proxy):
        raise ConfigurationError(
            f"--bind {host} is reachable from other machines, and tokens and session cookies "
            "would cross the network in cleartext: give --tls-cert FILE and --tls-key FILE, "
            "or --behind-tls-proxy when a proxy in front terminates TLS, or bind 127.0.0.1"
        )


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


class Signer:
    """Sessions, CSRF tokens and action plans under one key made for this process; and the
    sessions revoked by logging out.

    `revoked` holds the nonces of sessions logged out in this process (their cookies are
    refused until they would have expired anyway); written and read by request handlers on
    the event loop only.
    """

    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or os.urandom(32)
        self.revoked: dict[str, float] = {}  # session id -> when its cookie expires

    def _mac(self, purpose: str, text: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}\n{text}".encode(), hashlib.sha256).digest())

    def session(self, who: str, now: float | None = None) -> str:
        """A cookie value naming `who`, valid for SESSION_SECONDS."""
        issued = int(now if now is not None else time.time())
        body = f"{_b64(who.encode())}.{issued}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._mac('session', body)}"

    def read_session(self, value: str, now: float | None = None) -> tuple[str, str] | None:
        """(who, session id) of a cookie this process signed and that has not expired."""
        body, _, mac = value.rpartition(".")
        if not body or not _same(mac, self._mac("session", body)) or body in self.revoked:
            return None
        encoded, issued, _nonce = body.split(".")
        if (now if now is not None else time.time()) - int(issued) > SESSION_SECONDS:
            return None
        padded = encoded + "=" * (-len(encoded) % 4)
        return base64.urlsafe_b64decode(padded).decode(), body

    def revoke(self, session_id: str, now: float | None = None) -> None:
        """Refuse the session `session_id` from now on (logout). Entries whose cookie has
        expired anyway are dropped here, so the set stays as small as the live sessions."""
        at = now if now is not None else time.time()
        for stale in [s for s, until in self.revoked.items() if until < at]:
            del self.revoked[stale]
        try:
            issued = int(session_id.split(".")[1])
        except (IndexError, ValueError):
            return
        self.revoked[session_id] = issued + SESSION_SECONDS

    def csrf(self, session_id: str) -> str:
        """The CSRF token every form of session `session_id` carries (an HMAC of it)."""
        return self._mac("csrf", session_id)

    def check_csrf(self, session_id: str, given: str) -> bool:
        """Whether `given` is the CSRF token of `session_id`; constant time, any text."""
        return _same(given, self.csrf(session_id))

    def sign_plan(self, session_id: str, plan: dict[str, Any]) -> str:
        """`plan` (JSON-able) as a form value only this process can have made, for this
        session: read back by `read_plan`."""
        body = _b64(orjson.dumps(plan, option=orjson.OPT_SORT_KEYS))
        return body + "." + self._mac("plan", f"{session_id}\n{body}")

    def read_plan(self, session_id: str, value: str) -> dict[str, Any] | None:
        """The plan signed by `sign_plan` for this session; None for anything else."""
        body, _, mac = value.rpartition(".")
        if not body or not _same(mac, self._mac("plan", f"{session_id}\n{body}")):
            return None
        try:
            plan = orjson.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        except (ValueError, orjson.JSONDecodeError):
            return None
        return plan if isinstance(plan, dict) else None


def _same(given: str, expected: str) -> bool:
    """Constant-time equality of two texts, whatever characters `given` holds (compared as
    UTF-8 bytes: `hmac.compare_digest` refuses str with non-ASCII characters)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode())
