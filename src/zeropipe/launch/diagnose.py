"""Turn a dead rank into one diagnosis in words: which rank, how it died, the likely cause, the fix.

Pure functions over what the supervisor observed; no process handling here.
"""

from __future__ import annotations

import re
import signal
from dataclasses import asdict, dataclass, field

from zeropipe.launch.oom import OomEvidence

GIB = 2**30  # the planner, the doctor and the UI count memory in GiB too
DISK_FULL_BYTES = 16 * 2**20
GPU_OOM = "the GPU ran out of memory"
DISK_FULL_FIX = "free space where the run directory lives (or set run.output_dir on another disk), or lower train.keep_last; then resume with --resume"

# What survivors print when a peer disappears: never the cause, always an effect.
SECONDARY_PATTERNS = [
    r"Connection reset by peer",
    r"Broken pipe",
    r"Connection closed by peer",
    r"TCPStore",
    r"recvValue|recvBytes|sendBytes",
    r"DistNetworkError",
    r"ProcessGroupGloo.*(timed out|closed)",
    r"NCCL.*(remote process exited|unhandled system error)",
    r"gloo/transport",
]

# (pattern in the rank's log, likely cause, fix)
KNOWN_CAUSES = [
    (r"CUDA out of memory|OutOfMemoryError", GPU_OOM, "lower train.micro_batch_size, enable model.gradient_checkpointing, raise deepspeed.zero_stage or offload to CPU (zeropipe plan shows what fits)"),
    (r"Cannot copy out of meta tensor|meta tensor", "a parameter was used while still on the meta device (ZeRO-3 partitioning)", "report this with the log: ZeRO-Pipe builds models under zero.Init so this should not happen"),
    (r"No space left on device", "the disk is full", DISK_FULL_FIX),
    (r"Address already in use", "the rendezvous port is taken", "set hardware.master_port to a free port or leave it unset"),
    (r"CUDA_HOME|nvcc|error building extension|ninja: build stopped", "DeepSpeed failed to JIT-build one of its ops", "check that the CUDA toolkit matches torch's CUDA version; DS_SKIP_CUDA_CHECK=1 is the known escape for a minor mismatch"),
    (r"Extra inputs are not permitted", "DeepSpeed rejected a key of the DeepSpeed JSON", "remove the key it names from deepspeed.config_file or deepspeed.overrides"),
]


@dataclass
class RankExit:
    rank: int
    returncode: int
    seen_at: float
    log_tail: list[str] = field(default_factory=list)
    error: dict | None = None  # errors/rank{N}.json when the rank recorded its exception
    pid: int | None = None
    node: str | None = None  # on several nodes: "node 1 (box2)"
    lost: str | None = None  # its node was lost (agent killed, connection cut): how, in words
    name: str = ""  # what the process was, when not a rank (the node's setup process)

    @property
    def label(self) -> str:
        return self.name or f"rank {self.rank}"

    @property
    def signal_name(self) -> str | None:
        if self.returncode < 0:
            try:
                return signal.Signals(-self.returncode).name
            except ValueError:
                return f"signal {-self.returncode}"
        return None

    @property
    def looks_secondary(self) -> bool:
        if self.signal_name or self.lost:
            return False
        text = "\n".join(self.log_tail[-40:]) + (self.error or {}).get("message", "")
        return any(re.search(p, text) for p in SECONDARY_PATTERNS)


@dataclass
class Diagnosis:
    rank: int
    how: str
    cause: str
    fix: str
    host_ram_peak_bytes: int
    host_ram_total_bytes: int
    log_tail: list[str]
    other_ranks: list[str]
    node: str | None = None  # on several nodes: the node the rank ran on
    process: str = ""  # what died when it was not a rank (the node's setup process)

    def render(self) -> str:
        where = f" on {self.node}" if self.node else ""
        who = self.process or f"rank {self.rank}"
        lines = [f"{who}{where} {self.how}", f"likely cause: {self.cause}"]
        if self.fix:
            lines.append(f"fix: {self.fix}")
        if self.other_ranks:
            lines.append("the other ranks were then stopped (" + "; ".join(self.other_ranks) + ") - effects, not causes")
        if self.log_tail:
            lines.append(f"last lines of {who}'s log:")
            lines += [f"  | {line}" for line in self.log_tail[-15:]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self) | {"text": self.render()}


