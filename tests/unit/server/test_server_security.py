"""Who may talk to the server: loopback Host names, the token, same-origin JSON writes, body size."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from zeropipe.server import create_app
from zeropipe.server.security import host_name, is_loopback
from zeropipe.store import Roots, RunStore


@pytest.fixture
def store(tmp_path):
    store = RunStore(Roots(runs=[tmp_path / "runs"], base=tmp_path))
    yield store
    store.close()


def test_loopback_server_refuses_other_host_names(store):
    """A page on evil.example whose name resolves to 127.0.0.1 (DNS rebinding) gets nothing."""
    app = create_app(store, refresh_interval=None)
    with TestClient(app, base_url="http://127.0.0.1:8765") as client:
        assert client.get("/api/runs").status_code == 200
        assert client.get("/api/runs", headers={"Host": "localhost:8765"}).status_code == 200
        assert client.get("/api/runs", headers={"Host": "[::1]:8765"}).status_code == 200
        response = client.get("/api/runs", headers={"Host": "evil.example:8765"})
        assert response.status_code == 403 and "DNS rebinding" in response.json()["detail"]


def test_a_token_is_required_on_every_request(store):
    app = create_app(store, token="s3cret-token", bind_host="0.0.0.0", refresh_interval=None)
    with TestClient(app, base_url="http://192.0.2.10:8765") as client:
        for path in ["/", "/api/runs", "/static/common.js", "/openapi.json", "/docs", "/api/runs/stream?max_seconds=0.1"]:
            response = client.get(path)
            assert response.status_code == 401, path
            assert "token" in response.json()["detail"]
        assert client.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/api/runs", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
        assert client.get("/api/runs", headers={"X-Zeropipe-Token": "s3cret-token"}).status_code == 200


def test_the_printed_url_trades_the_token_for_a_cookie(store):
    app = create_app(store, token="s3cret-token", bind_host="0.0.0.0", refresh_interval=None)
    with TestClient(app, base_url="http://192.0.2.10:8765", follow_redirects=False) as client:
        response = client.get("/compare?ids=1&token=s3cret-token")
        assert response.status_code == 303 and response.headers["location"] == "/compare?ids=1"
        cookie = response.headers["set-cookie"]
        assert "zeropipe_token=s3cret-token" in cookie and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        assert client.get("/compare?ids=1").status_code == 200  # the client kept the cookie
        assert client.get("/api/runs").status_code == 200
        client.cookies.clear()
        assert client.get("/api/runs", params={"token": "nope"}).status_code == 401


def test_writes_must_be_same_origin_json(store):
    app = create_app(store, refresh_interval=None)
    with TestClient(app, base_url="http://127.0.0.1:8765") as client:
        # What a cross-site <form> can send: refused before the app sees it.
        response = client.post("/api/config/check", content="yaml=x", headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert response.status_code == 415
        response = client.post("/api/config/check", content='{"yaml": "a: 1"}', headers={"Content-Type": "text/plain"})
        assert response.status_code == 415
        response = client.post("/api/config/check", json={"yaml": "a: 1"}, headers={"Origin": "http://evil.example"})
        assert response.status_code == 403 and "cross-origin" in response.json()["detail"]
        response = client.post("/api/config/check", json={"yaml": "run: {name: x}"}, headers={"Origin": "http://127.0.0.1:8765"})
        assert response.status_code == 200


def test_large_bodies_are_refused(store):
    app = create_app(store, refresh_interval=None)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        response = client.post("/api/config/check", content=b'{"yaml": "' + b"x" * (2 * 1024 * 1024) + b'"}', headers={"Content-Type": "application/json"})
        assert response.status_code == 413

        def chunks():  # no Content-Length: the cap applies while reading
            yield b'{"yaml": "'
            for _ in range(40):
                yield b"x" * 65536
            yield b'"}'

        response = client.post("/api/config/check", content=chunks(), headers={"Content-Type": "application/json"})
        assert response.status_code == 413


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True), ("0.0.0.0", False), ("192.168.1.5", False), ("example.org", False)])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_host_names_from_host_headers():
    assert host_name("127.0.0.1:8765") == "127.0.0.1"
    assert host_name("[::1]:8765") == "[::1]"
    assert host_name("localhost") == "localhost"


@pytest.mark.parametrize(
    "origin,same",
    [
        ("http://127.0.0.1:8765", True),
        ("HTTP://127.0.0.1:8765", True),
        ("https://127.0.0.1:8765", False),  # another scheme is another origin (issue 26: it deleted a preset)
        ("http://127.0.0.1:8766", False),
        ("http://127.0.0.1", False),
        ("http://127.0.0.1:8765.evil.example", False),
        ("http://evil.example", False),
        ("null", False),
        ("", False),
    ],
)
def test_an_origin_is_this_server_only_with_the_same_scheme_host_and_port(origin, same):
    from zeropipe.server.security import same_origin

    assert same_origin(origin, "http", "127.0.0.1:8765") is same


@pytest.mark.parametrize("host", ["127.0.0.1:8811@evil.example", "127.0.0.1:8811/x", "a b", "127.0.0.1:99999", "", "[::1", "127.0.0.1:"])
def test_a_host_header_that_is_not_a_host_and_port_is_refused(store, host):
    assert host_name(host) is None
    app = create_app(store, refresh_interval=None)
    with TestClient(app, base_url="http://127.0.0.1:8765") as client:
        response = client.get("/api/runs", headers={"Host": host})
        assert response.status_code in (400, 403) and response.headers["x-frame-options"] == "DENY"


def test_every_response_refuses_framing_and_inline_scripts(store):
    app = create_app(store, refresh_interval=None)
    with TestClient(app, base_url="http://127.0.0.1:8765") as client:
        for response in (client.get("/"), client.get("/docs"), client.get("/api/runs"), client.get("/nothing"), client.post("/api/runs/1/resume", json={})):
            assert response.headers["x-frame-options"] == "DENY"
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert "<script>" not in client.get("/docs").text  # Swagger UI starts from a file: no inline script to allow


def test_an_empty_token_is_no_token_at_all(store):
    with pytest.raises(ValueError, match="empty token"):
        create_app(store, token="", refresh_interval=None)
