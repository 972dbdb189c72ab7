"""Judge the facts about a machine: each check returns findings that say what is wrong and what to do.

Every function here is pure: it takes facts (``zeropipe.doctor.facts``) and returns
``Finding`` objects, so a test can describe a 5x RTX 4090 box without owning one.
A finding's id is ``area.name``; the area groups the human report.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import Literal

from packaging.version import InvalidVersion, Version

from zeropipe.doctor.facts import CpuAdamBuild, CudaToolkit, DiskFacts, GpuFacts, MachineFacts, MemoryFacts, PackageVersions

Status = Literal["ok", "warning", "error", "info"]

GiB = 1024**3
MiB = 1024**2

# Keep in step with pyproject.toml's dependencies (a unit test compares them).
MINIMUM_VERSIONS = {"torch": "2.4", "deepspeed": "0.17", "transformers": "4.56", "peft": "0.17", "pydantic": "2.6"}
MINIMUM_PYTHON = "3.10"

SHM_MINIMUM_BYTES = 1 * GiB
DISK_WARNING_BYTES = 50 * GiB
DISK_ERROR_BYTES = 5 * GiB
RAM_AVAILABLE_WARNING_BYTES = 16 * GiB

TORCH_INSTALL_HELP = "https://pytorch.org/get-started/locally/"


@dataclass
class Finding:
    id: str  # "area.name", e.g. "gpu.peer_access"
    title: str
    status: Status
    detail: str
    fix: str = ""

    @property
    def area(self) -> str:
        return self.id.split(".", 1)[0]

    def to_dict(self) -> dict:
        return asdict(self)


def size(n_bytes: float) -> str:
    """Bytes as a person reads them: 64 MiB, 23.4 GiB."""
    if n_bytes < GiB:
        return f"{n_bytes / MiB:.0f} MiB"
    return f"{n_bytes / GiB:.1f} GiB"


def parse_version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None


def major_minor(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"\s*(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


# --- versions ---------------------------------------------------------------------------------


def check_versions(versions: PackageVersions, torch_cuda_version: str | None = None, torch_imports: bool = True) -> list[Finding]:
    """Python and the packages ZeRO-Pipe runs on: installed, new enough, and known to work together."""
    findings = []
    python = parse_version(versions.python)
    if python is not None and python < Version(MINIMUM_PYTHON):
        findings.append(Finding("versions.python", f"Python {versions.python} is too old", "error", f"ZeRO-Pipe needs Python {MINIMUM_PYTHON} or newer.", f"create the environment with Python {MINIMUM_PYTHON}+"))
    else:
        findings.append(Finding("versions.python", f"Python {versions.python}", "ok", ""))

    installed = versions.installed
    for name, minimum in MINIMUM_VERSIONS.items():
        version_text = installed.get(name)
        install = f"pip install '{name}>={minimum}'"
        if name == "torch":
            # pip's default torch may not match the driver; the CUDA build is the user's choice.
            install = f"install torch>={minimum} built for your CUDA driver ({TORCH_INSTALL_HELP})"
        if version_text is None:
            findings.append(Finding(f"versions.{name}", f"{name} is not installed", "error", f"ZeRO-Pipe needs {name}>={minimum}.", install))
            continue
        version = parse_version(version_text)
        detail = ""
        if name == "torch" and torch_imports:
            detail = f"built for CUDA {torch_cuda_version}" if torch_cuda_version else "a CPU-only build"
        if version is None:
            findings.append(Finding(f"versions.{name}", f"{name} {version_text}", "warning", f"cannot read the version {version_text!r}; ZeRO-Pipe needs {name}>={minimum}.", install))
        elif name == "pydantic" and version.major < 2 and _at_least(installed.get("deepspeed"), "0.17"):
            findings.append(
                Finding(
                    "versions.pydantic",
                    f"pydantic {version_text} with deepspeed {installed['deepspeed']}",
                    "error",
                    "DeepSpeed 0.17+ validates its config with pydantic 2; with pydantic 1 it fails on import or on the first config.",
                    f"pip install 'pydantic>={MINIMUM_VERSIONS['pydantic']}'",
                )
            )
        elif version < Version(minimum):
            findings.append(Finding(f"versions.{name}", f"{name} {version_text} is older than ZeRO-Pipe needs", "error", f"ZeRO-Pipe needs {name}>={minimum}.", install))
        else:
            findings.append(Finding(f"versions.{name}", f"{name} {version_text}", "ok", detail))
    return findings


def _at_least(version_text: str | None, minimum: str) -> bool:
    version = parse_version(version_text)
    return version is not None and version >= Version(minimum)


# --- CUDA toolkit -----------------------------------------------------------------------------


def nvcc_release(nvcc_version_output: str | None) -> tuple[int, int] | None:
    """(major, minor) from ``nvcc --version``'s "Cuda compilation tools, release 13.0, V13.0.88"."""
    match = re.search(r"release (\d+)\.(\d+)", nvcc_version_output or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_cuda_toolkit(torch_cuda_version: str | None, toolkit: CudaToolkit, environment: dict[str, str | None]) -> list[Finding]:
    """torch's CUDA version against the nvcc DeepSpeed's JIT builds use.

    DeepSpeed refuses to build its CUDA ops (FusedAdam, used when the optimizer is not
    offloaded; CPU Adam in DeepSpeed versions that build it as a CUDA op) when the two differ,
    except for minor releases it lists as compatible.
    """
    nvcc = nvcc_release(toolkit.nvcc_version_output)
    where = f"{toolkit.nvcc_path} (found from {toolkit.cuda_home_from})" if toolkit.nvcc_path else ""
    skip_check = environment.get("DS_SKIP_CUDA_CHECK") == "1"
    if torch_cuda_version is None:
        found = f"nvcc {nvcc[0]}.{nvcc[1]} at {where} is present but not used" if nvcc else "no CUDA toolkit is needed"
        return [Finding("cuda.toolkit", "CUDA toolkit: not used (torch is a CPU-only build)", "info", f"torch has no CUDA; {found}.")]

    torch_cuda = major_minor(torch_cuda_version)
    wanted = f"{torch_cuda[0]}.{torch_cuda[1]}" if torch_cuda else torch_cuda_version
    match_toolkit = f"install the CUDA toolkit {wanted} and point CUDA_HOME at it (export CUDA_HOME=/usr/local/cuda-{wanted})"
    if nvcc is None:
        problem = toolkit.nvcc_error or "no nvcc found (CUDA_HOME, CUDA_PATH, PATH and /usr/local/cuda were searched)"
        return [
            Finding(
                "cuda.toolkit",
                "No usable nvcc: DeepSpeed cannot JIT-build its CUDA ops",
                "warning",
                f"{problem}. torch is built for CUDA {torch_cuda_version}; FusedAdam (the optimizer DeepSpeed builds when it is not offloaded) needs nvcc.",
                match_toolkit,
            )
        ]
    if torch_cuda is None:
        return [Finding("cuda.toolkit", f"torch CUDA version {torch_cuda_version!r} not understood", "warning", f"nvcc is {nvcc[0]}.{nvcc[1]} at {where}.", match_toolkit)]

    pair = f"torch is built for CUDA {wanted}, nvcc at {where} is {nvcc[0]}.{nvcc[1]}"
    if nvcc == torch_cuda:
        return [Finding("cuda.toolkit", f"CUDA {wanted}: torch and nvcc match", "ok", f"{pair}.")]
    if nvcc[0] != torch_cuda[0]:
        if skip_check:
            return [
                Finding(
                    "cuda.toolkit",
                    f"CUDA major versions differ (torch {wanted}, nvcc {nvcc[0]}.{nvcc[1]}); DS_SKIP_CUDA_CHECK=1 lets DeepSpeed build anyway",
                    "warning",
                    f"{pair}. CPU Adam usually works this way; CUDA kernels compiled by a different major toolkit may fail to build or load.",
                    f"if a DeepSpeed op fails, {match_toolkit}",
                )
            ]
        return [
            Finding(
                "cuda.toolkit",
                f"CUDA major versions differ: torch {wanted}, nvcc {nvcc[0]}.{nvcc[1]}",
                "error",
                f"{pair}. DeepSpeed stops its JIT builds with 'Installed CUDA version {nvcc[0]}.{nvcc[1]} does not match the version torch was compiled with'.",
                f"set DS_SKIP_CUDA_CHECK=1 (the known escape; enough for CPU Adam), or {match_toolkit}, or install torch built for CUDA {nvcc[0]}.{nvcc[1]}",
            )
        ]
    # Same major, different minor: DeepSpeed decides from its own table.
    accepted = toolkit.deepspeed_minor_mismatch_ok or {}
    nvcc_text = f"{nvcc[0]}.{nvcc[1]}"
    if nvcc_text in accepted.get(nvcc[0], []) and wanted in accepted.get(nvcc[0], []):
        return [Finding("cuda.toolkit", f"CUDA minor versions differ (torch {wanted}, nvcc {nvcc_text}); DeepSpeed accepts this pair", "warning", f"{pair}.", f"if a DeepSpeed op fails to build, {match_toolkit}")]
    if skip_check:
        return [Finding("cuda.toolkit", f"CUDA minor versions differ (torch {wanted}, nvcc {nvcc_text}); allowed by DS_SKIP_CUDA_CHECK=1", "ok", f"{pair}.")]
    listed = accepted.get(nvcc[0], [])
    # Why the pair is refused: CUDA keeps minor releases of one major compatible, and DeepSpeed's
    # table lags NVIDIA's releases (no 12.7, no 13.x entries in DeepSpeed 0.19), so the usual
    # cause is a gap in the table, not an incompatibility.
    if not listed:
        why = f"DeepSpeed's table lists no CUDA {nvcc[0]}.x releases at all, so it refuses every minor mismatch of CUDA {nvcc[0]}"
    else:
        missing = [version for version in (wanted, nvcc_text) if version not in listed]
        why = f"DeepSpeed's CUDA {nvcc[0]} list ({', '.join(listed)}) lacks {' and '.join(missing)}"
    return [
        Finding(
            "cuda.toolkit",
            f"CUDA minor versions differ and DeepSpeed refuses the pair: torch {wanted}, nvcc {nvcc_text}",
            "error",
            f"{pair}. {why}; minor releases of one CUDA major are compatible, so this is a gap in DeepSpeed's table rather than a real conflict.",
            f"set DS_SKIP_CUDA_CHECK=1 (a minor mismatch is normally safe), or {match_toolkit}",
        )
    ]


# --- GPUs -------------------------------------------------------------------------------------

# GeForce RTX 40xx (Ada consumer cards): no working peer-to-peer, and NCCL can hang trying it.
ADA_CONSUMER_GPU = re.compile(r"GeForce RTX 40\d0")


def check_gpus(gpus: GpuFacts, environment: dict[str, str | None]) -> list[Finding]:
    """The GPUs torch can use, bf16 support, and peer-to-peer access between them."""
    if gpus.torch_import_error:
        return [
            Finding(
                "gpu.torch",
                "torch does not import",
                "error",
                gpus.torch_import_error,
                f"reinstall torch built for a CUDA version your driver supports ({TORCH_INSTALL_HELP})",
            )
        ]
    if not gpus.cuda_available:
        return [_why_no_gpu(gpus, environment)]

    findings = [_gpu_list(gpus)]
    names = {gpu.name for gpu in gpus.gpus}
    if len(names) > 1:
        smallest = min(gpus.gpus, key=lambda gpu: gpu.memory_bytes)
        findings.append(
            Finding(
                "gpu.mixed",
                "Different GPU models in one run",
                "warning",
                f"ZeRO gives every rank the same share, so each GPU holds what the smallest ({smallest.name}, {size(smallest.memory_bytes)}) holds and steps wait for the slowest.",
                "use CUDA_VISIBLE_DEVICES to train on identical GPUs, or plan for the smallest one",
            )
        )
    findings.append(_bf16(gpus))
    if len(gpus.gpus) > 1:
        findings.append(_peer_access(gpus, environment))
    return findings


def _why_no_gpu(gpus: GpuFacts, environment: dict[str, str | None]) -> Finding:
    visible = environment.get("CUDA_VISIBLE_DEVICES")
    if gpus.torch_cuda_version and visible is not None and visible.strip() in ("", "-1", "none", "NoDevFiles"):
        return Finding("gpu.none", "CUDA_VISIBLE_DEVICES hides every GPU", "error", f"CUDA_VISIBLE_DEVICES={visible!r}, so torch sees no GPU and training would run on CPU ranks.", "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (CUDA_VISIBLE_DEVICES=0,1)")
    if gpus.nvidia_driver_version and gpus.torch_cuda_version is None:
        return Finding(
            "gpu.none",
            "NVIDIA driver found, but torch is a CPU-only build",
            "error",
            f"The NVIDIA driver {gpus.nvidia_driver_version} is loaded, but torch was built without CUDA, so every rank would run on the CPU.",
            f"install a CUDA build of torch that your driver supports (nvidia-smi shows the highest CUDA version it runs; {TORCH_INSTALL_HELP})",
        )
    if gpus.nvidia_driver_version:
        return Finding(
            "gpu.none",
            f"torch is built for CUDA {gpus.torch_cuda_version} but cannot use the GPUs",
            "error",
            f"The NVIDIA driver {gpus.nvidia_driver_version} is loaded, yet torch.cuda.is_available() is False: the driver is usually too old for CUDA {gpus.torch_cuda_version}.",
            f"update the NVIDIA driver to one that supports CUDA {gpus.torch_cuda_version}, or install torch built for an older CUDA ({TORCH_INSTALL_HELP})",
        )
    return Finding(
        "gpu.none",
        "No GPU: training runs on CPU ranks (gloo)",
        "warning",
        "torch sees no CUDA GPU and no NVIDIA driver is loaded. `zeropipe train` then starts CPU ranks (DS_ACCELERATOR=cpu, gloo): "
        "useful for testing configs and the pipeline, far too slow for real models. The other checks below still apply.",
        "nothing to fix for testing; for real training use a machine with NVIDIA GPUs and a CUDA build of torch",
    )


def _gpu_list(gpus: GpuFacts) -> Finding:
    groups: dict[tuple[str, int, tuple[int, int]], list[int]] = {}
    for gpu in gpus.gpus:
        groups.setdefault((gpu.name, gpu.memory_bytes, gpu.compute_capability), []).append(gpu.index)
    parts = []
    for (name, memory, capability), indexes in groups.items():
        parts.append(f"{len(indexes)} x {name} ({size(memory)}, compute capability {capability[0]}.{capability[1]}; GPU {', '.join(map(str, indexes))})")
    driver = f"; driver {gpus.nvidia_driver_version}" if gpus.nvidia_driver_version else ""
    title = f"{len(gpus.gpus)} GPU{'s' if len(gpus.gpus) != 1 else ''}, {size(sum(g.memory_bytes for g in gpus.gpus))} in total"
    return Finding("gpu.devices", title, "ok", "; ".join(parts) + f"; torch CUDA {gpus.torch_cuda_version}{driver}.")


def _bf16(gpus: GpuFacts) -> Finding:
    old = [gpu for gpu in gpus.gpus if gpu.compute_capability < (8, 0)]
    if not old:
        return Finding("gpu.bf16", "bf16 supported on every GPU", "ok", "All GPUs have compute capability 8.0 (Ampere) or newer.")
    names = ", ".join(f"GPU {g.index} {g.name} ({g.compute_capability[0]}.{g.compute_capability[1]})" for g in old)
    return Finding(
        "gpu.bf16",
        "No bf16 on some GPUs",
        "warning",
        f"bf16 needs compute capability 8.0 (Ampere) or newer: {names}. ZeRO-Pipe's default precision is bf16 and it refuses bf16 on these GPUs.",
        "set deepspeed.precision: fp16 (or fp32) in the run config",
    )


def _peer_access(gpus: GpuFacts, environment: dict[str, str | None]) -> Finding:
    blocked = [p for p in gpus.peer_access if not p.possible]
    pairs = sorted({tuple(sorted((p.from_gpu, p.to_gpu))) for p in blocked})
    pair_text = ", ".join(f"{a}-{b}" for a, b in pairs)
    all_pairs = {tuple(sorted((p.from_gpu, p.to_gpu))) for p in gpus.peer_access}
    if not pairs:
        access = "every GPU can reach every other directly"
    elif len(pairs) == len(all_pairs):
        access = "no pair of GPUs has peer access"
    else:
        access = f"no peer access between GPUs {pair_text}"
    p2p_disabled = environment.get("NCCL_P2P_DISABLE") == "1"
    ada = sorted({gpu.name for gpu in gpus.gpus if ADA_CONSUMER_GPU.search(gpu.name)})
    if ada:
        if p2p_disabled:
            return Finding("gpu.peer_access", "NCCL_P2P_DISABLE=1 is set, as GeForce RTX 40xx cards need", "ok", f"{', '.join(ada)}: {access}.")
        return Finding(
            "gpu.peer_access",
            "GeForce RTX 40xx: set NCCL_P2P_DISABLE=1",
            "warning",
            f"{', '.join(ada)} cards have no working peer-to-peer access ({access}); NCCL can hang or fail at the first all-reduce when it tries.",
            "export NCCL_P2P_DISABLE=1 before `zeropipe train` (add it to your shell profile)",
        )
    if not pairs:
        if p2p_disabled:
            return Finding("gpu.peer_access", "Peer access works but NCCL_P2P_DISABLE=1 turns it off", "info", f"{access}.", "unset NCCL_P2P_DISABLE for faster all-reduce, unless you set it to work around a hang")
        return Finding("gpu.peer_access", "Peer-to-peer access between all GPUs", "ok", f"{access}.")
    return Finding(
        "gpu.peer_access",
        "Some GPUs cannot reach each other directly",
        "info",
        f"{access}; NCCL goes through host memory for those pairs, which works but is slower.",
        "nothing required; check the PCIe topology (nvidia-smi topo -m) and IOMMU/ACS settings if all-reduce is slow",
    )


# --- DeepSpeed CPU Adam -----------------------------------------------------------------------

# (pattern in the build output, fix)
BUILD_FAILURE_FIXES = [
    (r"does not match the version torch was compiled with", "set DS_SKIP_CUDA_CHECK=1, or install the CUDA toolkit torch was built with and point CUDA_HOME at it"),
    # Not just "ninja": every failed compile ends with "ninja: build stopped".
    (r"Ninja is required|ninja not being installed|ninja: (command )?not found", "pip install ninja (into the same environment as torch)"),
    (r"Python\.h", "install the Python headers (e.g. apt install python3-dev for your Python version)"),
    (r"omp\.h|libgomp|-fopenmp", "install a compiler with OpenMP (apt install build-essential)"),
    (r"(c\+\+|g\+\+|gcc|cc1plus)\S*:? (command )?not found|No such file or directory: '(c\+\+|g\+\+|gcc)'|error: command '\S*(c\+\+|g\+\+|gcc)' failed", "install a C++ compiler (apt install build-essential)"),
    (r"No space left on device", "free disk space where the build goes, or set TORCH_EXTENSIONS_DIR to a folder with room"),
    (r"Permission denied|Read-only file system", "set TORCH_EXTENSIONS_DIR to a writable folder"),
    (r"No module named '?deepspeed", "pip install 'deepspeed>=0.17' into this environment"),
    (r"MissingCUDAException|CUDA_HOME does not exist", "install the CUDA toolkit torch was built with and set CUDA_HOME to it"),
]

GENERIC_BUILD_FIX = (
    "read the lines above; a build made at install time avoids the JIT build "
    "(DS_BUILD_CPU_ADAM=1 pip install --no-cache-dir --force-reinstall deepspeed). "
    "Runs without deepspeed.offload_optimizer on GPUs do not use CPU Adam"
)


def build_failure_fix(output: str) -> str:
    """The fix for the first recognised cause in a failed build's output."""
    for pattern, fix in BUILD_FAILURE_FIXES:
        if re.search(pattern, output):
            return fix
    return GENERIC_BUILD_FIX


def check_cpu_adam_build(build: CpuAdamBuild) -> list[Finding]:
    """Whether DeepSpeed's CPU Adam builds and loads, as the optimizer of offloaded and CPU runs needs."""
    if build.skipped_reason:
        return [Finding("cpu_adam.build", "DeepSpeed CPU Adam: not tried", "info", f"The trial build was skipped: {build.skipped_reason}.", "run `zeropipe doctor` without --no-build to try it (about a minute the first time)")]
    how = f" with DS_ACCELERATOR={build.accelerator}" if build.accelerator else ""
    tail = "\n".join(build.output_tail)
    if build.ok:
        compiled = build.load_seconds is not None and build.load_seconds > 20
        cached = f"built now in {build.load_seconds:.0f} s" if compiled else "loaded from DeepSpeed's cached build"
        where = os.path.dirname(build.module_file) if build.module_file else build.build_dir
        return [Finding("cpu_adam.build", "DeepSpeed CPU Adam builds and loads", "ok", f"{cached}{how} ({build.seconds:.1f} s with the DeepSpeed import); the build is kept in {where}, so later runs skip the compile.")]
    lock = f" A lock file from an interrupted build is left in {build.build_dir}." if build.stale_lock else ""
    if build.timed_out:
        fix = (
            f"delete {build.build_dir}/lock (no build is running now) and run `zeropipe doctor` again"
            if build.stale_lock
            else f"run `zeropipe doctor --build-timeout {int((build.timeout_seconds or 900) * 2)}` again: the first build takes a few minutes on few cores"
        )
        return [Finding("cpu_adam.build", f"DeepSpeed CPU Adam: the trial build did not finish in {build.timeout_seconds:.0f} s", "warning", f"The build{how} was stopped.{lock}\n{tail}".rstrip(), fix)]
    fix = build_failure_fix(tail)
    if build.stale_lock and fix == GENERIC_BUILD_FIX:
        fix = f"delete {build.build_dir}/lock (left by an interrupted build) and run `zeropipe doctor` again"
    return [Finding("cpu_adam.build", "DeepSpeed CPU Adam does not build", "error", f"The trial build{how} failed (exit status {build.returncode}) after {build.seconds:.0f} s.{lock} Last lines:\n{tail}".rstrip(), fix)]


# --- memory and disk --------------------------------------------------------------------------


def check_cpu_precision(facts: MachineFacts) -> list[Finding]:
    """Which precision deepspeed.precision: auto picks for CPU ranks on this machine, and why."""
    if facts.gpus.cuda_available:
        return []
    if facts.cpu_bf16_native:
        return [Finding("cpu.bf16", "bf16 runs natively on this CPU", "ok", "The CPU has avx512_bf16 or AMX: precision: auto trains CPU ranks in bf16.")]
    return [
        Finding(
            "cpu.bf16",
            "No bf16 in this CPU's hardware",
            "warning",
            "Without avx512_bf16 or AMX, PyTorch emulates bf16 on the CPU: 18-56x slower than fp32. precision: auto trains CPU ranks in fp32 here.",
            "leave deepspeed.precision: auto (or set fp32); set bf16 only where bf16 itself is the point",
        )
    ]


def check_host_memory(memory: MemoryFacts) -> list[Finding]:
    """Host RAM and swap: where ranks load weights and where offloaded optimizer states live."""
    ram_detail = f"{size(memory.ram_total_bytes)} total, {size(memory.ram_available_bytes)} available."
    if memory.ram_available_bytes < RAM_AVAILABLE_WARNING_BYTES:
        ram = Finding(
            "memory.ram",
            f"Host RAM: only {size(memory.ram_available_bytes)} available",
            "warning",
            f"{ram_detail} A 7B model in bf16 alone is 14 GB, and every rank that loads weights needs room for them; offload puts optimizer states here too.",
            "close other programs, train smaller models here, or use deepspeed.zero_stage: 3 so that each rank holds only its shard",
        )
    else:
        ram = Finding("memory.ram", f"Host RAM: {size(memory.ram_total_bytes)}", "ok", f"{size(memory.ram_available_bytes)} available.")
    if memory.swap_total_bytes == 0:
        swap = Finding(
            "memory.swap",
            "No swap",
            "warning",
            "When host RAM runs out (ranks loading weights at the same time), the kernel kills a rank at once (SIGKILL) instead of slowing down.",
            "add a swap file as a safety margin (e.g. fallocate -l 32G /swapfile && chmod 600 /swapfile && mkswap /swapfile && swapon /swapfile)",
        )
    else:
        swap = Finding("memory.swap", f"Swap: {size(memory.swap_total_bytes)}", "ok", f"{size(memory.swap_used_bytes)} in use.")
    return [ram, swap]


def check_shared_memory(memory: MemoryFacts) -> list[Finding]:
    """/dev/shm: NCCL, DeepSpeed's CPU communication and data loader workers keep buffers there."""
    if memory.shm_total_bytes is None:
        return [Finding("memory.shm", f"No {memory.shm_path}", "info", "This system has no /dev/shm; NCCL and data loader workers need it on Linux.")]
    free = f"{size(memory.shm_free_bytes or 0)} free."
    detail = f"{memory.shm_path} is {size(memory.shm_total_bytes)}, {free}"
    if memory.shm_total_bytes < SHM_MINIMUM_BYTES:
        return [
            Finding(
                "memory.shm",
                f"{memory.shm_path} is only {size(memory.shm_total_bytes)}",
                "warning",
                f"{detail} Docker's default is 64 MiB; NCCL then fails with 'unhandled system error' and data loader workers die with SIGBUS.",
                "start the container with docker run --shm-size=16g (or --ipc=host); on a host: mount -o remount,size=16G /dev/shm",
            )
        ]
    return [Finding("memory.shm", f"{memory.shm_path}: {size(memory.shm_total_bytes)}", "ok", free)]


def check_disk(disk: DiskFacts) -> list[Finding]:
    """Free space where checkpoints go: a full fine-tune checkpoint is about 16 bytes per parameter."""
    where = disk.checked_path if disk.checked_path == disk.runs_dir else f"{disk.checked_path} ({disk.runs_dir} does not exist yet)"
    detail = f"{size(disk.free_bytes)} free of {size(disk.total_bytes)} at {where}."
    need = (
        " A full fine-tune checkpoint holds bf16 weights plus fp32 master weights and Adam states, about 16 bytes per parameter "
        "(a 7B model: about 110 GB), and train.keep_last keeps 2 by default; LoRA checkpoints are small."
    )
    fix = "free space there, or write runs to a bigger disk (run.output_dir in the config, --runs-dir here)"
    if disk.free_bytes < DISK_ERROR_BYTES:
        return [Finding("disk.runs", f"Only {size(disk.free_bytes)} free for runs", "error", detail + need, fix)]
    if disk.free_bytes < DISK_WARNING_BYTES:
        return [Finding("disk.runs", f"{size(disk.free_bytes)} free for runs: enough for small models and LoRA only", "warning", detail + need, fix)]
    return [Finding("disk.runs", f"{size(disk.free_bytes)} free for runs", "ok", detail)]


# --- environment ------------------------------------------------------------------------------


def check_environment(environment: dict[str, str | None], gpus: GpuFacts) -> list[Finding]:
    """The variables that change what NCCL and DeepSpeed do, as they are set now."""
    listed = "; ".join(f"{name}={value}" if value is not None else f"{name} unset" for name, value in environment.items())
    findings = [Finding("environment.variables", "Environment variables", "info", listed + ".")]
    if environment.get("DS_ACCELERATOR") == "cpu" and gpus.cuda_available:
        findings.append(
            Finding(
                "environment.ds_accelerator",
                "DS_ACCELERATOR=cpu although GPUs are available",
                "warning",
                "DeepSpeed will use the CPU accelerator and gloo, ignoring the GPUs.",
                "unset DS_ACCELERATOR (ZeRO-Pipe sets it itself for CPU runs)",
            )
        )
    return findings


def examine(facts: MachineFacts) -> list[Finding]:
    """Every check on one machine's facts, in report order."""
    return [
        *check_gpus(facts.gpus, facts.environment),
        *check_cuda_toolkit(facts.gpus.torch_cuda_version, facts.cuda_toolkit, facts.environment),
        *check_cpu_adam_build(facts.cpu_adam),
        *check_versions(facts.versions, facts.gpus.torch_cuda_version, torch_imports=facts.gpus.torch_import_error is None),
        *check_cpu_precision(facts),
        *check_host_memory(facts.memory),
        *check_shared_memory(facts.memory),
        *check_disk(facts.disk),
        *check_environment(facts.environment, facts.gpus),
    ]
