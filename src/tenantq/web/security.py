"""Authentication (optional bearer token / login cookie), CSRF tokens and
security headers for the dashboard.

Everything is keyed by a secret made fresh for each process: a restart logs
browsers out and invalidates old forms, which is the right default for an
operator tool. No token, HMAC or nonce is ever compared with `==`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from urllib.parse import quote

from starlette.datastructures import Headers
from starlette.requests import HTTPConnection
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

SESSION_COOKIE = "tenantq_session"  # random nonce; the CSRF token is an HMAC of it
AUTH_COOKIE = "tenantq_auth"  # HMAC of the dashboard token, never the token itself
CSRF_FIELD = "csrf_token"

# Paths that answer without authentication: liveness for probes, and the
# login form itself.
OPEN_PATHS = frozenset({"/healthz", "/login"})

# No scripts at all, inline styles only, never framed.
SECURITY_HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy",
     b"default-src 'none'; style-src 'unsafe-inline'; img-src 'self'; form-action 'self'; "
     b"frame-ancestors 'none'; base-uri 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class Keys:
    """The per-process secret and what is derived from it."""

    def __init__(self, token: str | None, secret: bytes | None = None) -> None:
        self.token = token
        self._secret = secret or secrets.token_bytes(32)

    def _mac(self, purpose: str, value: str) -> str:
        msg = f"{purpose}\x00{value}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    # -- CSRF ------------------------------------------------------------
    @staticmethod
    def new_nonce() -> str:
        return secrets.token_urlsafe(24)

    def csrf_token(self, nonce: str) -> str:
        return self._mac("csrf", nonce)

    def csrf_ok(self, nonce: str | None, submitted: str | None) -> bool:
        if not nonce or not submitted:
            return False
        return hmac.compare_digest(self.csrf_token(nonce), submitted)

    # -- authentication -------------------------------------------------
    def auth_cookie_value(self) -> str:
        assert self.token is not None
        return self._mac("auth", self.token)

    def token_ok(self, candidate: str | None) -> bool:
        if self.token is None or candidate is None:
            return False
        return hmac.compare_digest(candidate.encode(), self.token.encode())

    def authenticated(self, conn: HTTPConnection) -> bool:
        if self.token is None:
            return True
        scheme, _, credentials = conn.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.token_ok(credentials.strip()):
            return True
        cookie = conn.cookies.get(AUTH_COOKIE)
        return cookie is not None and hmac.compare_digest(cookie, self.auth_cookie_value())


def safe_next(target: str | None, default: str = "/") -> str:
    """A local path to go back to; anything else (other hosts, `//evil`,
    backslashes, control characters) becomes `default`."""
    if not target or not target.startswith("/") or target.startswith("//"):
        return default
    if "\\" in target or any(ord(ch) < 0x20 for ch in target):
        return default
    return target


def _wants_html(headers: Headers) -> bool:
    return "text/html" in headers.get("accept", "")


class GuardMiddleware:
    """Adds the security headers to every response and, with a token set,
    refuses every path outside OPEN_PATHS without a valid bearer token or
    login cookie: 401 for API clients, a redirect to /login for browsers."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                existing = {name.lower() for name, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in SECURITY_HEADERS if k not in existing]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        conn = HTTPConnection(scope)
        if scope["path"] not in OPEN_PATHS and not self.keys.authenticated(conn):
            response: Response
            if scope["method"] == "GET" and _wants_html(conn.headers):
                path = scope["path"] + ("?" + scope["query_string"].decode("latin-1")
                                        if scope["query_string"] else "")
                response = RedirectResponse(f"/login?next={quote(path, safe='')}", status_code=303)
            else:
                response = PlainTextResponse(
                    "401 unauthorized: send 'Authorization: Bearer <token>' or log in at /login\n",
                    status_code=401, headers={"WWW-Authenticate": 'Bearer realm="tenantq"'},
                )
            await response(scope, receive, send_with_headers)
            return
        await self.app(scope, receive, send_with_headers)
