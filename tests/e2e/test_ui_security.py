"""Issue 26, defects 1-4, as hand-made HTTP requests against a real `zeropipe ui` on 127.0.0.1.

No browser: these are the requests any local user or process can send to a UI without a token.
Two servers: one as started by default, one with --trust-multinode (which still passes only
the ssh allow-list, and still confines the hostfile). Nothing is trained: every payload must be
refused before a process starts.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

SECRET = "root:$6$SECRET-HASH-THAT-MUST-NOT-LEAK:19000:0:99999:7:::"
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


class Server:
    def __init__(self, workdir: Path, *flags: str):
        self.workdir, self.runs, self.data = workdir, workdir / "runs", workdir / "data"
        self.runs.mkdir(exist_ok=True)
        self.data.mkdir(exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(workdir))
        with open(workdir / "ui.log", "a") as log:  # the server keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zeropipe", "ui", "--port", "0", "--runs-dir", str(self.runs), "--data-dir", str(self.data), *flags],
                cwd=workdir, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            )  # fmt: skip
        line = self.proc.stdout.readline()
        match = re.match(r"zeropipe ui: (http://127\.0\.0\.1:\d+)/", line)
        if not match:
            self.proc.kill()
        assert match, f"zeropipe ui printed {line!r}; log: {(workdir / 'ui.log').read_text()[-2000:]}"
        self.url = match.group(1)

    def post(self, path: str, body: dict) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started: list[Server] = []
    try:
        started.append(Server(tmp_path_factory.mktemp("ui")))
        started.append(Server(tmp_path_factory.mktemp("ui-trusting"), "--trust-multinode"))
        yield tuple(started)
    finally:
        for server in started:
            server.stop()


def quickstart(name: str, **sections) -> dict:
    config = {
        "run": {"name": name},
        "model": {"config": TINY},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4, "micro_batch_size": 4},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
    }
    for section, values in sections.items():
        config[section] = config.get(section, {}) | values
    return config


def keys(answer: dict) -> set[str]:
    return {p["key"] for p in answer.get("problems") or []} | {f["key"] for f in answer.get("findings") or [] if f["severity"] == "error"}


def test_a_proxycommand_payload_is_refused_and_runs_nothing(servers, tmp_path):
    """The issue's payload: checked valid and launched on main, and 7 s later pwned.txt held `uid=0(root)`."""
    pwned = tmp_path / "pwned.txt"
    payload = {"gpus": 1, "nodes": ["localhost", "127.0.0.2"], "ssh_options": f"-o ProxyCommand='sh -c \"id > {pwned}\"'"}
    default, trusting = servers
    for server in servers:
        status, answer = server.post("/api/config/check", {"config": quickstart("pwn", hardware=payload)})
        assert status == 200 and answer["valid"] is False and "hardware.ssh_options" in keys(answer), answer
        status, answer = server.post("/api/runs", {"config": quickstart("pwn", hardware=payload)})
        assert 400 <= status < 500 and "hardware.ssh_options" in keys(answer), (status, answer)
    # Without --trust-multinode, naming other machines at all is refused, with the flag that allows it.
    status, answer = default.post("/api/runs", {"config": quickstart("pwn", hardware={"nodes": ["localhost", "127.0.0.2"]})})
    assert status == 422 and "hardware.nodes" in keys(answer) and "--trust-multinode" in answer["detail"]
    for options in ("-J attacker@evil.example", "-o PermitLocalCommand=yes -o LocalCommand=id", f"-F {tmp_path}/ssh_config", "-oProxyJump=evil"):
        status, answer = trusting.post("/api/runs", {"config": quickstart("pwn", hardware={"nodes": ["localhost", "127.0.0.2"], "ssh_options": options})})
        assert 400 <= status < 500 and "hardware.ssh_options" in keys(answer), (options, status, answer)
    # A host name that is an ssh option.
    status, answer = trusting.post("/api/runs", {"config": quickstart("pwn", hardware={"nodes": ["localhost", f"-oProxyCommand=id>{pwned}"]})})
    assert 400 <= status < 500 and any(key.startswith("hardware.nodes") for key in keys(answer)), answer
    time.sleep(1)
    assert not pwned.exists()
    assert not [path for server in servers for path in server.runs.glob("pwn*")]  # no run directory: nothing was started


