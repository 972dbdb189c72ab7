"""Who may talk to the server: it launches processes, so every request is vetted here.

- Bound to loopback (the default) the server still refuses requests whose Host header is
  not a loopback name: a web page the user visits cannot reach it through DNS rebinding.
- Bound to any other address, a token is required on every request (header, cookie, or
  ``?token=`` once, which sets the cookie).
- Requests that change anything must be JSON from the same origin: a cross-site form or
  ``fetch`` from another page cannot send them (CSRF).
- Request bodies are capped, so an upload cannot exhaust memory.
- Every response forbids being framed (``X-Frame-Options: DENY`` and CSP
  ``frame-ancestors 'none'``: a page elsewhere cannot lay this UI under a decoy and borrow the
  user's clicks) and carries a content security policy that lets the pages run only the
  scripts they ship.
"""

from __future__ import annotations

import ipaddress
import json
import re
import secrets
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

COOKIE = "zeropipe_token"
MAX_BODY_BYTES = 1024 * 1024
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
# A Host header is a name or an address and an optional port, nothing else: `127.0.0.1:8811@evil.example`
# or `a b` are not hosts (a lax parser would take the first as 127.0.0.1).
HOST_HEADER = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,252}))(?::(\d{1,5}))?$")
# Scripts only from this server's own files (no inline script, no eval); inline style
# attributes are allowed: the templates and Swagger UI use them, and a style cannot run code.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self' data:; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = [
    (b"x-frame-options", b"DENY"),
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),  # the first URL carries ?token=: never pass it on to another site
]


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    return secrets.token_urlsafe(24)


def header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def host_name(host_header: str) -> str | None:
    """``example.org:8765`` -> ``example.org``; ``[::1]:8765`` -> ``[::1]``; None for anything that is not a host[:port]."""
    match = HOST_HEADER.match(host_header)
    if match is None or (match.group(2) is not None and int(match.group(2)) > 65535):
        return None
    return match.group(1).lower()


def same_origin(origin: str, scheme: str, host_header: str) -> bool:
    """Whether a browser's ``Origin`` is this server: scheme, host and port all equal (``https://`` to an http server is another origin)."""
    if host_name(host_header) is None:
        return False
    default_port = {"http": "80", "https": "443"}.get(scheme, "")

    def parts(value: str) -> tuple[str, str] | None:
        match = HOST_HEADER.match(value)
        if match is None:
            return None
        return match.group(1).lower(), match.group(2) or default_port

    given_scheme, sep, rest = origin.partition("://")
    return bool(sep) and given_scheme.lower() == scheme and parts(rest) is not None and parts(rest) == parts(host_header)


def with_security_headers(send):
    """``send`` adding the framing and content-security headers to every response start."""

    async def wrapped(message):
        if message["type"] == "http.response.start":
            present = {key.lower() for key, _ in message.get("headers", [])}
            extra = [(key, value) for key, value in SECURITY_HEADERS if key not in present]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        await send(message)

    return wrapped


class Guard:
    """ASGI middleware enforcing the rules in the module docstring."""

    def __init__(self, app, token: str | None = None, allowed_hosts: set[str] | None = None):
        self.app = app
        self.token = token
        self.allowed_hosts = allowed_hosts  # None: any Host (a token protects the server instead)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = with_security_headers(send)
        host = header(scope, b"host") or ""
        if host_name(host) is None:
            return await reply(send, 400, f"the Host header {host[:100]!r} is not a host name or address with an optional port")
        if self.allowed_hosts is not None and host_name(host) not in self.allowed_hosts:
            return await reply(send, 403, f"requests for host {host!r} are refused: open the UI at http://127.0.0.1 (protects against DNS rebinding)")
        if self.token is not None:
            verdict = self.check_token(scope)
            if verdict == "redirect":
                return await self.redirect_with_cookie(scope, send)
            if verdict != "ok":
                return await reply(send, 401, "this server needs its token: open the URL zeropipe ui printed (with ?token=...) or send 'Authorization: Bearer TOKEN'")
        method = scope["method"]
        length = header(scope, b"content-length")
        if method not in SAFE_METHODS:
            origin = header(scope, b"origin")
            # Scheme, host and port: https://127.0.0.1:PORT is not this http server, even on the same host and port.
            if origin is not None and not same_origin(origin, scope.get("scheme", "http"), host):
                return await reply(send, 403, f"cross-origin request from {origin[:200]} refused")
            # Browsers say where a request comes from; another site (even another port of this host) may change nothing.
            fetch_site = header(scope, b"sec-fetch-site")
            if fetch_site is not None and fetch_site not in ("same-origin", "none"):
                return await reply(send, 403, f"request from another site ({fetch_site}) refused")
            content_type = (header(scope, b"content-type") or "").split(";")[0].strip().lower()
            # A request without a body (DELETE, a bodiless POST) goes on to the router, which answers 405 for a wrong method.
            has_body = (length is not None and length != "0") or header(scope, b"transfer-encoding") is not None
            if has_body and content_type != "application/json":
                return await reply(send, 415, "send the request body as JSON (Content-Type: application/json)")
        if length is not None and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
            return await reply(send, 413, f"request body over {MAX_BODY_BYTES // 1024} KiB refused")
        if method in SAFE_METHODS:
            return await self.app(scope, receive, send)
        # Read the body here (it is small by then or refused), so a chunked upload without a
        # Content-Length is capped too.
        body = await read_body(receive)
        if body is None:
            return await reply(send, 413, f"request body over {MAX_BODY_BYTES // 1024} KiB refused")
        return await self.app(scope, replay(body, receive), send)

    def check_token(self, scope) -> str:
        given = []
        auth = header(scope, b"authorization") or ""
        if auth.lower().startswith("bearer "):
            given.append(auth[7:].strip())
        given.append(header(scope, b"x-zeropipe-token") or "")
        cookie = SimpleCookie()
        try:
            cookie.load(header(scope, b"cookie") or "")
        except Exception:  # noqa: BLE001 - a malformed cookie header is just no token
            pass
        if COOKIE in cookie:
            given.append(cookie[COOKIE].value)
        if any(secrets.compare_digest(g.encode(), self.token.encode()) for g in given if g):
            return "ok"
        query = dict(parse_qsl(scope.get("query_string", b"").decode("latin-1")))
        if query.get("token") and secrets.compare_digest(query["token"].encode(), self.token.encode()):
            return "redirect" if scope["method"] == "GET" else "ok"
        return "refused"

    async def redirect_with_cookie(self, scope, send):
        """Trade ``?token=`` for a cookie and drop it from the address bar (and from the history)."""
        query = [(k, v) for k, v in parse_qsl(scope.get("query_string", b"").decode("latin-1")) if k != "token"]
        location = scope["path"] + (f"?{urlencode(query)}" if query else "")
        cookie = f"{COOKIE}={self.token}; Path=/; HttpOnly; SameSite=Strict"
        await send({"type": "http.response.start", "status": 303, "headers": [(b"location", location.encode()), (b"set-cookie", cookie.encode()), (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})


async def read_body(receive) -> bytes | None:
    """The whole request body, or None once it passes the cap."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            return None
        if not message.get("more_body"):
            return b"".join(chunks)


def replay(body: bytes, receive):
    sent = False

    async def wrapped():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # then http.disconnect, when the client goes

    return wrapped


async def reply(send, status: int, detail: str):
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