def choose_primary(exits: list[RankExit]) -> RankExit:
    """The rank whose death started it: the first seen, preferring one that does not look secondary."""
    failed = [e for e in exits if e.returncode != 0]
    first_seen = min(e.seen_at for e in failed)
    # Ranks seen dead within one poll of the first are candidates: which exited first is not observable finer.
    candidates = sorted((e for e in failed if e.seen_at - first_seen < 1.0), key=lambda e: (e.looks_secondary, e.seen_at, e.rank))
    return candidates[0]


@dataclass
class RunSettings:
    """The run's memory-relevant choices, so a fix never suggests what is already set."""

    zero_stage: int | None = None
    ranks: int | None = None
    offload_optimizer: bool = False
    offload_param: bool = False
    micro_batch_size: int | None = None
    gradient_checkpointing: bool | None = None


def gpu_memory_fixes(settings: RunSettings) -> str:
    """Ways to need less GPU memory that this run does not use yet."""
    fixes = []
    if settings.micro_batch_size is None or settings.micro_batch_size > 1:
        fixes.append(f"lower train.micro_batch_size{f' (now {settings.micro_batch_size})' if settings.micro_batch_size else ''}")
    if not settings.gradient_checkpointing:
        fixes.append("model.gradient_checkpointing: true")
    if settings.zero_stage is None or settings.zero_stage < 3:
        fixes.append(f"a higher deepspeed.zero_stage{f' (now {settings.zero_stage})' if settings.zero_stage is not None else ''}")
    if not settings.offload_optimizer:
        fixes.append("deepspeed.offload_optimizer: cpu")
    if settings.zero_stage == 3 and not settings.offload_param:
        fixes.append("deepspeed.offload_param: cpu")
    if not fixes:
        fixes.append("more GPUs (hardware.gpus) or a shorter data.max_seq_len: this run already uses every memory saving")
    return "; ".join(fixes) + " (zeropipe plan shows what fits)"


def host_ram_fixes(settings: RunSettings) -> str:
    """Ways to need less host RAM that this run does not use yet."""
    fixes = []
    if settings.zero_stage != 3:
        fixes.append("deepspeed.zero_stage: 3 (each rank loads only its share of the weights)")
    if settings.ranks is None or settings.ranks > 1:
        fixes.append(f"fewer ranks on this node (hardware.gpus{f', now {settings.ranks}' if settings.ranks else ''})")
    if settings.offload_optimizer or settings.offload_param:
        on = " and ".join(key for key, used in (("offload_optimizer", settings.offload_optimizer), ("offload_param", settings.offload_param)) if used)
        fixes.append(f"less CPU offload (deepspeed.{on} keeps those states in host RAM)")
    fixes.append("more RAM for the machine or container")
    return "; ".join(fixes) + " (zeropipe plan shows each choice's host-RAM need)"


def sigkill_cause(pid: int | None, ram: str, near_full: bool, oom: OomEvidence | None, settings: RunSettings) -> tuple[str, str]:
    """(cause, fix) of a SIGKILL: the OOM killer only when the records or the RAM figures say so."""
    verdict = oom.verdict(pid) if (oom is not None and pid is not None) else None
    sources = " and ".join(oom.sources) if oom is not None else ""
    if verdict is True:
        return f"the kernel's OOM killer killed it ({sources} record it); {ram}", host_ram_fixes(settings)
    elsewhere = "a user's kill -9, a job scheduler's hard limit or a container runtime"
    resume = "find what sent it; then resume with --resume"
    if verdict is False:
        return f"not the OOM killer ({sources} record no OOM kill; {ram}): something outside ZeRO-Pipe sent SIGKILL ({elsewhere})", resume
    if near_full:
        return f"most likely the kernel's OOM killer: {ram} - the node ran out of memory", host_ram_fixes(settings) + "; `dmesg | grep -i oom` confirms an OOM kill"
    cause = (
        f"probably not the OOM killer: {ram}, far from full; something else sent SIGKILL ({elsewhere}). "
        "A spike shorter than a second can escape the sampling: `dmesg | grep -i oom` tells for sure"
    )
    return cause, resume


