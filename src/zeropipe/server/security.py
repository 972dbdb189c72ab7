"""Who may talk to the server: it launches processes, so every request is vetted here.

- Bound to loopback (the default) the server still refuses requests whose Host header is
  not a loopback name: a web page the user visits cannot reach it through DNS rebinding.
- Bound to any other address, a token is required on every request (header, cookie, or
  ``?token=`` once, which sets the cookie).
- Requests that change anything must be JSON from the same origin: a cross-site form or
  ``fetch`` from another page cannot send them (CSRF).
- Request bodies are capped, so an upload cannot exhaust memory.
"""

from __future__ import annotations

import ipaddress
import json
import secrets
from http.cookies import SimpleCookie
from urllib.parse import parse_qsl, urlencode

COOKIE = "zeropipe_token"
MAX_BODY_BYTES = 1024 * 1024
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


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


def host_name(host_header: str) -> str:
    """``example.org:8765`` -> ``example.org``; ``[::1]:8765`` -> ``[::1]``."""
    if host_header.startswith("["):
        return host_header[: host_header.find("]") + 1]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


class Guard:
    """ASGI middleware enforcing the rules in the module docstring."""

    def __init__(self, app, token: str | None = None, allowed_hosts: set[str] | None = None):
        self.app = app
        self.token = token
        self.allowed_hosts = allowed_hosts  # None: any Host (a token protects the server instead)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        host = header(scope, b"host") or ""
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
            if origin is not None and origin.split("://", 1)[-1] != host:
                return await reply(send, 403, f"cross-origin request from {origin} refused")
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
