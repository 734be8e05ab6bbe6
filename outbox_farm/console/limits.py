"""How much a request may send: a small body before anyone is known, a bounded one after.

A body is read by the route that wants it, after `SessionMiddleware` has said who is asking;
so the cap is applied while it is read (`BodyLimit`), and chosen then: `OPEN_BODY` bytes for a
request nobody is known for (the login form is a token and a path), `BODY` for one that proved
who it is (the largest form is a selection of `MAX_IDS` ticked rows, or the confirmation of a
plan carrying as many ids). A declared `Content-Length` over the cap is refused before a byte
of the body is read, a chunked one as soon as it passes the cap: nothing a stranger sends is
kept in memory or spooled to disk past a few KiB. A form holds at most `MAX_FIELDS` fields: a
page says so when more rows are ticked, rather than the parser's bare 400.
"""

from __future__ import annotations

from typing import Any

from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..errors import ConfigurationError

MAX_IDS = 10_000  # rows one ticked selection may name
MAX_FIELDS = MAX_IDS + 16  # the ids, and the form's few other fields
OPEN_BODY = 16 << 10  # bytes a request may send before it proved who it is
BODY = 1 << 20  # bytes after: 10,000 ids as form fields, or in a signed plan, fit well


def _cap(scope: Scope) -> int:
    """The cap of this request now: whether `SessionMiddleware` let it in (set `who`)."""
    known = scope.get("state", {}).get("who") is not None
    return BODY if known else OPEN_BODY


def _declared(scope: Scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


class BodyLimit:
    """ASGI middleware: the cap of the module's docstring on every request body.

    Past the cap it answers 413 itself and tells the application the client went away (an
    exception raised from `receive` would reach the application wrapped by the middleware in
    between, as a 500): the application's own answer, if any, is dropped."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        read, started, refused = 0, False, False

        async def answer(message: Message) -> None:
            nonlocal started
            if not refused:
                started = True
                await send(message)

        async def limited() -> Message:
            nonlocal read, refused
            if refused:
                return {"type": "http.disconnect"}
            cap = _cap(scope)
            message: Message | None = None
            if read > 0 or _declared(scope) <= cap:
                message = await receive()
                if message["type"] == "http.request":
                    read += len(message.get("body", b""))
            if message is not None and read <= cap:
                return message
            refused = True
            if not started:
                await _refuse(send, cap)
            return {"type": "http.disconnect"}

        try:
            await self.app(scope, limited, answer)
        except Exception:
            if not refused:  # else: the application's end at a body it was not given
                raise


async def _refuse(send: Send, cap: int) -> None:
    text = f"request body over {cap:,} bytes refused\n".encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(text)).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": text})


def too_many_ids() -> ConfigurationError:
    """The refusal of a selection of more than `MAX_IDS` ticked rows: what to do instead."""
    return ConfigurationError(
        f"at most {MAX_IDS:,} rows can be ticked at once: tick fewer, or select them with the "
        "filter and use \u201cReplay all matching\u201d or \u201cPurge all matching\u201d"
    )


async def read_form(request: Request) -> Any:
    """The request's form, at most `MAX_FIELDS` fields (ConfigurationError, saying what to do,
    past that: it becomes a page)."""
    try:
        form: FormData = await request.form(max_fields=MAX_FIELDS, max_files=0)
    except HTTPException as exc:
        if exc.status_code == 400 and "fields" in str(exc.detail):
            raise too_many_ids() from None
        raise
    return form
