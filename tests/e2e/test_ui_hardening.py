"""Issue 26's hardening, tried as an outsider would: real HTTP requests against a running
`zeropipe ui`, and Debian's Chromium for what only a browser shows (framing, the CSP).

One UI for the module (runs written as files, nothing trains); the last test stops it with
Ctrl-C while event streams are open.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from playwright.sync_api import expect

from tests.e2e.conftest import UiServer, end_training_processes
from tests.e2e.fake_runs import TINY_CONFIG, live_pid, write_run

pytestmark = pytest.mark.e2e

PAGES = ["/", "/new", "/compare?ids=1,2", "/environment", "/generate", "/docs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hardening")
    ui = UiServer(workdir)
    ui.data.mkdir()
    ui.runs.mkdir()
    write_run(ui.runs, "finished", steps=12, checkpoints=(6, 12))
    write_run(ui.runs, "older", steps=12, total_steps=24, checkpoints=(6, 12), state="stopped")
    write_run(ui.runs, "live", state="running", steps=4, total_steps=400, checkpoints=(), supervisor_pid=live_pid())
    ui.start()
    ui.port = int(ui.url.rsplit(":", 1)[1])
    yield ui
    ui.stop()
    end_training_processes(ui.runs)


@pytest.fixture(scope="module")
def context(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    yield context
    context.close()


def raw(server, method: str, path: str, body: dict | str | None = None, headers: dict | None = None, host: str | None = None):
    """One request with exactly these headers (Host included): (status, headers, parsed JSON or text)."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    connection.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", host if host is not None else f"127.0.0.1:{server.port}")
    data = body if isinstance(body, str) or body is None else json.dumps(body)
    sent = dict(headers or {})
    if data is not None:
        sent.setdefault("Content-Type", "application/json")
        sent["Content-Length"] = str(len(data.encode()))
    for key, value in sent.items():
        connection.putheader(key, value)
    connection.endheaders(data.encode() if data is not None else None)
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = text
    return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed


def run_id(server, name: str) -> int:
    return server.run(name)["id"]


# ------------------------------------------------------------------------ 5: clickjacking
def test_every_response_forbids_framing(server):
    """No X-Frame-Options and no CSP: a framed page's click reached POST /api/runs/1/export."""
    for method, path, host in [("GET", "/", None), ("GET", "/api/runs", None), ("GET", "/static/common.js", None), ("GET", "/docs", None),
                               ("GET", "/api/nothing", None), ("GET", "/", "evil.example"), ("POST", "/api/runs/1/stop", None)]:  # fmt: skip
        status, headers, _ = raw(server, method, path, body={} if method == "POST" else None, host=host)
        assert headers.get("x-frame-options") == "DENY", (method, path, status)
        csp = headers.get("content-security-policy", "")
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "unsafe-eval" not in csp, (path, csp)


def test_the_pages_work_under_the_policy_and_refuse_to_be_framed(context, server):
    """Every page renders with no CSP violation; a page elsewhere that frames the UI gets an empty frame."""
    page = context.new_page()
    violations, errors = [], []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    for path in PAGES + [f"/runs/{run_id(server, 'finished')}"]:
        page.goto(server.url + path)
        expect(page.locator("main, #swagger-ui").first).not_to_be_empty()
    expect(page.locator("#chart-loss canvas")).to_be_visible()  # the run page drew its charts (uPlot under the CSP)
    page.goto(server.url + "/docs")
    expect(page.locator(".swagger-ui .opblock").first).to_be_visible(timeout=30_000)  # Swagger UI started from its file
    page.goto(server.url + "/new")
    expect(page.locator("#check-status")).not_to_be_empty()
    assert violations == [] and errors == [], (violations, errors)

    # A decoy page on another origin lays the UI in an iframe: the browser refuses to render it.
    page.set_content(f'<h1>win a prize</h1><iframe id="decoy" src="{server.url}/runs/{run_id(server, "finished")}" width="800" height="600"></iframe>')
    page.wait_for_timeout(1000)
    framed = page.frames[1]
    assert framed.locator("#actions").count() == 0 and "ZeRO-Pipe" not in framed.content()
    page.close()


