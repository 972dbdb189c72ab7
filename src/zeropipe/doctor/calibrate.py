"""Short measurements of this machine, kept as the profile the planner's cost model uses (``zeropipe calibrate``).

The planner ranks candidate settings by a cost model (``plan/cost.py``) whose speeds are, by
default, round figures assumed for an RTX 3090/4090-class box. ``calibrate`` measures the
figures that model uses, on the devices the ranks run on:

- matmul throughput per dtype on one device (FLOP/s of a square matmul);
- the host link in each direction with pinned memory (CUDA only: CPU ranks have none);
- all-gather and reduce-scatter bandwidth between the ranks (``torch.distributed``, NCCL on
  GPUs, gloo on CPU ranks), as the bus bandwidth NCCL's tests report: bytes x (n-1)/n / time;
- the optimizer's step on the host (DeepSpeed's CPU Adam when its extension is built, else
  PyTorch's AdamW on the CPU, named in the profile).

The profile is one JSON file (``~/.cache/zeropipe/calibration.json``, or ``ZEROPIPE_CALIBRATION``),
read once by ``plan.hardware.detect_hardware`` when it describes this machine. The model's
constants come only from these micro-measurements, never from fitted step times.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

PROFILE_VERSION = 1


@dataclass(frozen=True)
class Calibration:
    """What ``zeropipe calibrate`` measured; every speed per rank, in units per second."""

    accelerator: str  # "cuda" or "cpu"
    device_name: str  # the GPU's name, or the CPU's model
    ranks: int  # how many ranks the collectives were measured between
    matmul_flops: dict[str, float]  # dtype name ("fp32", "bf16", "fp16") -> FLOP/s of one device
    all_gather_bytes_per_second: float | None  # bus bandwidth; None with one rank
    reduce_scatter_bytes_per_second: float | None
    host_to_device_bytes_per_second: float | None  # pinned memory; None on CPU ranks
    device_to_host_bytes_per_second: float | None
    optimizer_params_per_second: float  # one Adam step over this many parameters per second, on the host
    optimizer: str  # which optimizer was timed
    measured_at: str = ""  # ISO time
    host: str = ""
    torch_version: str = ""
    threads: int = 0  # torch threads of one rank while measuring
    version: int = PROFILE_VERSION
    notes: list[str] = field(default_factory=list)

    @property
    def collective_bytes_per_second(self) -> float | None:
        """What one ZeRO collective moves per second: the slower of all-gather and reduce-scatter."""
        figures = [v for v in (self.all_gather_bytes_per_second, self.reduce_scatter_bytes_per_second) if v]
        return min(figures) if figures else None

    @property
    def host_link_bytes_per_second(self) -> float | None:
        figures = [v for v in (self.host_to_device_bytes_per_second, self.device_to_host_bytes_per_second) if v]
        return min(figures) if figures else None

    def describes(self, accelerator: str, device_name: str | None) -> bool:
        """Whether this profile was measured on this kind of device (the GPU model, or CPU ranks on this CPU)."""
        return self.accelerator == accelerator and (device_name is None or self.device_name == device_name)

    def summary(self) -> str:
        parts = [", ".join(f"matmul {name} {flops / 1e12:.2f} TFLOP/s" for name, flops in self.matmul_flops.items())]
        if self.collective_bytes_per_second:
            parts.append(f"all-gather {self.all_gather_bytes_per_second / 1e9:.2f} GB/s, reduce-scatter {self.reduce_scatter_bytes_per_second / 1e9:.2f} GB/s between {self.ranks} ranks")
        if self.host_link_bytes_per_second:
            parts.append(f"host link {self.host_to_device_bytes_per_second / 1e9:.1f} GB/s up, {self.device_to_host_bytes_per_second / 1e9:.1f} GB/s down")
        parts.append(f"{self.optimizer} {self.optimizer_params_per_second / 1e6:.0f}M params/s")
        return "; ".join(parts)


def profile_path() -> Path:
    """Where the profile is kept: ``ZEROPIPE_CALIBRATION``, else ``~/.cache/zeropipe/calibration.json``."""
    named = os.environ.get("ZEROPIPE_CALIBRATION")
    return Path(named).expanduser() if named else Path.home() / ".cache" / "zeropipe" / "calibration.json"


def read_calibration(path: Path | None = None) -> Calibration | None:
    """The saved profile, or None when there is none, or it is unreadable or from another version (then the planner assumes)."""
    path = path or profile_path()
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or raw.get("version") != PROFILE_VERSION:
        return None
    try:
        return Calibration(**raw)
    except TypeError:
        return None


def write_calibration(calibration: Calibration, path: Path | None = None) -> Path:
    path = path or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as handle:
        json.dump(asdict(calibration), handle, indent=2)
    os.replace(handle.name, path)
    return path


# ------------------------------------------------------------------ measurements
def timed(work, seconds: float, warmup: int = 2, sync=lambda: None) -> float:
    """Mean seconds of one call of ``work``, over as many calls as fit in ``seconds`` (after ``warmup`` calls)."""
    for _ in range(warmup):
        work()
    sync()
    calls, started = 0, time.perf_counter()
    while True:
        work()
        calls += 1
        sync()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds and calls >= 3:
            return elapsed / calls


def device_sync(device) -> Any:
    import torch

    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def measure_matmul(device, dtype, size: int, seconds: float) -> float:
    """FLOP/s of ``size x size`` matmuls in ``dtype`` on ``device``."""
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    mean = timed(lambda: torch.mm(a, b), seconds, sync=device_sync(device))
    return 2.0 * size**3 / mean


def measure_host_link(device, num_bytes: int, seconds: float) -> tuple[float, float]:
    """Bytes/s host -> device and device -> host, from pinned host memory."""
    import torch

    host = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    sync = device_sync(device)
    up = timed(lambda: on_device.copy_(host, non_blocking=True), seconds, sync=sync)
    down = timed(lambda: host.copy_(on_device, non_blocking=True), seconds, sync=sync)
    return num_bytes / up, num_bytes / down


def measure_optimizer(params: int, seconds: float, build: bool = True) -> tuple[float, str]:
    """Parameters per second of one Adam step on the host: DeepSpeed's CPU Adam when it builds (``build``), else torch.optim.AdamW."""
    import torch

    weights = torch.nn.Parameter(torch.randn(params))
    weights.grad = torch.randn(params)
    optimizer, name = None, "torch.optim.AdamW (CPU)"
    try:
        if not build:
            raise RuntimeError("not built on request")
        from deepspeed.ops.op_builder import CPUAdamBuilder

        if CPUAdamBuilder().is_compatible(verbose=False) and CPUAdamBuilder().load(verbose=False) is not None:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            optimizer, name = DeepSpeedCPUAdam([weights], lr=1e-4), "DeepSpeed CPU Adam"
    except Exception:  # noqa: BLE001 - the extension cannot be built here: time PyTorch's instead, and say so
        optimizer = None
    if optimizer is None:
        optimizer = torch.optim.AdamW([weights], lr=1e-4, foreach=True)
    mean = timed(optimizer.step, seconds, warmup=1)
    return params / mean, name


