"""Issue 26's hardening, tried as an outsider would: real HTTP requests against a running
`zeropipe ui`, and Debian's Chromium for what only a browser shows (framing, the CSP); then
the issue's product defects, seen in Chromium.

One UI for the module (runs written as files, nothing trains); the last test stops it with
Ctrl-C while event streams are open.
"""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from playwright.sync_api import expect

from tests.e2e.conftest import UiServer, end_training_processes, screenshot
from tests.e2e.fake_runs import TINY_CONFIG, live_pid, png, write_run

FAILURE = """rank 0 was killed by SIGKILL
likely cause: the kernel's OOM killer; host RAM peaked at 63.8 of 64.0 GiB
fix: use deepspeed.zero_stage: 3; `dmesg | grep -i oom` confirms an OOM kill; then resume with --resume"""


def diffusion_run(runs, name, **kwargs):
    """A diffusion run as files: model.family diffusion, 32 px samples (what a tiny test pipeline draws)."""
    path = write_run(runs, name, **kwargs)
    config = yaml.safe_load((path / "config.yaml").read_text())
    config["model"] = {"family": "diffusion", "config": {"pipeline": "tiny-sdxl"}}
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for step in (6, 12):
        folder = path / "samples" / f"step_{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "0.png").write_bytes(png(32, 32, (200, 60, 40)))
        rows.append(json.dumps({"step": step, "prompt": "a red square", "file": f"step_{step:08d}/0.png"}))
    (path / "samples" / "index.jsonl").write_text("\n".join(rows) + "\n")
    return path

pytestmark = pytest.mark.e2e

