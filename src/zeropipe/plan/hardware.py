"""The machine a plan is made for: GPUs per node, memory per GPU, nodes, host RAM per node.

Sizes written by people ("24GB", "64GB") are read as binary gigabytes (GiB): a "24 GB"
RTX 3090/4090 has 24 GiB (nvidia-smi shows 24576 MiB) and a "64 GB" box has 64 GiB of DIMMs.
Every size the planner prints is in GiB for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from zeropipe.doctor.calibrate import Calibration, read_calibration
from zeropipe.doctor.facts import cpu_runs_bf16_natively
from zeropipe.errors import ZeroPipeError

GIB = 1024**3

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "mib": 1024**2,
    "g": GIB,
    "gb": GIB,
    "gib": GIB,
    "t": 1024**4,
    "tb": 1024**4,
    "tib": 1024**4,
}


@dataclass(frozen=True)
class Hardware:
    """What the ranks run on. On CPU ranks, ``gpu_memory_bytes`` is host RAM divided across the ranks."""

    gpus_per_node: int
    gpu_memory_bytes: int
    nodes: int
    host_ram_bytes: int  # per node
    gpu_name: str | None = None
    accelerator: str = "cuda"  # "cuda" or "cpu"
    notes: tuple[str, ...] = ()  # how the figures were obtained, shown to the user
    # The CPU has bf16 in hardware (avx512_bf16/AMX in its flags; read once, by detect_hardware).
    # Used on CPU ranks only: without it PyTorch emulates bf16, 18-56x slower than fp32, so the
    # planner then tries fp32 alone and precision "auto" picks fp32.
    cpu_bf16_native: bool = False
    # What zeropipe calibrate measured on this kind of machine (read once, by detect_hardware);
    # None: the cost model assumes its speeds (plan/cost.py says which).
    calibration: Calibration | None = None
    # The GPUs compute in bf16 in hardware (compute capability 8.0, Ampere, or newer; read once,
    # by detect_hardware). None where not known (GPUs described on the command line: judged by name).
    gpu_bf16_native: bool | None = None

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def describe(self) -> str:
        kind = "CPU ranks" if self.accelerator == "cpu" else (self.gpu_name or "GPUs")
        nodes = f" x {self.nodes} nodes" if self.nodes > 1 else ""
        return (
            f"{self.gpus_per_node} x {format_gib(self.gpu_memory_bytes)} {kind}{nodes}, "
            f"{format_gib(self.host_ram_bytes)} host RAM{' per node' if self.nodes > 1 else ''}"
        )

    def with_gpus(self, gpus_per_node: int) -> Hardware:
        """The same machine running a different number of ranks per node (CPU ranks share the RAM anew)."""
        if gpus_per_node == self.gpus_per_node:
            return self
        memory = self.gpu_memory_bytes
        if self.accelerator == "cpu":
            memory = self.host_ram_bytes // gpus_per_node
        return replace(self, gpus_per_node=gpus_per_node, gpu_memory_bytes=memory)


def parse_size(text: str | float, what: str = "size") -> int:
    """Bytes in "24GB", "24 GiB", "512MB", "2.5T" or a plain number of bytes.

    Raises:
        ZeroPipeError: when the text is not a size.
    """
    if isinstance(text, (int, float)):
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ZeroPipeError(f"{what} {text!r} is not a size: write it like 24GB, 64GB or 512MB")
    return int(float(match.group(1)) * _UNITS[unit])


def parse_hardware(gpus: str, ram: str, nodes: int = 1, gpu_name: str | None = None) -> Hardware:
    """The hardware of ``--gpus 5x24GB --ram 64GB --nodes 1``.

    Raises:
        ZeroPipeError: when ``gpus`` is not ``COUNTxSIZE`` or a size is malformed.
    """
    match = re.fullmatch(r"\s*([0-9]+)\s*[xX*]\s*(.+)", gpus)
    if not match:
        raise ZeroPipeError(f"--gpus {gpus!r}: write the GPUs per node and the memory of one, e.g. 5x24GB")
    count = int(match.group(1))
    if count < 1:
        raise ZeroPipeError(f"--gpus {gpus!r}: at least one GPU per node")
    if nodes < 1:
        raise ZeroPipeError(f"--nodes {nodes}: at least one node")
    return Hardware(
        gpus_per_node=count,
        gpu_memory_bytes=parse_size(match.group(2), "--gpus memory"),
        nodes=nodes,
        host_ram_bytes=parse_size(ram, "--ram"),
        gpu_name=gpu_name,
        accelerator="cuda",
        notes=(f"as given: {gpus} per node, {ram} host RAM, {nodes} node(s)",),
    )


def detect_hardware(cpu_ranks: int = 2) -> Hardware:
    """This machine: CUDA devices through torch, host RAM through psutil.

    Without CUDA the ranks are CPU processes (gloo), ``cpu_ranks`` of them as ``zeropipe
    train`` starts by default, and the "GPU memory" of each is its share of the host RAM.
    """
    import psutil
    import torch

    ram = int(psutil.virtual_memory().total)
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        count = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(count)]
        # Ranks step together, so the smallest card bounds every rank.
        smallest = min(props, key=lambda p: p.total_memory)
        names = sorted({p.name for p in props})
        notes = [f"detected {count} CUDA device(s): {', '.join(names)}; host RAM {format_gib(ram)}"]
        if len(names) > 1 or len({p.total_memory for p in props}) > 1:
            notes.append(f"GPUs differ: every rank is planned with the smallest ({smallest.name}, {format_gib(smallest.total_memory)})")
        # torch.cuda.is_bf16_supported() counts emulation (pre-Ampere GPUs say yes): ask the capability.
        bf16 = all(p.major >= 8 for p in props)
        return Hardware(
            count, int(smallest.total_memory), 1, ram, smallest.name, "cuda", tuple(notes), cpu_bf16_native=cpu_runs_bf16_natively(),
            calibration=read_calibration(), gpu_bf16_native=bf16,
        )
    note = (
        f"no CUDA device: {cpu_ranks} CPU ranks, and the 'GPU memory' of each CPU rank is its share of the "
        f"{format_gib(ram)} of host RAM ({format_gib(ram // cpu_ranks)}); both budgets are the same RAM"
    )
    return Hardware(cpu_ranks, ram // cpu_ranks, 1, ram, None, "cpu", (note,), cpu_bf16_native=cpu_runs_bf16_natively(), calibration=read_calibration())


def supports_bf16(hardware: Hardware) -> bool:
    """bf16 on GPUs needs Ampere or newer (names of older cards are recognised, unknown ones are assumed new); on CPU ranks, bf16 in hardware."""
    if hardware.accelerator == "cpu":
        return hardware.cpu_bf16_native
    if hardware.gpu_bf16_native is not None:
        return hardware.gpu_bf16_native
    if not hardware.gpu_name:
        return True
    name = hardware.gpu_name.lower()
    older = ("v100", "t4", "p100", "p40", "k80", "titan v", "titan rtx", "quadro rtx", "gtx", "rtx 20", "rtx 2080", "rtx 2070", "rtx 2060")
    return not any(marker in name for marker in older)


def format_gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB"