def collective_worker(rank: int, ranks: int, accelerator: str, port: int, num_bytes: int, seconds: float, out: str) -> None:
    """One rank of the collective measurement (started by :func:`measure_collectives`)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if accelerator == "cuda" else torch.device("cpu")
    if accelerator == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if accelerator == "cuda" else "gloo", rank=rank, world_size=ranks)
    try:
        elements = num_bytes // 4 // ranks * ranks
        whole = torch.zeros(elements, dtype=torch.float32, device=device)
        shard = torch.ones(elements // ranks, dtype=torch.float32, device=device)
        sync = device_sync(device)

        # torch 2.13 names them all_gather_single / reduce_scatter_single; older releases, *_into_tensor / *_tensor.
        gather_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def all_gather():
            gather_op(whole, shard)

        def reduce_scatter():
            scatter_op(shard, whole)

        def collective_seconds(work) -> float:
            # Every rank must make the same number of calls: the count is agreed (rank 0's
            # estimate, broadcast), not each rank's own time budget.
            work()
            sync()
            started = time.perf_counter()
            work()
            sync()
            calls = torch.tensor([max(3, int(seconds / max(time.perf_counter() - started, 1e-6)))], device=device)
            dist.broadcast(calls, 0)
            dist.barrier()
            started = time.perf_counter()
            for _ in range(int(calls)):
                work()
            sync()
            dist.barrier()
            return (time.perf_counter() - started) / int(calls)

        gather = collective_seconds(all_gather)
        scatter = collective_seconds(reduce_scatter)
        moved = elements * 4 * (ranks - 1) / ranks
        if rank == 0:
            Path(out).write_text(json.dumps({"all_gather": moved / gather, "reduce_scatter": moved / scatter}))
    finally:
        dist.destroy_process_group()


def measure_collectives(ranks: int, accelerator: str, num_bytes: int, seconds: float) -> tuple[float, float]:
    """Bus bandwidth (bytes/s) of all-gather and reduce-scatter between ``ranks`` processes on this machine."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as work:
        out = str(Path(work) / "collectives.json")
        mp.start_processes(collective_worker, args=(ranks, accelerator, port, num_bytes, seconds, out), nprocs=ranks, start_method="spawn")
        figures = json.loads(Path(out).read_text())
    return figures["all_gather"], figures["reduce_scatter"]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:  # no /proc (not Linux): the platform module names the processor below
        pass
    return platform.processor() or platform.machine()