def test_resume_asks_first_and_the_api_needs_confirm(context, server):
    """Resume (which moves newer checkpoints aside) went through on a single click or a bare request."""
    older = run_id(server, "older")
    status, _, answer = raw(server, "POST", f"/api/runs/{older}/resume", body={"checkpoint": "step_00000006"})
    assert status == 400 and '"confirm": true' in answer["detail"], answer
    assert server.run("older")["state"] == "stopped"

    page = context.new_page()
    asked, posted = [], []
    page.on("request", lambda r: posted.append(r.url) if r.url.endswith("/resume") else None)

    def dismiss(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", dismiss)
    page.goto(f"{server.url}/runs/{older}")
    page.select_option("#resume-checkpoint", "step_00000006")
    page.click("#resume")
    page.wait_for_timeout(300)
    assert asked and "step_00000006" in asked[0] and "step_00000012" in asked[0] and "moved aside" in asked[0], asked
    assert posted == [] and server.run("older")["state"] == "stopped"
    page.close()


# --------------------------------------------------------------- 6: origin, unbounded work
def test_another_scheme_on_the_same_host_and_port_is_another_origin(server):
    """`Origin: https://127.0.0.1:PORT` passed the cross-site check and deleted a preset."""
    status, _, _ = raw(server, "POST", "/api/presets", body={"name": "keep-me", "yaml": "train: {lr: 0.001}\n"}, headers={"Origin": server.url})
    assert status == 201
    for origin in [f"https://127.0.0.1:{server.port}", f"http://127.0.0.1:{server.port + 1}", f"http://127.0.0.1:{server.port}.evil.example", "null"]:
        status, _, answer = raw(server, "DELETE", "/api/presets/saved/keep-me", headers={"Origin": origin})
        assert status == 403 and "cross-origin" in answer["detail"], (origin, status, answer)
    assert any(p["name"] == "keep-me" for p in server.api("/api/presets")["presets"])
    status, _, _ = raw(server, "DELETE", "/api/presets/saved/keep-me", headers={"Origin": f"http://127.0.0.1:{server.port}"})
    assert status == 200


def test_a_preview_of_millions_of_generated_examples_is_quick(server):
    """`data.synthetic.examples: 2000000` took 29 s and 1.3 GB in the UI process: the preview generates what it shows."""
    config = {
        "run": {"name": "millions"},
        "model": TINY_CONFIG["model"],
        "data": {"synthetic": {"task": "arithmetic", "examples": 2_000_000}, "max_seq_len": 32},
    }
    started = time.monotonic()
    status, _, answer = raw(server, "POST", "/api/data/preview", body={"config": config, "limit": 5})
    assert status == 200, answer
    assert time.monotonic() - started < 10 and answer["records"] == 2_000_000 and len(answer["examples"]) == 5
    assert "the first 5,000 generated here" in answer["source"]


# ---------------------------------------------------------------------------- 7: smaller
def test_a_number_too_long_to_read_is_a_4xx_without_a_traceback(server):
    """A 5000-digit YAML integer gave HTTP 500 and a traceback in the log."""
    huge = "9" * 5000
    text = f"model: {{config: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}}}}\ndata: {{synthetic: {{task: arithmetic}}}}\ntrain: {{max_steps: {huge}}}\n"
    status, _, answer = raw(server, "POST", "/api/runs", body={"yaml": text})
    assert status == 422 and "more digits than Python reads" in answer["detail"], (status, answer)
    status, _, answer = raw(server, "POST", "/api/config/check", body={"yaml": text})
    assert status == 200 and not answer["valid"] and "more digits" in answer["problems"][0]["message"]
    status, _, answer = raw(server, "POST", "/api/config/check", body='{"config": {"train": {"max_steps": ' + huge + "}}}")
    assert 400 <= status < 500, (status, answer)
    assert "Traceback" not in (server.workdir / "ui.log").read_text()


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
def test_non_finite_learning_rates_are_refused(server, value):
    text = f"model: {{config: {{model_type: llama, hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 4}}}}\ndata: {{synthetic: {{task: arithmetic}}}}\ntrain: {{lr: {value}}}\n"
    status, _, answer = raw(server, "POST", "/api/config/check", body={"yaml": text})
    assert status == 200 and not answer["valid"] and any(p["key"] == "train.lr" and "finite" in p["message"] for p in answer["problems"]), answer


@pytest.mark.parametrize("host", ["127.0.0.1:{port}@evil.example", "127.0.0.1:{port}/x", "127.0.0.1 evil.example", "127.0.0.1:99999", ""])
def test_a_host_header_that_is_not_host_and_port_is_refused(server, host):
    status, _, answer = raw(server, "GET", "/api/runs", host=host.format(port=server.port))
    assert status in (400, 403), (host, status)
    assert raw(server, "GET", "/api/runs")[0] == 200


def test_ctrl_c_stops_the_ui_at_once_with_event_streams_open(server):
    """Ctrl-C took 5.5-7.5 s while a running run's event stream was open. (Last in the module: it stops the UI.)"""
    live = run_id(server, "live")
    opened = []

    def listen(path):
        try:
            with urllib.request.urlopen(server.url + path, timeout=30) as response:
                opened.append(path)
                while response.readline():
                    pass
        except (OSError, http.client.HTTPException):
            pass

    listeners = [threading.Thread(target=listen, args=(path,), daemon=True) for path in (f"/api/runs/{live}/stream", "/api/runs/stream", f"/api/runs/{live}/stream")]
    for listener in listeners:
        listener.start()
    deadline = time.monotonic() + 10
    while len(opened) < len(listeners) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(opened) == len(listeners)
    time.sleep(0.5)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGINT)
    server.proc.wait(timeout=30)
    took = time.monotonic() - started
    server.proc = None
    assert took < 2, f"Ctrl-C took {took:.1f} s"
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "/api/health", timeout=2)