def test_a_hostfile_outside_the_folders_is_refused_without_echoing_it(servers, tmp_path):
    shadow = tmp_path / "shadow"
    shadow.write_text(SECRET + "\nbin:*:19000:0:99999:7:::\n")
    for server in servers:
        status, answer = server.post("/api/config/check", {"config": quickstart("hosts", hardware={"hostfile": str(shadow)})})
        assert status == 200 and answer["valid"] is False and "hardware.hostfile" in keys(answer), answer
        assert "SECRET" not in json.dumps(answer)
    # Inside the data folder of a trusting UI, a file that is no hostfile is named by line, never quoted.
    trusting = servers[1]
    inside = trusting.data / "hosts"
    inside.write_text(SECRET + "\n")
    status, answer = trusting.post("/api/config/check", {"config": quickstart("hosts", hardware={"hostfile": str(inside)})})
    assert answer["valid"] is False and "line 1" in json.dumps(answer) and "SECRET" not in json.dumps(answer), answer
    status, answer = trusting.post("/api/runs", {"config": quickstart("hosts", hardware={"hostfile": str(inside)})})
    assert 400 <= status < 500 and "SECRET" not in json.dumps(answer), answer


def test_a_deepspeed_json_writing_outside_the_folders_is_refused(servers, tmp_path):
    default = servers[0]
    elsewhere = tmp_path / "elsewhere"
    ds = default.data / "ds.json"
    ds.write_text(json.dumps({"csv_monitor": {"enabled": True, "output_path": str(elsewhere), "job_name": "x"}}))
    config = quickstart("csv", deepspeed={"config_file": str(ds)})
    status, answer = default.post("/api/config/check", {"config": config})
    assert answer["valid"] is False and "deepspeed.config_file:csv_monitor.output_path" in keys(answer), answer
    status, answer = default.post("/api/runs", {"config": config})
    assert status == 422 and "deepspeed.config_file:csv_monitor.output_path" in keys(answer), (status, answer)
    # Saved as a preset, loaded again and checked: the same refusal.
    status, _ = default.post("/api/presets", {"name": "csv-elsewhere", "yaml": yaml.safe_dump(config)})
    assert status == 201
    with urllib.request.urlopen(f"{default.url}/api/presets/saved/csv-elsewhere", timeout=60) as response:
        preset = json.load(response)["yaml"]
    status, answer = default.post("/api/config/check", {"yaml": preset})
    assert answer["valid"] is False and "deepspeed.config_file:csv_monitor.output_path" in keys(answer) and not elsewhere.exists()


def test_a_symlink_out_of_a_data_folder_is_not_previewed(servers, tmp_path):
    default = servers[0]
    secret = tmp_path / "secret.jsonl"
    secret.write_text(json.dumps({"text": SECRET}) + "\n")
    texts = default.data / "texts"
    texts.mkdir()
    (texts / "a.jsonl").write_text("".join(json.dumps({"text": f"two plus {i} is {i + 2}"}) + "\n" for i in range(20)))
    (texts / "b.jsonl").symlink_to(secret)
    status, answer = default.post("/api/data/preview", {"config": quickstart("preview", data={"path": str(texts), "synthetic": None})})
    assert status == 200 and "SECRET" not in json.dumps(answer), answer
    assert [row["file"] for row in answer["skipped"]] == ["b.jsonl"] and "outside" in answer["skipped"][0]["reason"]
    # The symlinked file itself, named as data.path, is refused (it resolves outside the folders).
    status, answer = default.post("/api/data/preview", {"config": quickstart("preview", data={"path": str(texts / "b.jsonl"), "synthetic": None})})
    assert status == 422 and "SECRET" not in json.dumps(answer)
