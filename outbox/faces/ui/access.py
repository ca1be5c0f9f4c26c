"""Who may use the dashboard: the session token, the Host a request names, and whether a
state-changing request comes from the dashboard's own pages.

As Jupyter does, ``outbox ui`` prints a URL carrying a random token. Opening it sets a
cookie (HttpOnly, SameSite=Strict) and redirects to the same page without the token, so the
token does not stay in the address bar. Every page needs that cookie, since memories are
private. A POST also needs the per-session form token (derived from the session token, so
another site cannot know it) and, when the browser names one, an Origin or Referer of this
server. A Host header other than the bound address is refused, so a DNS-rebinding page
cannot talk to the server under its own name. Every redirect goes to a path on this server
(``see_other``), whatever path the request named.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TOKEN_PARAM = "token"
CSRF_FIELD = "csrf"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")

# No script or style from anywhere but this server, no framing, no form sent elsewhere.
SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


@dataclass(frozen=True)
class Access:
    """The session's secrets and the Host names it answers to (None: any, when bound to a
    non-loopback address whose names the server cannot know)."""

    token: str
    port: int
    hosts: frozenset[str] | None

    @classmethod
    def for_bind(cls, token: str, host: str, port: int) -> Access:
        """Loopback binds answer only to loopback names; any other bind to every name."""
        if host in ("127.0.0.1", "localhost", "::1"):
            names = {*LOOPBACK_NAMES, host if ":" not in host else f"[{host}]"}
            return cls(token, port, frozenset(f"{name}:{port}" for name in names))
        return cls(token, port, None)

    @property
    def cookie(self) -> str:
        """Per port: browsers share cookies between ports of one host."""
        return f"outbox_ui_{self.port}"

    @property
    def csrf(self) -> str:
        """The form token: fixed for the session, unknowable without the session token."""
        return hmac.new(self.token.encode(), b"outbox-ui-form", hashlib.sha256).hexdigest()

    def token_ok(self, offered: str | None) -> bool:
        return offered is not None and hmac.compare_digest(offered.encode(), self.token.encode())

    def csrf_ok(self, offered: str | None) -> bool:
        return offered is not None and hmac.compare_digest(offered.encode(), self.csrf.encode())

    def host_ok(self, host: str | None) -> bool:
        return self.hosts is None or (host is not None and host.lower() in self.hosts)


def same_origin(host: str | None, origin: str | None, referer: str | None) -> bool:
    """Whether a request's Origin (else Referer) is this server; a request naming neither
    (a script, not a browser) passes here and still needs the form token."""
    claimed = origin if origin not in (None, "") else referer
    if claimed is None or claimed == "":
        return True
    if claimed == "null":  # an opaque origin: a sandboxed frame, a file:// page
        return False
    parts = urlsplit(claimed)
    return parts.scheme == "http" and host is not None and parts.netloc.lower() == host.lower()


def without_token(path: str, query: Iterable[tuple[str, str]]) -> str:
    """The same address with the token left out (where the first visit is sent on to)."""
    kept = [(name, value) for name, value in query if name != TOKEN_PARAM]
    return path + (f"?{urlencode(kept)}" if kept else "")


# What a path may start with that a browser reads as the start of another site's address:
# slashes, backslashes (read as slashes), and the spaces and control characters it drops.
_OFF_SITE_LEAD = re.compile(r"^[/\\\x00-\x20]+")


def local_path(target: str) -> str:
    """``target`` as a path a browser can only read on this server: the run of slashes,
    backslashes and control characters it starts with becomes one ``/``, so ``//host/`` or
    ``/\\host`` (a scheme-relative address) is never sent back as another site."""
    return "/" + _OFF_SITE_LEAD.sub("", target)


def see_other(target: str) -> RedirectResponse:
    """The dashboard's one redirect: 303 (a POST is followed by a GET), to a local path."""
    return RedirectResponse(local_path(target), status_code=303)


DENIED = (
    "outbox ui: this page needs the session token. Open the address that `outbox ui` "
    "printed when it started (it ends with ?token=...)."
)


class AccessMiddleware:
    """Checks every request but the static files, and adds the security headers."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            await _secured(refusal)(scope, receive, send)
            return

        async def send_secured(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).update(SECURITY_HEADERS)
            await send(message)

        await self.app(scope, receive, send_secured)

    def _refusal(self, request: Request) -> Response | None:
        """The answer for a request that may not go on, or None."""
        access = self.access
        if not access.host_ok(request.headers.get("host")):
            return PlainTextResponse("outbox ui: unexpected Host header", status_code=400)
        if request.url.path.startswith("/static/"):
            return None
        offered = request.query_params.get(TOKEN_PARAM)
        if offered is not None:
            if not access.token_ok(offered):
                return PlainTextResponse(DENIED, status_code=403)
            target = without_token(request.url.path, request.query_params.multi_items())
            response = see_other(target)
            response.set_cookie(
                access.cookie, access.token, httponly=True, samesite="strict", path="/"
            )
            return response
        if not access.token_ok(request.cookies.get(access.cookie)):
            return PlainTextResponse(DENIED, status_code=403)
        if request.method not in ("GET", "HEAD") and not same_origin(
            request.headers.get("host"),
            request.headers.get("origin"),
            request.headers.get("referer"),
        ):
            return PlainTextResponse("outbox ui: cross-site request refused", status_code=403)
        return None


def _secured(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response
