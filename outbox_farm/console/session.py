"""The check every request passes before any page: who is asking, and may they do this.

Sets `request.state.who` (a token's name, or `loopback`), `request.state.session` (what the
CSRF token is bound to), `request.state.csrf` and `request.state.bearer` (authenticated by an
`Authorization` header: no CSRF token needed). Refuses, before any route runs:
- without a valid bearer token or session cookie when tokens are required (a cookie whose
  session was logged out is not valid): a browser asking for a page is sent to the login
  form, a live part gets a fragment saying the session ended, anyone else gets 401; only
  `/login` and `/static/...` are open;
- any POST under --read-only (403), but the login and logout forms;
- a POST whose Origin header names another site (403): a browser always sends Origin with a
  cross-site POST, so this stops a forged form even before its CSRF token is checked;
- without tokens, a Host header that is not a loopback name (400): a page of another site
  whose name resolves to 127.0.0.1 (DNS rebinding) must not reach an open console.
The CSRF token itself is checked by each action (`login.checked_form`), which reads the form.
Every answer carries headers that keep the pages in their own frame and scripts to this origin.
"""

from __future__ import annotations

import urllib.parse

from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

from .pages import fragment, is_live
from .security import LOOPBACK_NAME, SESSION_SECONDS, Signer, is_loopback

OPEN_PATH = "/login"  # exactly: /loginX or /login/x are not open
STATIC = "/static/"  # a prefix: the files under it
FORM_PATHS = ("/login", "/logout")  # POSTs allowed under --read-only
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends `Origin: null` with the console's own forms.
    "Referrer-Policy": "same-origin",
}


def set_session_cookie(response: Response, name: str, value: str, secure: bool) -> None:
    response.set_cookie(
        name,
        value,
        max_age=int(SESSION_SECONDS),
        httponly=True,
        samesite="strict",
        secure=secure,
        path="/",
    )


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _hostname(request: Request) -> str:
    """The Host header's name, without its port (an IPv6 address without its brackets)."""
    try:
        return urllib.parse.urlsplit("//" + request.headers.get("host", "")).hostname or ""
    except ValueError:
        return ""


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    return urllib.parse.urlsplit(origin).netloc == request.headers.get("host", "")


def _open(path: str) -> bool:
    return path == OPEN_PATH or path.startswith(STATIC)


class SessionMiddleware(BaseHTTPMiddleware):
    """Authentication, the cross-site and read-only refusals, and the security headers of
    every answer; the policy is the module's docstring."""

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        response = await self._guarded(request, call_next)
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
        if not request.url.path.startswith(STATIC):
            response.headers.setdefault("Cache-Control", "no-store")
        return response

    async def _guarded(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        settings = request.app.state.settings
        signer: Signer = request.app.state.signer
        path = request.url.path
        fresh: str | None = None  # a cookie to set: a loopback visitor's first session
        who: str | None = None
        session = ""
        request.state.bearer = False
        if not settings.tokens.required and not is_loopback(_hostname(request)):
            return PlainTextResponse(
                "without a token this console answers to loopback names only (127.0.0.1, "
                "localhost, [::1])\n",
                status_code=400,
            )
        bearer = _bearer(request)
        cookie = request.cookies.get(settings.cookie)
        read = signer.read_session(cookie) if cookie else None
        if bearer is not None:
            who = settings.tokens.who(bearer) if settings.tokens.required else LOOPBACK_NAME
            if who is None:
                return PlainTextResponse("invalid bearer token\n", status_code=401)
            session = f"bearer:{who}"
            request.state.bearer = True
        elif read is not None and (
            read[0] in settings.tokens.by_name
            or (not settings.tokens.required and read[0] == LOOPBACK_NAME)
        ):
            who, session = read
        elif not settings.tokens.required:
            fresh = signer.session(LOOPBACK_NAME)
            who, session = LOOPBACK_NAME, fresh.rpartition(".")[0]
        elif not _open(path):
            if is_live(request):
                return fragment("The session has ended: reload the page to log in again.", 401)
            if request.method == "GET" and "text/html" in request.headers.get("accept", ""):
                target = urllib.parse.quote(
                    request.url.path + ("?" + request.url.query if request.url.query else "")
                )
                return RedirectResponse(f"/login?next={target}", status_code=303)
            return PlainTextResponse(
                "authentication required: send Authorization: Bearer <token>, or log in at "
                "/login\n",
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if request.method not in ("GET", "HEAD"):
            if not _same_origin(request):
                return PlainTextResponse("cross-site request refused\n", status_code=403)
            if settings.read_only and path not in FORM_PATHS:
                return PlainTextResponse(
                    "this console is read-only (--read-only): no action is allowed\n",
                    status_code=403,
                )
        request.state.who = who
        request.state.session = session
        request.state.csrf = signer.csrf(session) if who is not None else ""
        response = await call_next(request)
        if fresh is not None:
            set_session_cookie(response, settings.cookie, fresh, settings.secure_cookie)
        return response