def calibrate(ranks: int, accelerator: str, quick: bool = False, native_bf16: bool = True) -> Calibration:
    """Measure this machine (a few seconds with ``quick``, about a minute without)."""
    import torch

    seconds = 0.2 if quick else 1.0
    notes = []
    if accelerator == "cuda":
        device = torch.device("cuda", 0)
        name = torch.cuda.get_device_name(device)
        size, dtypes = (2048 if quick else 8192), {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        threads = torch.get_num_threads()
    else:
        device, name = torch.device("cpu"), cpu_model()
        size = 256 if quick else 1024
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
        # One rank's share of the cores, as the supervisor gives CPU ranks.
        threads = max(1, (os.cpu_count() or 1) // max(ranks, 1))
        torch.set_num_threads(threads)
        if not native_bf16:
            notes.append("this CPU has no bf16 in hardware: its bf16 figure is PyTorch's emulation")
    flops = {label: measure_matmul(device, dtype, size, seconds) for label, dtype in dtypes.items()}
    up = down = None
    if accelerator == "cuda":
        up, down = measure_host_link(device, (64 if quick else 512) * 2**20, seconds)
    gather = scatter = None
    if ranks > 1:
        gather, scatter = measure_collectives(ranks, accelerator, (4 if quick else 64) * 2**20, seconds)
    else:
        notes.append("one rank: no collective measured")
    # The quick run does not build DeepSpeed's CPU Adam (a minute the first time): PyTorch's AdamW, named as such.
    optimizer_speed, optimizer = measure_optimizer(2_000_000 if quick else 20_000_000, seconds, build=not quick)
    return Calibration(
        accelerator=accelerator,
        device_name=name,
        ranks=ranks,
        matmul_flops=flops,
        all_gather_bytes_per_second=gather,
        reduce_scatter_bytes_per_second=scatter,
        host_to_device_bytes_per_second=up,
        device_to_host_bytes_per_second=down,
        optimizer_params_per_second=optimizer_speed,
        optimizer=optimizer,
        measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        host=socket.gethostname(),
        torch_version=torch.__version__,
        threads=threads,
        notes=notes,
    )
