"""Finding out the facts: the trial build's child process, folders, the driver file, DeepSpeed's table."""

from __future__ import annotations

from pathlib import Path

import pytest

from zeropipe.doctor import checks, facts
from zeropipe.doctor.facts import CpuAdamBuild


def test_nearest_existing_folder(tmp_path):
    assert facts.nearest_existing_folder(tmp_path / "runs" / "deeper") == tmp_path
    (tmp_path / "runs").mkdir()
    assert facts.nearest_existing_folder(tmp_path / "runs") == tmp_path / "runs"


def test_disk_of_a_runs_dir_that_does_not_exist_yet(tmp_path):
    disk = facts.gather_disk(tmp_path / "runs")
    assert disk.checked_path == str(tmp_path)
    assert disk.free_bytes > 0 and disk.total_bytes >= disk.free_bytes


def test_nvidia_driver_version_from_proc_file(tmp_path):
    proc = tmp_path / "version"
    proc.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan 22 2025\nGCC version:  gcc 12\n")
    assert facts.nvidia_driver_version(str(proc)) == "570.86.15"
    assert facts.nvidia_driver_version(str(tmp_path / "missing")) is None


def test_deepspeeds_minor_mismatch_table_is_read_without_importing_it():
    pytest.importorskip("deepspeed")
    table = facts.deepspeed_minor_mismatch_table()
    assert table is not None and "12.8" in table[12]


def test_extensions_build_dir_is_torchs_with_and_without_torch_extensions_dir(monkeypatch, tmp_path):
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert facts.torch_extensions_build_dir("cpu_adam", None) == tmp_path / "cpu_adam"
    assert facts.torch_extensions_build_dir("cpu_adam", None) == Path(_get_build_directory("cpu_adam", verbose=False))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert facts.torch_extensions_build_dir("cpu_adam", "12.8").parent.name.endswith("_cu128")
    assert facts.torch_extensions_build_dir("cpu_adam", None).parent.parent == tmp_path / "cache" / "torch_extensions"


def test_a_failing_build_reports_its_last_lines_and_a_stale_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build_dir = facts.torch_extensions_build_dir("cpu_adam", None)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    monkeypatch.setattr(facts, "TRIAL_BUILD_SCRIPT", "print('compiling cpu_adam.cpp'); raise RuntimeError('Ninja is required to load C++ extensions')")
    build = facts.try_cpu_adam_build(cuda_available=False, torch_cuda_version=None, timeout_seconds=60)
    assert not build.ok and not build.timed_out
    assert build.returncode == 1
    assert build.accelerator == "cpu"  # no CUDA: the child runs as the CPU ranks do
    assert build.stale_lock
    assert any("Ninja is required" in line for line in build.output_tail)
    finding = checks.check_cpu_adam_build(build)[0]
    assert finding.status == "error" and finding.fix.startswith("pip install ninja")


def test_a_hung_build_is_stopped_at_the_timeout(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(facts, "TRIAL_BUILD_SCRIPT", "import time; print('waiting for lock', flush=True); time.sleep(120)")
    build = facts.try_cpu_adam_build(cuda_available=False, torch_cuda_version=None, timeout_seconds=2)
    assert build.timed_out and not build.ok
    assert build.seconds < 30
    assert "waiting for lock" in build.output_tail
    assert checks.check_cpu_adam_build(build)[0].status == "warning"


def test_a_successful_child_is_ok(monkeypatch):
    script = f"import json; print({facts.RESULT_MARKER!r} + json.dumps({{'load_seconds': 0.2, 'module_file': '/x/cpu_adam/cpu_adam.so'}}))"
    monkeypatch.setattr(facts, "TRIAL_BUILD_SCRIPT", script)
    build = facts.try_cpu_adam_build(cuda_available=True, torch_cuda_version="12.8", timeout_seconds=60)
    assert build.ok and build.module_file == "/x/cpu_adam/cpu_adam.so"
    assert build.output_tail == []
    finding = checks.check_cpu_adam_build(build)[0]
    assert finding.status == "ok" and "/x/cpu_adam" in finding.detail


def test_gather_on_this_machine_without_the_build(tmp_path):
    machine = facts.gather_facts(tmp_path / "runs", trial_build=False)
    assert machine.cpu_adam == CpuAdamBuild(skipped_reason="--no-build was given")
    assert machine.memory.ram_total_bytes > 0
    assert machine.versions.installed["torch"]
    assert machine.disk.checked_path == str(tmp_path)
    assert set(machine.environment) == set(facts.ENVIRONMENT_VARIABLES)
