"""End-to-end: the real `zeropipe ui` process, driven in Debian's headless Chromium by Playwright.

Playwright's own browser download is never used (it cannot work here): Chromium comes from
the distribution (`apt-get install chromium`, done by scripts/setup.sh) and is launched by
its path. Without it, or without the playwright package, these tests are skipped.
Screenshots go to $ZEROPIPE_SCREENSHOTS (default /tmp/zeropipe-e2e) for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

CHROMIUM = os.environ.get("ZEROPIPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]
SCREENSHOTS = Path(os.environ.get("ZEROPIPE_SCREENSHOTS", "/tmp/zeropipe-e2e"))


def pytest_configure(config):
    config.addinivalue_line("markers", "e2e: browser tests of `zeropipe ui` in headless Chromium (some train tiny real runs)")


class UiServer:
    """`zeropipe ui --port 0` in a subprocess; restartable on the same runs folder and database."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.runs = workdir / "runs"
        self.data = workdir / "data"
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("DS_ACCELERATOR", None)
        self.log = open(self.workdir / "ui.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zeropipe", "ui", "--port", "0", "--runs-dir", str(self.runs), "--data-dir", str(self.data)],
            cwd=self.workdir, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env,
        )  # fmt: skip
        line = self.proc.stdout.readline()
        match = re.match(r"zeropipe ui: (http://127\.0\.0\.1:\d+)/", line)
        assert match, f"zeropipe ui printed {line!r}; log: {(self.workdir / 'ui.log').read_text()[-2000:]}"
        self.url = match.group(1)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/api/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("zeropipe ui did not answer")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def api(self, path: str, body: dict | None = None):
        request = urllib.request.Request(self.url + path, data=None if body is None else json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.load(response)

    def run(self, name: str) -> dict:
        return next(r for r in self.api("/api/runs")["runs"] if r["name"] == name)


def end_training_processes(runs: Path) -> None:
    """Whatever a failing test left running: launchers and ranks named in the run directories."""
    for status_file in runs.glob("*/status.json"):
        try:
            status = json.loads(status_file.read_text())
        except ValueError:
            continue
        for pid in [status.get("supervisor_pid"), *(status.get("pids") or [])]:
            try:
                process = psutil.Process(pid)
                if "zeropipe" in " ".join(process.cmdline()):
                    process.kill()
            except (psutil.Error, TypeError, ValueError):
                pass


@pytest.fixture(scope="session")
def browser():
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set ZEROPIPE_CHROMIUM)")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def ui(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ui")
    server = UiServer(workdir)
    server.data.mkdir()
    server.runs.mkdir()
    # Runs that need no training: a failed one, a diffusion one with samples, a finished baseline.
    from tests.e2e.fake_runs import DIAGNOSIS_TEXT, as_diffusion_metrics, write_run, write_samples

    write_run(server.runs, "sdxl-oom", state="failed", steps=3, total_steps=500, checkpoints=(), diagnosis=DIAGNOSIS_TEXT)
    write_samples(as_diffusion_metrics(write_run(server.runs, "sdxl-lora", steps=100, checkpoints=(50, 100))), steps=(50, 100))
    write_run(server.runs, "baseline", steps=60, checkpoints=(60,))
    server.start()
    yield server
    server.stop()
    end_training_processes(server.runs)


@pytest.fixture
def page(browser, ui):
    # Playwright's wait_for_function polls its predicate with eval, which the UI's content
    # security policy refuses (script-src 'self'): these pages bypass it. test_ui_hardening.py
    # opens every page under the real policy.
    context = browser.new_context(viewport={"width": 1400, "height": 1000}, bypass_csp=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    # A page of this UI never asks for something that is not there, nor gets a 5xx.
    page.on("response", lambda r: errors.append(f"{r.status} for {r.request.method} {r.url}") if r.status == 404 or r.status >= 500 else None)
    page.on("dialog", lambda dialog: dialog.accept())  # the Stop button asks to confirm
    page.errors = errors
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def screenshot(page, name: str, full_page: bool = True) -> Path:
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


