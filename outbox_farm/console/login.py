"""Who is asking: the login form, logging out, and the proof a POST came from this session.

`checked_form` is the CSRF check every action runs before it reads anything else; a request
authenticated by an `Authorization` header is exempt (see `security`). Every login, refused
or not, is logged with the client's address.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from .limits import read_form
from .pages import page
from .security import Signer
from .session import set_session_cookie

log = logging.getLogger("outbox_farm.console")


def client_address(request: Request) -> str:
    """The address the request came from (the proxy's, behind a proxy)."""
    return request.client.host if request.client else "-"


def who(request: Request) -> str:
    """Who is asking: a token's name, or `loopback`. Set by `SessionMiddleware` on every
    request that reaches an action (only the login form and static files go without)."""
    return str(request.state.who)


def _next(value: str | None) -> str:
    """Where to go after logging in: a path of this console only, never another site."""
    if value and value.startswith("/") and not value.startswith("//") and "\\" not in value:
        return value
    return "/"


async def login_form(request: Request) -> Response:
    if not request.app.state.settings.tokens.required:
        return RedirectResponse("/", status_code=303)
    return page(request, "login.html", next=_next(request.query_params.get("next")), error=None)


async def login(request: Request) -> Response:
    settings = request.app.state.settings
    if not settings.tokens.required:
        return RedirectResponse("/", status_code=303)
    form = await read_form(request)
    target = _next(str(form.get("next") or ""))
    who = settings.tokens.who(str(form.get("token") or ""))
    address = client_address(request)
    if who is None:
        log.warning(
            "console login refused from %s",
            address,
            extra={"event": "console_login_refused", "client": address},
        )
        return page(
            request, "login.html", status=401, next=target, error="That token is not valid."
        )
    signer: Signer = request.app.state.signer
    response = RedirectResponse(target, status_code=303)
    set_session_cookie(response, settings.cookie, signer.session(who), settings.secure_cookie)
    log.info(
        "console login: %s from %s",
        who,
        address,
        extra={"event": "console_login", "who": who, "client": address},
    )
    return response


async def logout(request: Request) -> Response:
    """End the session: its cookie is deleted, and its nonce refused from now on even if a
    copy of the cookie is presented again."""
    await checked_form(request)
    signer: Signer = request.app.state.signer
    if request.state.session and not request.state.bearer:
        signer.revoke(request.state.session)
    settings = request.app.state.settings
    response = RedirectResponse("/login" if settings.tokens.required else "/", 303)
    response.delete_cookie(settings.cookie, path="/")
    return response


async def checked_form(request: Request) -> Any:
    """The POSTed form, once its CSRF token proved it came from a page of this session (not
    needed when an `Authorization` header authenticated the request: no browser sends one
    cross-site). Raises HTTPException 403 otherwise; the form's size as `limits.read_form`."""
    form = await read_form(request)
    if getattr(request.state, "who", None) is None:
        raise HTTPException(403, "log in first")
    if request.state.bearer:
        return form
    given = str(form.get("csrf") or request.headers.get("x-csrf-token") or "")
    signer: Signer = request.app.state.signer
    if not signer.check_csrf(request.state.session, given):
        raise HTTPException(403, "missing or wrong CSRF token: reload the page and try again")
    return form
