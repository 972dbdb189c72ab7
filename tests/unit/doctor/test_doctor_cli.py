"""``zeropipe doctor`` as the user runs it: grouped report, exit status, --json, and a real run here."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest
from doctor_machines import rtx_4090_box, toolkit

import zeropipe.doctor
from zeropipe.cli import doctor as doctor_cli


def arguments(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    doctor_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_register_adds_the_doctor_command():
    parser = argparse.ArgumentParser()
    doctor_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", "--json", "--no-build", "--runs-dir", "/data/runs"])
    assert args.run is doctor_cli.run and args.json and args.no_build and args.runs_dir == "/data/runs"


def test_an_error_gives_exit_status_1_and_the_fix_under_it(monkeypatch, capsys):
    monkeypatch.setattr(zeropipe.doctor, "gather_facts", lambda *a, **k: rtx_4090_box(cuda_toolkit=toolkit("13.0")))
    assert doctor_cli.run(arguments("--no-build")) == 1
    out = capsys.readouterr().out
    cuda = out[out.index("CUDA toolkit") :]
    assert "[error]" in cuda.splitlines()[1]
    assert "fix: set DS_SKIP_CUDA_CHECK=1" in cuda
    assert "[warning] GeForce RTX 40xx: set NCCL_P2P_DISABLE=1" in out
    assert "1 error, 1 warning" in out.splitlines()[-1]


def test_warnings_alone_give_exit_status_0(monkeypatch, capsys):
    monkeypatch.setattr(zeropipe.doctor, "gather_facts", lambda *a, **k: rtx_4090_box())
    assert doctor_cli.run(arguments("--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"id", "title", "status", "detail", "fix"} <= set(report["findings"][0])
    assert report["facts"]["gpus"]["gpus"][0]["name"] == "NVIDIA GeForce RTX 4090"


def test_this_machine_in_words(tmp_path, capsys):
    """The real gather here: a missing GPU is said plainly, and RAM, disk, shm and versions are still reported."""
    import torch

    status = doctor_cli.run(arguments("--no-build", "--runs-dir", str(tmp_path / "runs")))
    out = capsys.readouterr().out
    for section in ("GPUs", "CUDA toolkit", "DeepSpeed CPU Adam", "Versions", "Host memory", "Disk", "Environment"):
        assert f"\n{section}\n" in f"\n{out}", section
    if torch.cuda.is_available():
        assert "GPU" in out.split("\n\n")[0]
    else:
        assert "[warning] No GPU: training runs on CPU ranks (gloo)" in out
        # The bf16 decision for CPU ranks, read from this CPU's flags.
        from zeropipe.doctor.facts import cpu_runs_bf16_natively

        decision = "precision: auto trains CPU ranks in bf16" if cpu_runs_bf16_natively() else "precision: auto trains CPU ranks in fp32 here"
        assert decision in out, out
    assert "Host RAM:" in out and "/dev/shm" in out and "free for runs" in out and "deepspeed " in out
    assert status == (1 if "[error]" in out else 0)


@pytest.mark.timeout(600)
def test_the_real_command_with_the_trial_build_prints_json(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "zeropipe.cli.doctor", "--json", "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=600
    )
    report = json.loads(done.stdout)
    findings = {f["id"]: f for f in report["findings"]}
    assert done.returncode == (1 if any(f["status"] == "error" for f in findings.values()) else 0), done.stderr
    for reported in ("memory.ram", "memory.swap", "memory.shm", "disk.runs", "versions.torch", "versions.deepspeed", "versions.pydantic", "cuda.toolkit"):
        assert reported in findings
    assert ("gpu.none" in findings) != ("gpu.devices" in findings)
    build = findings["cpu_adam.build"]
    # DeepSpeed's CPU Adam is what CPU ranks and offloaded runs step with; the test suite's runs need it too.
    assert build["status"] == "ok", build
    assert report["facts"]["cpu_adam"]["module_file"]
    assert report["facts"]["disk"]["checked_path"] == str(tmp_path)
