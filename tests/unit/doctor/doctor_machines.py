"""Described machines for the doctor tests: a healthy 5x RTX 4090 box and the pieces to change it."""

from __future__ import annotations

from dataclasses import replace

from zeropipe.doctor import facts
from zeropipe.doctor.checks import GiB
from zeropipe.doctor.facts import CpuAdamBuild, CudaToolkit, DiskFacts, Gpu, GpuFacts, MachineFacts, MemoryFacts, PackageVersions, PeerAccess

NVCC_13_0 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""

DEEPSPEED_MINOR_MISMATCH_OK = {11: ["11.0", "11.8"], 12: ["12.0", "12.1", "12.4", "12.6", "12.8", "12.9"]}


def nvcc_output(release: str) -> str:
    return NVCC_13_0.replace("13.0", release)


def toolkit(release: str | None = "12.8") -> CudaToolkit:
    return CudaToolkit(
        cuda_home="/usr/local/cuda",
        cuda_home_from="CUDA_HOME",
        nvcc_path="/usr/local/cuda/bin/nvcc" if release else None,
        nvcc_version_output=nvcc_output(release) if release else None,
        deepspeed_minor_mismatch_ok=DEEPSPEED_MINOR_MISMATCH_OK,
    )


def environment(**values: str) -> dict[str, str | None]:
    env: dict[str, str | None] = {name: None for name in facts.ENVIRONMENT_VARIABLES}
    env.update(values)
    return env


def gpu_box(name: str = "NVIDIA GeForce RTX 4090", count: int = 5, capability=(8, 9), p2p: bool = False) -> GpuFacts:
    gpus = [Gpu(i, name, 24 * GiB, capability) for i in range(count)]
    peers = [PeerAccess(a, b, p2p) for a in range(count) for b in range(count) if a != b]
    return GpuFacts(torch_cuda_version="12.8", cuda_available=True, gpus=gpus, peer_access=peers, nvidia_driver_version="570.86.15")


def rtx_4090_box(**changes) -> MachineFacts:
    """5x RTX 4090 with 64 GB of RAM, everything else healthy; tests change one thing at a time."""
    machine = MachineFacts(
        versions=PackageVersions("3.11.9", {"torch": "2.7.1+cu128", "deepspeed": "0.17.5", "transformers": "4.56.1", "peft": "0.17.1", "pydantic": "2.11.7"}),
        gpus=gpu_box(),
        cuda_toolkit=toolkit("12.8"),
        memory=MemoryFacts(ram_total_bytes=64 * GiB, ram_available_bytes=60 * GiB, swap_total_bytes=32 * GiB, swap_used_bytes=0, shm_total_bytes=32 * GiB, shm_free_bytes=32 * GiB),
        disk=DiskFacts(runs_dir="/data/runs", checked_path="/data/runs", free_bytes=900 * GiB, total_bytes=2000 * GiB),
        environment=environment(),
        cpu_adam=CpuAdamBuild(ok=True, seconds=12.0, load_seconds=0.4, module_file="/root/.cache/torch_extensions/py311_cu128/cpu_adam/cpu_adam.so"),
    )
    return replace(machine, **changes)
