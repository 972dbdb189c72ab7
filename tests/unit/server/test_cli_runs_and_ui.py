"""`zeropipe runs ls|show|logs|stop` and `zeropipe ui` from the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from tests.e2e.fake_runs import write_run
from zeropipe.cli.main import main


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "done", steps=12)
    write_run(root, "oom", state="failed", steps=5, total_steps=12, checkpoints=())
    return root


def zp(*args) -> int:
    return main(list(args))


def test_runs_ls_lists_state_step_and_loss(runs, capsys):
    assert zp("runs", "ls", "--runs-dir", str(runs)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "NAME", "STATE", "STEP", "ETA", "LOSS", "STARTED"]
    rows = {line.split()[1]: line.split() for line in out[1:]}
    assert rows["done"][2:4] == ["completed", "12/12"] and rows["oom"][2:4] == ["failed", "5/12"]
    assert zp("runs", "ls", "--runs-dir", str(runs), "--state", "failed", "--json") == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["oom"]


def test_runs_show_prints_the_diagnosis_of_a_failed_run(runs, capsys):
    assert zp("runs", "show", "oom", "--runs-dir", str(runs)) == 0
    out = capsys.readouterr().out
    assert "oom (id" in out and ": failed" in out and "rank 0 was killed by SIGKILL" in out
    assert zp("runs", "show", "done", "--runs-dir", str(runs)) == 0
    assert "checkpoints: step_00000012 (latest), step_00000006" in capsys.readouterr().out


def test_runs_logs_tails_a_rank(runs, capsys):
    assert zp("runs", "logs", "done", "--runs-dir", str(runs), "-n", "2") == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("step 12/12")


def test_runs_errors_are_messages(runs, capsys):
    assert zp("runs", "show", "nothing", "--runs-dir", str(runs)) == 2
    assert "no run 'nothing'" in capsys.readouterr().err
    assert zp("runs", "stop", "done", "--runs-dir", str(runs)) == 2
    assert "is completed, not running" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_ui_prints_its_url_serves_and_needs_a_token_off_loopback(runs, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeropipe", "ui", "--host", "0.0.0.0", "--port", "0", "--runs-dir", str(runs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    try:
        line = proc.stdout.readline()
        # Not http://0.0.0.0:PORT (no browser opens that): one of this machine's addresses.
        match = re.match(r"zeropipe ui: http://(\d+\.\d+\.\d+\.\d+):(\d+)/\?token=(\S+)", line)
        assert match, line + proc.stderr.read()
        address, port, token = match.groups()
        assert address != "0.0.0.0" and address in {a.address for addresses in psutil.net_if_addrs().values() for a in addresses}
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/runs", timeout=5):
                    pass
                raise AssertionError("served without the token")
            except urllib.error.HTTPError as err:
                assert err.code == 401
                break
            except urllib.error.URLError:
                assert time.time() < deadline
                time.sleep(0.3)
        request = urllib.request.Request(f"{base}/api/runs", headers={"Authorization": f"Bearer {token}"})
        deadline = time.time() + 30
        while True:
            with urllib.request.urlopen(request, timeout=5) as response:
                names = {r["name"] for r in json.load(response)["runs"]}
            if names or time.time() > deadline:
                break
            time.sleep(0.5)  # the first index pass runs in the background
        assert names == {"done", "oom"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def start_ui(runs, tmp_path, *args):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeropipe", "ui", "--port", "0", "--runs-dir", str(runs), *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env,
    )  # fmt: skip
    line = proc.stdout.readline()
    match = re.match(r"zeropipe ui: (http://\S+?:\d+)/", line)
    assert match, line + proc.stderr.read()
    return proc, match.group(1)


@pytest.mark.timeout(120)
def test_ctrl_c_stops_the_ui_while_a_browser_holds_event_streams(runs, tmp_path):
    """The port closed but the process stayed while a tab held /api/runs/stream; a second Ctrl-C printed CancelledError tracebacks."""
    import http.client
    import signal

    proc, url = start_ui(runs, tmp_path)
    streams = []
    try:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        for path in ["/api/runs/stream", "/api/runs/1/stream?after_step=0", "/api/runs/stream"]:
            deadline = time.time() + 30
            while True:
                try:
                    connection = http.client.HTTPConnection(host, int(port), timeout=30)
                    connection.request("GET", path, headers={"Accept": "text/event-stream"})
                    response = connection.getresponse()
                    break
                except ConnectionRefusedError:
                    assert time.time() < deadline
                    time.sleep(0.2)
            assert response.status == 200 and response.getheader("content-type").startswith("text/event-stream")
            assert response.readline().startswith(b"retry:")  # the stream is open and sending
            streams.append((connection, response))
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)  # one Ctrl-C
        proc.wait(timeout=15)
        took = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
        for connection, _ in streams:
            connection.close()
    stderr = proc.stderr.read()
    assert took < 2, f"zeropipe ui took {took:.1f} s to stop"  # 5.5-7.5 s when the interpreter tore itself down (issue 26)
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr


@pytest.mark.parametrize("token", ["", "  "])
def test_an_empty_token_is_refused_before_the_server_starts(runs, capsys, monkeypatch, token):
    """`--token ""` started a server that answered 401 to everything."""
    monkeypatch.delenv("ZEROPIPE_UI_TOKEN", raising=False)
    assert zp("ui", "--token", token, "--port", "0", "--runs-dir", str(runs)) == 2
    assert "the token is empty" in capsys.readouterr().err
    monkeypatch.setenv("ZEROPIPE_UI_TOKEN", token)
    from zeropipe.cli.main import build_parser

    args = build_parser().parse_args(["ui", "--port", "0", "--runs-dir", str(runs)])
    with pytest.raises(Exception, match="the token is empty"):
        args.run(args)
