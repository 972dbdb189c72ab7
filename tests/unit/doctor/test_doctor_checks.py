"""The doctor's judgements on described machines: no GPU needed to test a 5x RTX 4090 box."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import tomllib
from doctor_machines import NVCC_13_0, environment, gpu_box, rtx_4090_box, toolkit
from packaging.requirements import Requirement

from zeropipe.doctor import checks
from zeropipe.doctor.checks import GiB, MiB, examine
from zeropipe.doctor.facts import CpuAdamBuild, DiskFacts, Gpu, GpuFacts, MemoryFacts, PackageVersions


def by_id(findings, finding_id):
    matching = [f for f in findings if f.id == finding_id]
    assert len(matching) == 1, f"{finding_id}: {[f.id for f in findings]}"
    return matching[0]


def statuses(findings) -> dict[str, str]:
    return {f.id: f.status for f in findings}


def test_the_healthy_box_has_no_warnings_or_errors():
    findings = examine(rtx_4090_box(environment=environment(NCCL_P2P_DISABLE="1")))
    assert {f.status for f in findings} <= {"ok", "info"}, [(f.id, f.status, f.title) for f in findings if f.status not in ("ok", "info")]
    gpus = by_id(findings, "gpu.devices")
    assert "5 x NVIDIA GeForce RTX 4090" in gpus.detail and "24.0 GiB" in gpus.detail and "8.9" in gpus.detail


def test_rtx_40xx_without_p2p_disable_is_told_to_set_it():
    finding = by_id(examine(rtx_4090_box()), "gpu.peer_access")
    assert finding.status == "warning"
    assert "NCCL_P2P_DISABLE=1" in finding.fix
    assert "no pair of GPUs has peer access" in finding.detail


def test_pairs_without_peer_access_are_named():
    box = gpu_box("NVIDIA RTX A6000", count=3, p2p=True)
    box.peer_access = [p if {p.from_gpu, p.to_gpu} != {0, 2} else replace(p, possible=False) for p in box.peer_access]
    finding = by_id(checks.check_gpus(box, environment()), "gpu.peer_access")
    assert finding.status == "info"
    assert "between GPUs 0-2" in finding.detail


def test_rtx_40xx_with_p2p_disable_set_is_ok():
    finding = by_id(examine(rtx_4090_box(environment=environment(NCCL_P2P_DISABLE="1"))), "gpu.peer_access")
    assert finding.status == "ok"


def test_cards_with_working_p2p_need_no_variable():
    findings = checks.check_gpus(gpu_box("NVIDIA L40", count=4, p2p=True), environment())
    assert by_id(findings, "gpu.peer_access").status == "ok"
    turned_off = checks.check_gpus(gpu_box("NVIDIA L40", count=4, p2p=True), environment(NCCL_P2P_DISABLE="1"))
    assert "unset NCCL_P2P_DISABLE" in by_id(turned_off, "gpu.peer_access").fix


def test_one_gpu_has_no_peer_access_finding():
    findings = checks.check_gpus(gpu_box(count=1), environment())
    assert "gpu.peer_access" not in statuses(findings)


def test_pre_ampere_gpus_are_told_to_use_fp16():
    finding = by_id(checks.check_gpus(gpu_box("Tesla V100-SXM2-32GB", count=2, capability=(7, 0), p2p=True), environment()), "gpu.bf16")
    assert finding.status == "warning"
    assert "deepspeed.precision: fp16" in finding.fix
    assert by_id(examine(rtx_4090_box()), "gpu.bf16").status == "ok"


def test_mixed_gpu_models_are_a_warning():
    box = gpu_box(count=2, p2p=True)
    box.gpus[1] = Gpu(1, "NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6))
    assert by_id(checks.check_gpus(box, environment()), "gpu.mixed").status == "warning"


def test_cuda_major_mismatch_is_an_error_with_the_known_escape():
    finding = by_id(examine(rtx_4090_box(cuda_toolkit=toolkit("13.0"))), "cuda.toolkit")
    assert finding.status == "error"
    assert "DS_SKIP_CUDA_CHECK=1" in finding.fix
    assert "CUDA_HOME" in finding.fix  # the other way out: the matching toolkit
    assert "12.8" in finding.title and "13.0" in finding.title


def test_cuda_major_mismatch_with_the_escape_set_is_a_warning():
    finding = by_id(examine(rtx_4090_box(cuda_toolkit=toolkit("13.0"), environment=environment(DS_SKIP_CUDA_CHECK="1"))), "cuda.toolkit")
    assert finding.status == "warning"


@pytest.mark.parametrize(
    ("torch_cuda", "nvcc", "expected"),
    [
        ("12.8", "12.8", "ok"),
        ("12.8", "12.6", "warning"),  # a pair DeepSpeed's table accepts
        ("13.0", "13.1", "error"),  # DeepSpeed lists no 13.x pairs, so it refuses
        ("12.8", "13.0", "error"),
    ],
)
def test_cuda_versions(torch_cuda, nvcc, expected):
    finding = by_id(checks.check_cuda_toolkit(torch_cuda, toolkit(nvcc), environment()), "cuda.toolkit")
    assert finding.status == expected, finding
    if expected == "error":
        assert "DS_SKIP_CUDA_CHECK=1" in finding.fix


def test_cuda_minor_pairs_missing_from_deepspeeds_table_are_explained():
    # CUDA 12.7 (between 12.6 and 12.8 in the table) and 13.x (no entries): gaps in DeepSpeed's list.
    gap = by_id(checks.check_cuda_toolkit("12.8", toolkit("12.7"), environment()), "cuda.toolkit")
    assert gap.status == "error" and "lacks 12.7" in gap.detail and "gap in DeepSpeed's table" in gap.detail
    thirteen = by_id(checks.check_cuda_toolkit("13.0", toolkit("13.1"), environment()), "cuda.toolkit")
    assert "lists no CUDA 13.x releases at all" in thirteen.detail and "DS_SKIP_CUDA_CHECK=1" in thirteen.fix


def test_cuda_torch_without_nvcc_is_a_warning():
    finding = by_id(checks.check_cuda_toolkit("12.8", toolkit(None), environment()), "cuda.toolkit")
    assert finding.status == "warning"
    assert "12.8" in finding.fix


def test_nvcc_release_is_read_from_its_output():
    assert checks.nvcc_release(NVCC_13_0) == (13, 0)
    assert checks.nvcc_release("garbage") is None


def test_no_gpu_is_said_plainly_and_the_rest_is_still_checked():
    cpu_only = GpuFacts(torch_cuda_version=None, cuda_available=False)
    findings = examine(rtx_4090_box(gpus=cpu_only))
    finding = by_id(findings, "gpu.none")
    assert finding.status == "warning"
    assert finding.title.startswith("No GPU")
    assert "CPU ranks" in finding.title
    assert by_id(findings, "cuda.toolkit").status == "info"  # nvcc is irrelevant to a CPU build of torch
    for still_checked in ("memory.ram", "memory.swap", "memory.shm", "disk.runs", "versions.deepspeed", "cpu_adam.build"):
        by_id(findings, still_checked)


def test_driver_with_cpu_only_torch_is_an_error():
    finding = by_id(checks.check_gpus(GpuFacts(torch_cuda_version=None, cuda_available=False, nvidia_driver_version="570.86.15"), environment()), "gpu.none")
    assert finding.status == "error"
    assert "CUDA build of torch" in finding.fix


def test_driver_too_old_for_torch_cuda_is_an_error():
    finding = by_id(checks.check_gpus(GpuFacts(torch_cuda_version="12.8", cuda_available=False, nvidia_driver_version="470.1"), environment()), "gpu.none")
    assert finding.status == "error"
    assert "driver" in finding.fix


def test_hidden_gpus_are_an_error():
    finding = by_id(checks.check_gpus(GpuFacts(torch_cuda_version="12.8", cuda_available=False), environment(CUDA_VISIBLE_DEVICES="")), "gpu.none")
    assert finding.status == "error"
    assert "CUDA_VISIBLE_DEVICES" in finding.fix


def test_torch_that_does_not_import_is_an_error():
    broken = GpuFacts(torch_cuda_version=None, cuda_available=False, torch_import_error="ImportError: libcudart.so.12: cannot open shared object file")
    finding = by_id(checks.check_gpus(broken, environment()), "gpu.torch")
    assert finding.status == "error" and "libcudart" in finding.detail


def test_small_dev_shm_is_a_warning_with_the_docker_fix():
    small = MemoryFacts(ram_total_bytes=64 * GiB, ram_available_bytes=60 * GiB, swap_total_bytes=0, swap_used_bytes=0, shm_total_bytes=64 * MiB, shm_free_bytes=64 * MiB)
    finding = by_id(examine(rtx_4090_box(memory=small)), "memory.shm")
    assert finding.status == "warning"
    assert "--shm-size" in finding.fix
    assert "64 MiB" in finding.title


def test_no_swap_is_a_warning():
    no_swap = MemoryFacts(ram_total_bytes=64 * GiB, ram_available_bytes=60 * GiB, swap_total_bytes=0, swap_used_bytes=0, shm_total_bytes=32 * GiB, shm_free_bytes=32 * GiB)
    findings = checks.check_host_memory(no_swap)
    assert by_id(findings, "memory.swap").status == "warning"
    assert "swap" in by_id(findings, "memory.swap").fix
    assert by_id(findings, "memory.ram").status == "ok"


def test_little_available_ram_is_a_warning():
    tight = MemoryFacts(ram_total_bytes=64 * GiB, ram_available_bytes=6 * GiB, swap_total_bytes=8 * GiB, swap_used_bytes=0)
    assert by_id(checks.check_host_memory(tight), "memory.ram").status == "warning"


@pytest.mark.parametrize(("free_gib", "expected"), [(900, "ok"), (20, "warning"), (2, "error")])
def test_free_disk_for_runs(free_gib, expected):
    disk = DiskFacts(runs_dir="/data/runs", checked_path="/data", free_bytes=free_gib * GiB, total_bytes=2000 * GiB)
    finding = by_id(examine(rtx_4090_box(disk=disk)), "disk.runs")
    assert finding.status == expected
    assert "/data" in finding.detail
    if expected != "ok":
        assert "run.output_dir" in finding.fix


def test_pydantic_1_with_deepspeed_0_17_is_an_error():
    versions = PackageVersions("3.11.9", {"torch": "2.7.1", "deepspeed": "0.17.0", "transformers": "4.56.0", "peft": "0.17.0", "pydantic": "1.10.13"})
    finding = by_id(checks.check_versions(versions), "versions.pydantic")
    assert finding.status == "error"
    assert "deepspeed" in finding.title and "pydantic>=2" in finding.fix


def test_packages_too_old_or_missing_are_errors_with_the_install_command():
    versions = PackageVersions("3.11.9", {"torch": "2.7.1", "deepspeed": None, "transformers": "4.50.3", "peft": "0.17.0", "pydantic": "2.11.0"})
    findings = checks.check_versions(versions)
    assert by_id(findings, "versions.transformers").status == "error"
    assert "transformers>=4.56" in by_id(findings, "versions.transformers").fix
    assert by_id(findings, "versions.deepspeed").status == "error"
    assert "deepspeed>=0.17" in by_id(findings, "versions.deepspeed").fix
    assert by_id(findings, "versions.torch").status == "ok"


def test_minimum_versions_follow_pyproject():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())
    declared = {}
    for dependency in pyproject["project"]["dependencies"]:
        requirement = Requirement(dependency)
        for spec in requirement.specifier:
            if spec.operator == ">=":
                declared[requirement.name] = spec.version
    for name, minimum in checks.MINIMUM_VERSIONS.items():
        assert declared.get(name) == minimum, f"{name}: doctor says >={minimum}, pyproject.toml says {declared.get(name)}"
    assert pyproject["project"]["requires-python"] == f">={checks.MINIMUM_PYTHON}"


def test_failed_build_with_cuda_mismatch_suggests_the_escape():
    build = CpuAdamBuild(
        ok=False,
        returncode=1,
        seconds=40,
        output_tail=["deepspeed.ops.op_builder.builder.CUDAMismatchException: >- DeepSpeed Op Builder: Installed CUDA version 13.0 does not match the version torch was compiled with 12.8, unable to compile"],
    )
    finding = by_id(checks.check_cpu_adam_build(build), "cpu_adam.build")
    assert finding.status == "error"
    assert "DS_SKIP_CUDA_CHECK=1" in finding.fix
    assert "13.0 does not match" in finding.detail  # the error's last lines are shown


def test_failed_compile_is_not_blamed_on_ninja():
    tail = ["/usr/include/cpu_adam.h:3:10: fatal error: Python.h: No such file or directory", "ninja: build stopped: subcommand failed."]
    assert "Python headers" in checks.build_failure_fix("\n".join(tail))
    assert checks.build_failure_fix("RuntimeError: Ninja is required to load C++ extensions").startswith("pip install ninja")
    assert checks.build_failure_fix("something new") == checks.GENERIC_BUILD_FIX


def test_skipped_and_timed_out_builds():
    assert by_id(checks.check_cpu_adam_build(CpuAdamBuild(skipped_reason="--no-build was given")), "cpu_adam.build").status == "info"
    timed_out = CpuAdamBuild(timed_out=True, timeout_seconds=900, build_dir="/root/.cache/torch_extensions/py311_cpu/cpu_adam", stale_lock=True)
    finding = by_id(checks.check_cpu_adam_build(timed_out), "cpu_adam.build")
    assert finding.status == "warning"
    assert "lock" in finding.fix


def test_ds_accelerator_cpu_on_a_gpu_box_is_a_warning():
    findings = examine(rtx_4090_box(environment=environment(DS_ACCELERATOR="cpu", NCCL_P2P_DISABLE="1")))
    assert by_id(findings, "environment.ds_accelerator").status == "warning"
    listed = by_id(findings, "environment.variables")
    assert listed.status == "info" and "NCCL_P2P_DISABLE=1" in listed.detail and "DS_SKIP_CUDA_CHECK unset" in listed.detail


# --- precision on CPU ranks ----------------------------------------------------------------------


@pytest.mark.parametrize(("bf16_native", "status", "precision"), [(False, "warning", "fp32"), (True, "ok", "bf16")])
def test_cpu_ranks_are_told_which_precision_auto_picks_and_why(bf16_native, status, precision):
    cpu_only = GpuFacts(torch_cuda_version=None, cuda_available=False)
    finding = by_id(examine(rtx_4090_box(gpus=cpu_only, cpu_bf16_native=bf16_native)), "cpu.bf16")
    assert finding.status == status
    assert f"precision: auto trains CPU ranks in {precision}" in finding.detail
    if not bf16_native:
        assert "18-56x slower than fp32" in finding.detail and "avx512_bf16 or AMX" in finding.detail
        assert "precision: auto" in finding.fix


def test_gpu_boxes_get_no_cpu_precision_finding():
    assert "cpu.bf16" not in {f.id for f in examine(rtx_4090_box(cpu_bf16_native=False))}
