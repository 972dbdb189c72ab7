"""What the doctor knows about this machine, and the small functions that find it out.

The dataclasses here are plain facts (versions, sizes, GPU names, nvcc's output); the checks
in ``zeropipe.doctor.checks`` judge them. Keeping the two apart lets the tests describe a
5x RTX 4090 box or a CUDA 12.8 / 13.0 mismatch without owning one.

Every ``gather_*`` function records what it could not find out instead of raising: a doctor
that crashes on a broken torch install is no help with a broken torch install.
"""

from __future__ import annotations

import contextlib
import ast
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Environment variables that change what NCCL, DeepSpeed or the CPU ranks do; listed as they are.
ENVIRONMENT_VARIABLES = [
    "NCCL_P2P_DISABLE",
    "NCCL_IB_DISABLE",
    "NCCL_SHM_DISABLE",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_HOME",
    "DS_SKIP_CUDA_CHECK",
    "DS_ACCELERATOR",
    "TORCH_EXTENSIONS_DIR",
    "OMP_NUM_THREADS",
]

PACKAGES = ["torch", "deepspeed", "transformers", "peft", "pydantic"]


@dataclass
class PackageVersions:
    python: str
    installed: dict[str, str | None]  # distribution name -> version, None when not installed


@dataclass
class Gpu:
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int]


@dataclass
class PeerAccess:
    from_gpu: int
    to_gpu: int
    possible: bool


@dataclass
class GpuFacts:
    torch_cuda_version: str | None  # torch.version.cuda: None for a CPU-only build of torch
    cuda_available: bool
    gpus: list[Gpu] = field(default_factory=list)
    peer_access: list[PeerAccess] = field(default_factory=list)
    nvidia_driver_version: str | None = None  # from /proc/driver/nvidia/version: a driver is loaded
    torch_import_error: str | None = None


@dataclass
class CudaToolkit:
    """The nvcc DeepSpeed would compile with: ``$CUDA_HOME/bin/nvcc``, found the way torch finds CUDA_HOME."""

    cuda_home: str | None
    cuda_home_from: str  # "CUDA_HOME", "CUDA_PATH", "nvcc on PATH", "/usr/local/cuda" or "not found"
    nvcc_path: str | None
    nvcc_version_output: str | None  # `nvcc --version` as printed, None when it could not run
    nvcc_error: str | None = None
    # DeepSpeed's table of CUDA versions whose minor releases it lets mix with torch's.
    deepspeed_minor_mismatch_ok: dict[int, list[str]] | None = None


@dataclass
class MemoryFacts:
    ram_total_bytes: int
    ram_available_bytes: int
    swap_total_bytes: int
    swap_used_bytes: int
    shm_path: str = "/dev/shm"
    shm_total_bytes: int | None = None  # None: no /dev/shm on this system
    shm_free_bytes: int | None = None


@dataclass
class DiskFacts:
    runs_dir: str  # as asked for (--runs-dir), made absolute
    checked_path: str  # runs_dir, or its nearest existing parent when it does not exist yet
    free_bytes: int
    total_bytes: int


@dataclass
class CpuAdamBuild:
    """The outcome of building (or loading the cached build of) DeepSpeed's CPU Adam in a child process."""

    skipped_reason: str | None = None  # set when no build was tried, e.g. "--no-build"
    ok: bool = False
    timed_out: bool = False
    timeout_seconds: float | None = None
    seconds: float = 0.0  # the whole child process, DeepSpeed import included
    load_seconds: float | None = None  # CPUAdamBuilder().load() alone: the compile, when there is one
    returncode: int | None = None
    accelerator: str | None = None  # DS_ACCELERATOR the child ran with, when set
    module_file: str | None = None
    build_dir: str | None = None  # where torch keeps the build (and its lock file)
    stale_lock: bool = False  # a 'lock' file left in build_dir after the child stopped
    output_tail: list[str] = field(default_factory=list)


@dataclass
class MachineFacts:
    versions: PackageVersions
    gpus: GpuFacts
    cuda_toolkit: CudaToolkit
    memory: MemoryFacts
    disk: DiskFacts
    environment: dict[str, str | None]
    cpu_adam: CpuAdamBuild
    cpu_count: int | None = None
    cpu_bf16_native: bool = False  # avx512_bf16 or AMX: bf16 runs at full speed on CPU ranks