PAGES = ["/", "/new", "/compare?ids=1,2", "/environment", "/generate", "/chat", "/draw", "/dataset", "/docs"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("hardening")
    ui = UiServer(workdir)
    ui.data.mkdir()
    ui.runs.mkdir()
    write_run(ui.runs, "finished", steps=12, checkpoints=(6, 12))
    write_run(ui.runs, "older", steps=12, total_steps=24, checkpoints=(6, 12), state="stopped")
    write_run(ui.runs, "live", state="running", steps=4, total_steps=400, checkpoints=(), supervisor_pid=live_pid())
    write_run(ui.runs, "oom", state="failed", steps=3, total_steps=40, checkpoints=(), diagnosis=FAILURE)
    diffusion_run(ui.runs, "sd-lora", steps=12, checkpoints=(6, 12))
    warming = diffusion_run(ui.runs, "sd-warming", state="running", steps=0, total_steps=100, checkpoints=(), supervisor_pid=live_pid())
    time.sleep(0.02)  # after its metrics.jsonl: no step since
    (warming / "progress.json").write_text(json.dumps({"phase": "caching latents", "done": 40, "total": 240, "at": time.time(), "pid": live_pid()}))
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
    status, _, _ = raw(server, "GET", "/api/runs", host=host.format(port=server.port))
    assert status in (400, 403), (host, status)
    assert raw(server, "GET", "/api/runs")[0] == 200


# ------------------------------------------------------------------------ product defects
def test_invalid_yaml_is_not_ready_to_launch(context, server):
    """Invalid YAML still showed "ready to launch" with Launch enabled."""
    page = context.new_page()
    page.goto(server.url + "/new")
    expect(page.locator("#check-status")).to_have_text("ready to launch", timeout=60_000)
    expect(page.locator("#launch")).to_be_enabled()
    page.locator("#yaml").fill(page.locator("#yaml").input_value() + "train: [unclosed\n")
    expect(page.locator("#check-status")).to_have_text("the YAML is not valid")
    expect(page.locator("#launch")).to_be_disabled()
    expect(page.locator("#check")).to_contain_text("nothing was checked")
    # The header says the server is there (it was grey on every page without a live stream).
    expect(page.locator("#connection")).to_have_attribute("data-state", "live")
    page.close()


def test_compare_shows_the_runs_that_exist_and_names_the_unknown_id(context, server):
    """One unknown id blanked the whole Compare page."""
    page = context.new_page()
    page.goto(f"{server.url}/compare?ids={run_id(server, 'finished')},{run_id(server, 'older')},9999")
    expect(page.locator("#compare-missing")).to_contain_text("No run 9999")
    expect(page.locator("#compare-table tbody tr")).to_have_count(2)
    expect(page.locator("#compare-chart canvas")).to_be_visible()
    page.close()


def test_a_diffusion_run_offers_only_what_works_and_its_samples_zoom(context, server):
    """Generate and Evaluate were offered on diffusion runs and always failed; samples were 32 px specks without zoom."""
    page = context.new_page()
    page.goto(f"{server.url}/runs/{run_id(server, 'sd-lora')}")
    expect(page.locator("#resume-checkpoint, #new-from-run").first).to_be_visible()
    expect(page.locator("#eval-unavailable")).to_contain_text("diffusion")
    assert page.locator("#generate-link").count() == 0 and page.locator("#evaluate").count() == 0
    expect(page.locator("#draw-link")).to_be_visible()  # issue 46: Draw for a diffusion run, Chat for a language model
    assert page.locator("#chat-link").count() == 0
    sample = page.locator("#gallery img").first
    expect(sample).to_be_visible()
    assert sample.bounding_box()["width"] >= 150
    sample.click()
    big = page.locator("#lightbox img")
    expect(big).to_be_visible()
    assert big.bounding_box()["width"] >= 500
    expect(page.locator("#lightbox figcaption")).to_contain_text("32×32 px")
    screenshot(page, "41-sample-full-size", full_page=False)
    page.keyboard.press("Escape")
    expect(page.locator("#lightbox")).to_have_count(0)
    # A language-model run keeps both.
    page.goto(f"{server.url}/runs/{run_id(server, 'finished')}")
    expect(page.locator("#generate-link")).to_be_visible()
    expect(page.locator("#evaluate")).to_be_visible()
    expect(page.locator("#chat-link")).to_have_attribute("href", f"/chat?run={run_id(server, 'finished')}")
    assert page.locator("#draw-link").count() == 0
    page.close()


def test_a_starting_run_says_what_it_is_doing(context, server):
    """A starting diffusion run showed no progress for 2.5 minutes."""
    page = context.new_page()
    page.goto(f"{server.url}/runs/{run_id(server, 'sd-warming')}")
    expect(page.locator("#progress")).to_contain_text("caching latents 40 of 240")
    screenshot(page, "42-starting-run-progress", full_page=False)
    page.close()


def test_a_failure_reads_as_page_text(context, server):
    """The diagnosis showed literal backticks and said "with --resume" next to the Resume button."""
    page = context.new_page()
    page.goto(f"{server.url}/runs/{run_id(server, 'oom')}")
    text = page.locator("#diagnosis-text")
    expect(text).to_contain_text("resume the run (Resume")
    expect(text.locator("code")).to_have_text("dmesg | grep -i oom")
    assert "`" not in text.inner_text() and "--resume" not in text.inner_text()
    page.close()


def test_the_runs_list_has_when_each_run_first_started_and_for_how_long(context, server):
    page = context.new_page()
    page.goto(server.url + "/")
    row = page.locator(f"#runs tr[data-run-id='{run_id(server, 'finished')}']")
    expect(row.locator(".run-duration")).to_have_text(re.compile(r"^\d+(s|m \d+s)$"))
    page.close()


def test_labels_of_the_essentials_are_not_cut(context, server):
    """Labels and help text of the New-run essentials were cut with an ellipsis."""
    page = context.new_page()
    page.set_viewport_size({"width": 1400, "height": 900})
    page.goto(server.url + "/new")
    labels = page.locator("#essentials .field > label")
    expect(labels.first).to_be_visible()
    cut = labels.evaluate_all("ls => ls.filter(l => l.scrollWidth > l.clientWidth + 1).map(l => l.textContent)")
    assert cut == [], cut
    field = page.locator("#essentials .field[data-key='train.lr']")
    field.locator("input").focus()
    help_text = field.locator(".help")
    assert help_text.evaluate("h => h.scrollWidth <= h.clientWidth + 1"), "the help of the field being edited is shown whole"
    page.close()


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