def diagnose(
    exits: list[RankExit],
    host_ram_peak_bytes: int,
    host_ram_total_bytes: int,
    primary: RankExit | None = None,
    disk_free_bytes: int | None = None,
    oom: OomEvidence | None = None,
    settings: RunSettings | None = None,
) -> Diagnosis:
    primary = primary or choose_primary(exits)
    if oom is not None and oom.memory_limit_bytes:
        host_ram_total_bytes = oom.memory_limit_bytes  # a container's limit is the RAM that counts
    ram = f"host RAM peaked at {host_ram_peak_bytes / GIB:.1f} of {host_ram_total_bytes / GIB:.1f} GiB"
    text = "\n".join(primary.log_tail) + "\n" + (primary.error or {}).get("traceback", "")
    sig = primary.signal_name
    if primary.lost:
        how = f"was lost with its node: {primary.lost}"
        cause = (
            f"{primary.node or 'its node'} stopped answering the launcher (the node agent was killed, the SSH connection or "
            "the network dropped, or the machine went down); its ranks were stopped by its agent or died with it"
        )
        fix = "check that the node is up and reachable from this one (ssh HOST true), then resume with --resume"
    elif sig == "SIGKILL":
        how = "was killed by SIGKILL"
        near_full = host_ram_peak_bytes > 0.9 * host_ram_total_bytes
        cause, fix = sigkill_cause(primary.pid, ram, near_full, oom, settings or RunSettings())
    elif sig:
        how = f"was killed by {sig}"
        causes = {
            "SIGSEGV": ("a crash in native code (CUDA, NCCL or a compiled DeepSpeed op)", "run `zeropipe doctor`; check driver and library versions"),
            "SIGABRT": ("a native library aborted", "see the log lines below; NCCL and CUDA errors abort the process"),
            "SIGTERM": ("it was terminated from outside ZeRO-Pipe (a job scheduler, a user, or a container limit)", "check what sent SIGTERM; resume with --resume"),
            "SIGBUS": ("a memory-mapped file vanished or /dev/shm is too small", "enlarge /dev/shm (docker --shm-size) and keep data files in place during the run"),
        }
        cause, fix = causes.get(sig, (f"the process received {sig}", "resume with --resume once the cause is fixed"))
        cause = f"{cause}; {ram}"
    else:
        how = f"exited with code {primary.returncode}"
        error = primary.error or {}
        message = error.get("message") or last_exception_line(primary.log_tail)
        cause, fix = message or "see the log lines below", ""
        if error.get("user_error"):
            fix = ""
        for pattern, known_cause, known_fix in KNOWN_CAUSES:
            if re.search(pattern, text):
                cause, fix = f"{known_cause} ({message})" if message else known_cause, known_fix
                if known_cause == GPU_OOM and settings is not None:
                    fix = gpu_memory_fixes(settings)
                break
        else:
            if disk_free_bytes is not None and disk_free_bytes < DISK_FULL_BYTES:
                # A rank that cannot write cannot write down why either: its log is on the same disk.
                cause = f"the disk holding the run directory is full ({disk_free_bytes / 2**20:.1f} MiB free){f'; {message}' if message else ''}"
                fix = DISK_FULL_FIX
            elif primary.looks_secondary:
                cause = f"lost contact with another rank ({message}); the real failure is in another rank's log"
    others = [describe_exit(e) for e in exits if e.rank != primary.rank]
    return Diagnosis(primary.rank, how, cause, fix, host_ram_peak_bytes, host_ram_total_bytes, primary.log_tail, others, primary.node, process=primary.name)


def describe_exit(e: RankExit) -> str:
    name = f"rank {e.rank}" + (f" on {e.node}" if e.node else "")
    if e.returncode == 0:
        return f"{name} had finished"
    if e.lost:
        return f"{name} was lost with its node"
    return f"{name} " + (f"got {e.signal_name}" if e.signal_name else f"exited {e.returncode}")


def last_exception_line(lines: list[str]) -> str:
    """The final 'SomeError: message' line of a Python traceback in a log."""
    for line in reversed(lines):
        stripped = line.strip()
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*", stripped):
            return stripped
    return ""