# CPU flags that mean bf16 arithmetic in hardware; without them (AVX2, plain AVX-512) PyTorch
# emulates it: one bf16 conv forward+backward was measured 18x slower than fp32, a linear 56x.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


# Describes the CPU instead of reading it: the flags as /proc/cpuinfo lists them, space- or
# comma-separated ("avx2" for a CPU that emulates bf16, "avx2 avx512_bf16" for one that runs it).
# Tests set it so that a run decides the same on every machine; a user can plan for another CPU.
CPU_FLAGS_VARIABLE = "ZEROPIPE_CPU_FLAGS"


def cpu_flags(proc_file: str = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags (Linux), empty where they cannot be read; ``ZEROPIPE_CPU_FLAGS`` describes another CPU.

    This is the one place that asks the CPU: every decision that depends on it (precision
    ``auto``, the plan's precisions, the encoders' dtype) reads the hardware object built from it.
    """
    described = os.environ.get(CPU_FLAGS_VARIABLE)
    if described is not None:
        return set(described.replace(",", " ").split())
    try:
        with open(proc_file) as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_runs_bf16_natively(flags: set[str] | None = None) -> bool:
    flags = cpu_flags() if flags is None else flags
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def cpu_precision(native: bool) -> tuple[str, str]:
    """(precision, why) for CPU ranks: bf16 only where the CPU runs it natively (``native``: the hardware object's fact), fp32 otherwise."""
    if native:
        return "bf16", "this CPU runs bf16 natively (avx512_bf16/AMX)"
    return "fp32", "this CPU has no bf16 in hardware (no avx512_bf16/AMX): bf16 would run 18-56x slower than fp32"


def gather_versions() -> PackageVersions:
    """Installed versions from package metadata, without importing the packages."""
    installed: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed[name] = None
    return PackageVersions(python=platform.python_version(), installed=installed)


def nvidia_driver_version(proc_file: str = "/proc/driver/nvidia/version") -> str | None:
    """The loaded NVIDIA kernel driver's version, or None when no driver is loaded."""
    try:
        text = Path(proc_file).read_text(errors="replace")
    except OSError:
        return None
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan ..."
    words = text.split()
    for i, word in enumerate(words):
        if word == "Module" and i + 1 < len(words):
            return words[i + 1]
    return text.strip().splitlines()[0] if text.strip() else "unknown"


def gather_gpus() -> GpuFacts:
    """What torch sees: its CUDA version, the GPUs, their memory and which pairs can reach each other."""
    driver = nvidia_driver_version()
    try:
        import torch
    except Exception as err:  # a torch built for a missing libcudart fails here, and that is a finding
        return GpuFacts(torch_cuda_version=None, cuda_available=False, nvidia_driver_version=driver, torch_import_error=f"{type(err).__name__}: {err}")
    facts = GpuFacts(torch_cuda_version=torch.version.cuda, cuda_available=bool(torch.cuda.is_available()), nvidia_driver_version=driver)
    if not facts.cuda_available:
        return facts
    count = torch.cuda.device_count()
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        facts.gpus.append(Gpu(index, props.name, int(props.total_memory), (int(props.major), int(props.minor))))
    for first in range(count):
        for second in range(count):
            if first != second:
                facts.peer_access.append(PeerAccess(first, second, bool(torch.cuda.can_device_access_peer(first, second))))
    return facts


def find_cuda_home() -> tuple[str | None, str]:
    """CUDA_HOME as torch's cpp_extension finds it, which is the nvcc DeepSpeed's JIT builds use.

    torch sets ``cpp_extension.CUDA_HOME`` to None in a CPU-only build, so the search is
    repeated here to report the toolkit whatever build of torch is installed.
    """
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(variable):
            return os.environ[variable], variable
    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        return os.path.dirname(os.path.dirname(nvcc_on_path)), "nvcc on PATH"
    if os.path.exists("/usr/local/cuda"):
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, "not found"


def deepspeed_minor_mismatch_table() -> dict[int, list[str]] | None:
    """DeepSpeed's ``cuda_minor_mismatch_ok`` read from its source, without importing DeepSpeed.

    Importing DeepSpeed takes seconds and probes accelerators; the table is a literal, so
    reading it is enough and stays right for whichever DeepSpeed is installed.
    """
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    builder = Path(list(spec.submodule_search_locations)[0]) / "ops" / "op_builder" / "builder.py"
    try:
        tree = ast.parse(builder.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "cuda_minor_mismatch_ok" for t in node.targets):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return None
            return {int(major): list(versions) for major, versions in table.items()}
    return None


def gather_cuda_toolkit() -> CudaToolkit:
    cuda_home, found_from = find_cuda_home()
    toolkit = CudaToolkit(cuda_home=cuda_home, cuda_home_from=found_from, nvcc_path=None, nvcc_version_output=None, deepspeed_minor_mismatch_ok=deepspeed_minor_mismatch_table())
    if cuda_home is None:
        return toolkit
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    toolkit.nvcc_path = nvcc
    if not os.path.exists(nvcc):
        toolkit.nvcc_error = f"{nvcc} does not exist"
        return toolkit
    try:
        done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        toolkit.nvcc_error = f"{type(err).__name__}: {err}"
        return toolkit
    if done.returncode != 0:
        toolkit.nvcc_error = f"exit status {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"
    else:
        toolkit.nvcc_version_output = done.stdout
    return toolkit


def gather_memory(shm_path: str = "/dev/shm") -> MemoryFacts:
    import psutil

    ram = psutil.virtual_memory()
    swap = psutil.swap_memory()
    facts = MemoryFacts(ram_total_bytes=int(ram.total), ram_available_bytes=int(ram.available), swap_total_bytes=int(swap.total), swap_used_bytes=int(swap.used), shm_path=shm_path)
    if os.path.isdir(shm_path):
        usage = shutil.disk_usage(shm_path)
        facts.shm_total_bytes, facts.shm_free_bytes = int(usage.total), int(usage.free)
    return facts


def nearest_existing_folder(path: str | os.PathLike) -> Path:
    """``path`` itself, or the closest parent that exists: where a new runs folder would be created."""
    candidate = Path(path).expanduser().absolute()
    while not candidate.exists() and candidate != candidate.parent:
        candidate = candidate.parent
    return candidate


def gather_disk(runs_dir: str | os.PathLike) -> DiskFacts:
    checked = nearest_existing_folder(runs_dir)
    usage = shutil.disk_usage(checked)
    return DiskFacts(runs_dir=str(Path(runs_dir).expanduser().absolute()), checked_path=str(checked), free_bytes=int(usage.free), total_bytes=int(usage.total))


def gather_environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in ENVIRONMENT_VARIABLES}


def torch_extensions_build_dir(op_name: str, torch_cuda_version: str | None) -> Path:
    """Where torch's JIT builder puts an op, computed the way ``cpp_extension._get_build_directory`` does.

    Computed rather than asked from torch because that function creates the folder, and
    because after a timeout the child that knew it is gone. With ``TORCH_EXTENSIONS_DIR`` set,
    torch puts the op's folder straight in it; without, in a ``py311_cpu``-like folder of the
    user's cache (one per Python and CUDA version).
    """
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return torch_extensions_root() / op_name
    cuda = "cpu" if torch_cuda_version is None else "cu" + torch_cuda_version.replace(".", "")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return torch_extensions_root() / f"{python}_{cuda}" / op_name


def torch_extensions_root() -> Path:
    """The folder torch's JIT builder puts every op's build folder in (``TORCH_EXTENSIONS_DIR``, else the user's cache)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"


def torch_extensions_locks() -> list[Path]:
    """Every op folder's build lock under the root, in the layout ``torch_extensions_build_dir`` describes."""
    pattern = "*/lock" if os.environ.get("TORCH_EXTENSIONS_DIR") else "*/*/lock"
    return sorted(torch_extensions_root().glob(pattern))


def stale_build_locks(min_age_seconds: float = 60.0) -> list[Path]:
    """Lock files in op build folders that no build holds any more: left by a build that was stopped.

    torch's JIT builder (``FileBaton``) creates ``<op folder>/lock`` before it compiles and removes
    it after; a process that waits for an op waits, without a time limit and without a word, for
    as long as that file stands. A build killed half-way (a Ctrl-C in a run's first minutes, a
    timed-out job) leaves it behind, and every later run that needs the op hangs in its first
    step. A lock is taken as left behind when it is older than ``min_age_seconds`` and no process
    works in its folder (the compiler and ninja run there, with that folder as their working
    directory). Processes whose working directory cannot be read (another user's) are not counted.
    """
    try:
        locks = torch_extensions_locks()
    except OSError:
        return []
    if not locks:
        return []
    import psutil

    in_use: set[Path] = set()
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            in_use.add(Path(process.cwd()).resolve())
    now = time.time()
    stale = []
    for lock in locks:
        with contextlib.suppress(OSError):
            folder = lock.parent.resolve()
            busy = any(path == folder or folder in path.parents for path in in_use)
            if not busy and now - lock.stat().st_mtime >= min_age_seconds:
                stale.append(lock)
    return stale


RESULT_MARKER = "ZEROPIPE_DOCTOR_CPU_ADAM "

# Run in a child: a failing JIT build can leave the interpreter in any state, and a hung one
# has to be killable with its compiler processes.
TRIAL_BUILD_SCRIPT = f"""
import json, time
started = time.monotonic()
from deepspeed.ops.op_builder import CPUAdamBuilder
imported = time.monotonic()
module = CPUAdamBuilder().load(verbose=False)
print({RESULT_MARKER!r} + json.dumps({{"load_seconds": time.monotonic() - imported, "module_file": getattr(module, "__file__", None)}}), flush=True)
"""


def try_cpu_adam_build(cuda_available: bool, torch_cuda_version: str | None, timeout_seconds: float = 900, tail_lines: int = 15) -> CpuAdamBuild:
    """Build (or load DeepSpeed's cached build of) CPU Adam in a child process, as a training rank would.

    Args:
        cuda_available: without CUDA the child runs with ``DS_ACCELERATOR=cpu``, as the CPU ranks do.
        torch_cuda_version: torch.version.cuda, to locate the build folder.
        timeout_seconds: the child and its compilers are killed after this long.
    """
    env = dict(os.environ)
    if not cuda_available:
        env.setdefault("DS_ACCELERATOR", "cpu")
    build_dir = torch_extensions_build_dir("cpu_adam", torch_cuda_version)
    result = CpuAdamBuild(timeout_seconds=timeout_seconds, accelerator=env.get("DS_ACCELERATOR"), build_dir=str(build_dir))
    started = time.monotonic()
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", TRIAL_BUILD_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True
        )
    except OSError as err:
        result.output_tail = [f"could not start {sys.executable}: {err}"]
        return result
    try:
        output, _ = child.communicate(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        # The child leads its own session, so this stops ninja and the compilers it started too.
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        output, _ = child.communicate()
        result.timed_out = True
    result.seconds = time.monotonic() - started
    result.returncode = child.returncode
    lines = [line.rstrip() for line in (output or "").splitlines() if line.strip()]
    for line in lines:
        if line.startswith(RESULT_MARKER):
            reported = json.loads(line[len(RESULT_MARKER) :])
            result.load_seconds = reported.get("load_seconds")
            result.module_file = reported.get("module_file")
    result.ok = child.returncode == 0 and result.module_file is not None and not result.timed_out
    result.output_tail = [line for line in lines if not line.startswith(RESULT_MARKER)][-tail_lines:]
    if not result.ok:
        # torch's builder waits forever on a lock an interrupted build left behind.
        result.stale_lock = (build_dir / "lock").exists()
    return result


def gather_facts(runs_dir: str | os.PathLike = "runs", trial_build: bool = True, build_timeout_seconds: float = 900) -> MachineFacts:
    """Everything the checks need, found out on this machine.

    Args:
        runs_dir: where run directories will be written; its free space is checked.
        trial_build: build DeepSpeed's CPU Adam in a child process (about a minute the first time).
        build_timeout_seconds: give up on the trial build after this long.
    """
    gpus = gather_gpus()
    if not trial_build:
        cpu_adam = CpuAdamBuild(skipped_reason="--no-build was given")
    elif gpus.torch_import_error is not None:
        cpu_adam = CpuAdamBuild(skipped_reason="torch does not import")
    else:
        cpu_adam = try_cpu_adam_build(gpus.cuda_available, gpus.torch_cuda_version, timeout_seconds=build_timeout_seconds)
    return MachineFacts(
        versions=gather_versions(),
        gpus=gpus,
        cuda_toolkit=gather_cuda_toolkit(),
        memory=gather_memory(),
        disk=gather_disk(runs_dir),
        environment=gather_environment(),
        cpu_adam=cpu_adam,
        cpu_count=os.cpu_count(),
        cpu_bf16_native=cpu_runs_bf16_natively(),
    )
