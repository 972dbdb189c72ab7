"""Start one process per rank, watch them, stop them all when one dies, and say why.

We spawn the ranks with ``subprocess`` rather than torch's elastic agent because the
supervisor needs three things the agent does not give: each rank in its own process group
(so Ctrl-C reaches only us and we stop children such as data-loader workers too), per-rank
host-RAM sampling while they run (the figure the OOM diagnosis quotes), and the order in
which ranks died (the first death is the cause; the rest are ``Connection reset by peer``).
The environment is the one torch.distributed expects (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), so the code inside a rank is the same as under torchrun.

The launcher owns the run directory (``RunDir.claim``) and the ranks die with it: each rank
asks the kernel for a parent-death signal and also watches ``ZEROPIPE_LAUNCHER_PID`` (see
``zeropipe.launch.rank``), so a launcher killed with SIGKILL leaves no rank training on.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from zeropipe.doctor.facts import stale_build_locks
from zeropipe.engine.noise import KNOWN_NOISE
from zeropipe.errors import LaunchError, ZeroPipeError
from zeropipe.launch import fork_start, oom
from zeropipe.launch.diagnose import Diagnosis, RankExit, RunSettings, diagnose, host_ram_fixes
from zeropipe.rundir import RunDir

POLL_SECONDS = 0.2
MEMORY_SECONDS = 1.0
CHILDREN_SECONDS = 5.0
STOP_GRACE_SECONDS = 10.0


@dataclass
class Outcome:
    state: str  # "completed", "failed" or "stopped"
    diagnosis: Diagnosis | None = None
    host_ram_peak_bytes: int = 0
    rank_rss_peak_bytes: list[int] = field(default_factory=list)
    status_error: str | None = None  # why status.json could not record the outcome (a full disk)


def reserve_port() -> tuple[int, socket.socket]:
    """A port for the ranks' rendezvous and the socket that holds it: keep the socket open until the ranks are gone.

    A port found free by binding port 0 and closing is free only at that moment; rank 0 binds it seconds later (after its imports),
    and meanwhile another run's pick, a gloo listener or any outgoing connection may take it: two
    runs side by side (two test workers, two UI launches) would then meet on one port. A socket bound with
    SO_REUSEADDR that never listens keeps every other ``bind(0)`` and ``connect()`` off the port, while rank
    0's TCPStore (libuv's and torch's own both set SO_REUSEADDR) still binds and listens on it.
    """
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", 0))
    return sock.getsockname()[1], sock


CPU_RANK_MMAP_THRESHOLD = 1 << 20  # bytes: host buffers of CPU ranks above 1 MiB are mappings of their own


def usable_cores() -> int:
    """The cores this process may run on (a SLURM or container CPU set, not every core of the machine)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


ARCH_LIST_GIVEN = "ZEROPIPE_TORCH_CUDA_ARCH_LIST_GIVEN"


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder can read it.

    DeepSpeed 0.19's builder (``compute_capability_args``) reads each entry as integers and fails on
    the arch-specific suffixes torch accepts ("9.0a", "10.0f"; NVIDIA's Hopper images set "9.0a"):
    ``ValueError: invalid literal for int() with base 10: '0a'`` while building FusedAdam, seen on
    an H200. Its kernels use none of those features, so the suffix is dropped; "+PTX" is kept.
    """
    entries = [entry for entry in value.replace(" ", ";").split(";") if entry]
    readable = []
    for entry in entries:
        arch, ptx = (entry[: -len("+PTX")], "+PTX") if entry.endswith("+PTX") else (entry, "")
        major, _, minor = arch.partition(".")
        minor_digits = minor.rstrip("abcdefghijklmnopqrstuvwxyz")
        if major.isdigit() and minor_digits.isdigit() and minor_digits != minor:
            entry = f"{major}.{minor_digits}{ptx}"
        if entry not in readable:
            readable.append(entry)
    return ";".join(readable) if readable != entries else value


def rank_environment(
    rank: int, world_size: int, port: int, accelerator: str, local_rank: int | None = None, local_world_size: int | None = None,
    master_addr: str = "127.0.0.1", node_rank: int = 0, zero_stage: int | None = None,
) -> dict[str, str]:
    """torchrun's environment for one rank (on several nodes, with NODE_RANK and the first node's address).

    ``zero_stage``: the run's; ZeRO-3 on CPU ranks gets a fixed glibc mmap threshold (see below).
    """
    local_world_size = local_world_size or world_size
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank if local_rank is None else local_rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(local_world_size),
        NODE_RANK=str(node_rank),
        GROUP_RANK=str(node_rank),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
        # The rank exits when this process does (see zeropipe.launch.rank.die_with_launcher).
        ZEROPIPE_LAUNCHER_PID=str(os.getpid()),
    )
    # Ranks share the cores: without this each rank starts one thread per core and they thrash
    # (CPU ranks' every op; GPU ranks' CPU Adam with optimizer offload: 5 ranks x all cores).
    env.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // local_world_size)))
    if accelerator != "cpu" and "TORCH_CUDA_ARCH_LIST" in env:
        readable = deepspeed_arch_list(env["TORCH_CUDA_ARCH_LIST"])
        if readable != env["TORCH_CUDA_ARCH_LIST"]:
            # The rank's log says so (zeropipe.launch.rank): the variable the user set is not what the ranks see.
            env[ARCH_LIST_GIVEN] = env["TORCH_CUDA_ARCH_LIST"]
            env["TORCH_CUDA_ARCH_LIST"] = readable
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # On CPU ranks ZeRO-3 gathers every layer into new host buffers and frees them after use.
        # glibc raises its mmap threshold to the size of each freed block (up to 32 MiB), so
        # later buffers come from the heap and their holes are never given back: 0.4B-parameter
        # LoRA on 4 ranks peaked at 10.8 GiB in its first step instead of 7.6 GiB
        # (benchmarks/real_scale.py). A fixed threshold keeps large buffers as mappings that
        # return to the system when freed. It costs speed: every large activation buffer is
        # then a fresh mapping with its page faults (ranks of a ZeRO-2 run measured 7% slower,
        # BENCHMARKS.md, packing), and ZeRO-0/1/2 gather nothing, so only ZeRO-3 gets it.
        # Set it yourself to choose another value.
        if zero_stage == 3:
            env.setdefault("MALLOC_MMAP_THRESHOLD_", str(CPU_RANK_MMAP_THRESHOLD))
    return env


NOISE = re.compile("|".join(KNOWN_NOISE))


def tail(path: Path, lines: int = 40) -> list[str]:
    """The last lines of a rank's log, without known third-party deprecation notices.

    A warning is two lines: the notice, and the source line Python prints under it.
    """
    try:
        with open(path, errors="replace") as handle:
            recent = [line.rstrip("\n") for line in deque(handle, maxlen=lines * 20)]
    except FileNotFoundError:
        return []
    kept: list[str] = []
    skip_source_line = False
    for line in recent:
        if NOISE.search(line) and "Warning" in line:
            skip_source_line = True
            continue
        if skip_source_line and line.startswith((" ", "\t")):
            skip_source_line = False
            continue
        skip_source_line = False
        kept.append(line)
    return kept[-lines:]


class Supervisor:
    """The ranks of one node: all of them on a single machine, or this node's share of a multi-node run.

    On several nodes each node's agent (``zeropipe.launch.node``) runs one of these with
    ``first_rank``/``local_ranks``/``master_addr``/``node_rank`` set, and uses only
    :meth:`spawn_ranks`, :meth:`sample_memory` and :meth:`stop_all`: the launcher on the
    first node watches them all (``zeropipe.launch.multinode``).
    """

    def __init__(
        self, run: RunDir, world_size: int, accelerator: str, master_port: int | None = None, on_tick: Callable[[], None] | None = None,
        first_rank: int = 0, local_ranks: int | None = None, master_addr: str = "127.0.0.1", node_rank: int = 0,
        setup_only: bool = False,
    ):
        if world_size < 1:
            # No rank would ever report back: wait() would wait forever.
            raise LaunchError(f"{world_size} ranks cannot train: hardware.gpus must be at least 1")
        self.run = run
        self.world_size = world_size
        self.accelerator = accelerator
        # The port held for the run's life when zeropipe picks it (hardware.master_port unset): see reserve_port.
        self.port, self.port_reservation = (master_port, None) if master_port else reserve_port()
        self.on_tick = on_tick
        self.local_ranks = local_ranks or world_size
        self.ranks = list(range(first_rank, first_rank + self.local_ranks))  # the global ranks this node runs
        self.master_addr = master_addr
        self.node_rank = node_rank
        self.procs: list[subprocess.Popen | fork_start.ForkedProcess] = []
        # The node's setup process (RunPlan.node_setup, e.g. a diffusion run filling its caches):
        # it runs to the end before any rank starts, so no rank is resident while it holds encoders.
        plan = run.read_plan_fields()
        self.node_setup = plan.get("node_setup")
        self.zero_stage = plan.get("zero_stage")
        self.setup_proc: subprocess.Popen | fork_start.ForkedProcess | None = None
        self.ranks_started = False
        # A multi-node launcher runs the setup on its own node first and starts the node agents after
        # (the caches live in the shared run directory): wait() then returns once the setup is done.
        self.setup_only = setup_only
        self.host_ram_peak = 0
        self.host_ram_baseline = psutil.virtual_memory().used
        self.rank_rss_peak = [0] * self.local_ranks
        self.setup_rss_peak = 0
        self.rank_processes: dict[int, psutil.Process] = {}
        self.rank_children: dict[int, list[psutil.Process]] = {}
        self.last_memory_sample = self.last_children_scan = float("-inf")
        self.status_error: str | None = None
        self.oom_kills_at_start = oom.cgroup_oom_kills()
        self.hurry = False  # a second Ctrl-C while stopping: no grace period
        self.interrupted = False

    def record(self, **fields) -> None:
        """Write status.json; a disk that refuses it is remembered and said, never raised past the ranks' fate."""
        try:
            self.run.write_status(**fields)
        except OSError as err:
            self.status_error = f"could not record {fields.get('state', 'the state')!r} in {self.run.status_file}: {err.strerror or err}"

    def outcome(self, state: str, diagnosis: Diagnosis | None = None) -> Outcome:
        return Outcome(state, diagnosis, self.host_ram_peak, self.rank_rss_peak, self.status_error)

    def start(self) -> None:
        # Only the owner of the run directory starts ranks into it (prepare_run claimed it).
        self.run.require_owner()
        # Installed before any rank exists: a SIGTERM to the launcher (a job scheduler, the UI's
        # stop button) must never leave ranks behind, even in the moment they are being started.
        # The ranks ask the kernel for a signal when the thread that started them ends: that
        # must be the main thread, which lives as long as the launcher.
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("Supervisor.start must run in the main thread: ranks die with the thread that started them")
        self.previous_handlers = {sig: signal.signal(sig, self.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        if self.node_setup:
            self.start_setup()
        else:
            self.start_ranks()

    def start_setup(self) -> None:
        """Start the node's setup process; wait() starts the ranks once it has finished."""
        self.run.write_progress("starting the node's setup (filling the caches)")
        try:
            log = open(self.run.node_setup_log, "a")
            log.write(f"==== zeropipe node setup ({self.node_setup}) started {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
            log.flush()
            self.setup_proc = start_process("zeropipe.launch.node_setup", str(self.run.path), rank_environment(0, 1, self.port, self.accelerator), log)
            log.close()
        except BaseException as err:
            self.stop_all()
            self.record(state="stopped" if isinstance(err, KeyboardInterrupt) else "failed", ended_at=time.time())
            for sig, handler in self.previous_handlers.items():
                signal.signal(sig, handler)
            raise
        self.record(state="running", pids=[self.setup_proc.pid], supervisor_pid=os.getpid(), started_at=time.time(), diagnosis=None, phase="node setup")

    def start_ranks(self) -> None:
        self.ranks_started = True
        self.run.write_progress(f"starting {self.world_size} rank(s): loading the model")
        try:
            self.spawn_ranks()
        except BaseException as err:
            self.stop_all()
            self.record(state="stopped" if isinstance(err, KeyboardInterrupt) else "failed", ended_at=time.time())
            for sig, handler in self.previous_handlers.items():
                signal.signal(sig, handler)
            raise
        # After a node setup the run started with it: its start time stays.
        started = {} if self.setup_proc is not None else {"started_at": time.time()}
        self.record(state="running", pids=[p.pid for p in self.procs], supervisor_pid=os.getpid(), diagnosis=None, phase="training", **started)

    def spawn_ranks(self, extra_env: dict[str, str] | None = None) -> None:
        """One process per rank of this node, each in its own session (process group), logging to logs/rank{N}.log."""
        cleared = clear_stale_build_locks()
        for local_rank, rank in enumerate(self.ranks):
            log = open(self.run.rank_log(rank), "a")
            log.write(f"==== zeropipe rank {rank}/{self.world_size} started {time.strftime('%Y-%m-%d %H:%M:%S')} ====\n")
            log.writelines(f"zeropipe: {line}\n" for line in cleared)
            log.flush()
            env = rank_environment(
                rank, self.world_size, self.port, self.accelerator, local_rank, self.local_ranks, self.master_addr, self.node_rank, self.zero_stage
            )
            proc = start_process("zeropipe.launch.rank", str(self.run.path), env | (extra_env or {}), log)
            log.close()
            self.procs.append(proc)

    def sample_memory(self) -> None:
        """Host RAM of the node and of each rank (with its children), at most once per MEMORY_SECONDS.

        The supervisor shares the cores with the ranks: listing children walks all of /proc,
        so the list is refreshed only every CHILDREN_SECONDS.
        """
        now = time.monotonic()
        if now - self.last_memory_sample < MEMORY_SECONDS:
            return
        self.last_memory_sample = now
        refresh_children = now - self.last_children_scan >= CHILDREN_SECONDS
        if refresh_children:
            self.last_children_scan = now
        self.host_ram_peak = max(self.host_ram_peak, psutil.virtual_memory().used)
        if self.setup_proc is not None and not self.ranks_started:
            with contextlib.suppress(psutil.Error):  # it has just ended: its peak is already counted
                self.setup_rss_peak = max(self.setup_rss_peak, psutil.Process(self.setup_proc.pid).memory_info().rss)
        for rank, proc in enumerate(self.procs):  # local indices
            try:
                process = self.rank_processes.setdefault(rank, psutil.Process(proc.pid))
                if refresh_children:
                    self.rank_children[rank] = process.children(recursive=True)
                rss = process.memory_info().rss
                for child in self.rank_children.get(rank, []):
                    with contextlib.suppress(psutil.Error):  # a child that has just ended holds nothing
                        rss += child.memory_info().rss
            except psutil.Error:
                continue
            self.rank_rss_peak[rank] = max(self.rank_rss_peak[rank], rss)

    def wait(self) -> Outcome:
        """Block until every rank has finished, one has failed, or the user pressed Ctrl-C."""
        exits: dict[int, RankExit] = {}
        try:
            while True:
                self.sample_memory()
                if not self.ranks_started:
                    assert self.setup_proc is not None
                    code = self.setup_proc.poll()
                    if code is not None and code != 0:
                        return self.fail_setup(code)
                    if code == 0 and self.setup_only:
                        return self.outcome("completed")
                    if code == 0:
                        self.start_ranks()
                    else:
                        if self.on_tick:
                            self.on_tick()
                        time.sleep(POLL_SECONDS)
                        continue
                now = time.time()
                for rank, proc in enumerate(self.procs):
                    if rank not in exits and proc.poll() is not None:
                        exits[rank] = RankExit(rank, proc.returncode, now)
                failed = [e for e in exits.values() if e.returncode != 0]
                if failed:
                    return self.fail(exits)
                if len(exits) == self.world_size:
                    self.record(state="completed", ended_at=time.time(), **self.memory_status())
                    return self.outcome("completed")
                if self.on_tick:
                    self.on_tick()
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt:
            self.stop_all()
            self.record(state="stopped", ended_at=time.time(), **self.memory_status())
            return self.outcome("stopped")
        except BaseException as err:
            # The supervisor itself failed (a bug, an unreadable file): its ranks must not train on
            # unwatched, and the run must not stay "running".
            self.stop_all()
            text = f"the launcher failed while watching the ranks ({type(err).__name__}: {err}); every rank was stopped"
            self.record(
                state="failed",
                ended_at=time.time(),
                diagnosis={"text": text, "cause": f"{type(err).__name__}: {err}", "fix": "resume with --resume; report this with the traceback if it repeats"},
                **self.memory_status(),
            )
            raise
        finally:
            for sig, handler in self.previous_handlers.items():
                signal.signal(sig, handler)

    def memory_status(self) -> dict:
        status = {"host_ram_peak_bytes": self.host_ram_peak, "rank_rss_peak_bytes": self.rank_rss_peak}
        if self.setup_proc is not None:
            status["node_setup_rss_peak_bytes"] = self.setup_rss_peak
        return status

    def fail_setup(self, returncode: int) -> Outcome:
        """The node's setup process failed: no rank was started; say why as for a rank."""
        assert self.setup_proc is not None
        failed = RankExit(0, returncode, time.time(), tail(self.run.node_setup_log), self.run.read_json(self.run.node_setup_error), self.setup_proc.pid, name="the node's setup process (caching)")
        self.stop_all()
        total = psutil.virtual_memory().total
        settings = run_settings(self.run)
        diagnosis = diagnose(
            [failed],
            self.host_ram_peak,
            total,
            disk_free_bytes=disk_free(self.run.path),
            oom=oom.gather(self.oom_kills_at_start, total) if failed.signal_name == "SIGKILL" else None,
            settings=settings,
        )
        if diagnosis.fix.startswith(host_ram_fixes(settings)):  # the diagnosis says the node ran out of host RAM
            # Its memory does not depend on the ranks or ZeRO: it holds one copy of the frozen encoders.
            diagnosis.fix = (
                "it holds one copy of the frozen encoders (text encoders and VAE) for the whole node: more RAM for the machine or container, "
                "or fill the caches on a machine with a GPU (encoders load in bf16 there); then start the run again"
            )
        self.record(state="failed", ended_at=time.time(), diagnosis=diagnosis.to_dict(), **self.memory_status())
        return self.outcome("failed", diagnosis)

    def fail(self, exits: dict[int, RankExit]) -> Outcome:
        # A moment for ranks that fail on their own (a shared bad config) to record why.
        time.sleep(0.5)
        now = time.time()
        for rank, proc in enumerate(self.procs):
            if rank not in exits and proc.poll() is not None:
                exits[rank] = RankExit(rank, proc.returncode, now)
        first = min(e.seen_at for e in exits.values() if e.returncode != 0)
        self.stop_all()
        for rank, proc in enumerate(self.procs):
            if rank not in exits:
                # Stopped by us: later than any real failure by construction.
                exits[rank] = RankExit(rank, proc.returncode if proc.returncode is not None else -9, first + 60)
        for e in exits.values():
            e.log_tail = tail(self.run.rank_log(e.rank))
            e.error = self.run.read_json(self.run.rank_error(e.rank))
        ordered = [exits[r] for r in sorted(exits)]
        for e in ordered:
            e.pid = self.procs[e.rank].pid
        total = psutil.virtual_memory().total
        killed = any(e.signal_name == "SIGKILL" for e in ordered)
        diagnosis = diagnose(
            ordered,
            self.host_ram_peak,
            total,
            disk_free_bytes=disk_free(self.run.path),
            oom=oom.gather(self.oom_kills_at_start, total) if killed else None,
            settings=run_settings(self.run),
        )
        self.record(state="failed", ended_at=time.time(), diagnosis=diagnosis.to_dict(), **self.memory_status())
        return self.outcome("failed", diagnosis)

    def stop_all(self) -> None:
        """SIGTERM every rank's process group, then SIGKILL what is left: no orphans.

        A second Ctrl-C or SIGTERM meanwhile cuts the grace period short instead of
        interrupting the stop (which left status.json at "running").
        """
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, self.hurry_up) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            processes = self.procs + ([self.setup_proc] if self.setup_proc is not None else [])
            for proc in processes:
                if proc.poll() is None:
                    signal_group(proc.pid, signal.SIGTERM)
            deadline = time.time() + STOP_GRACE_SECONDS
            while not self.hurry and time.time() < deadline and any(proc.poll() is None for proc in processes):
                time.sleep(0.05)
            for proc in processes:
                # Also the group: a rank's children (data-loader workers, compilers) die with it.
                signal_group(proc.pid, signal.SIGKILL)
                if proc.poll() is None:
                    proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def hurry_up(self, signum, frame) -> None:
        self.hurry = True

    def interrupt(self, signum, frame) -> None:
        """Ctrl-C or SIGTERM: the first stops the run; any later one only hurries the stop along.

        A second KeyboardInterrupt raised while the first is being handled would escape the
        stop and leave status.json at "running" (a double Ctrl-C 10 ms apart did).
        """
        if self.interrupted:
            self.hurry = True
            return
        self.interrupted = True
        raise KeyboardInterrupt


def start_process(module: str, run_path: str, env: dict[str, str], log) -> subprocess.Popen | fork_start.ForkedProcess:
    """``python -m MODULE RUN_DIR`` in its own session, logging to ``log``; forked from this process where asked and safe (``fork_start``)."""
    if fork_start.why_not_fork(env) is None:
        entry = importlib.import_module(module)
        log.write(f"zeropipe: forked from the launcher (pid {os.getpid()}), {fork_start.RANK_START}=fork\n")
        log.flush()
        return fork_start.start(module, entry.main, [run_path], env, log)
    return subprocess.Popen(
        [sys.executable, "-m", module, run_path],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        start_new_session=True,
    )


def clear_stale_build_locks() -> list[str]:
    """Remove the lock files that stopped DeepSpeed op builds left behind (``stale_build_locks``), one line said per lock.

    Without this a rank that needs the op (the CPU ranks' collective, CPU Adam, FusedAdam) would
    wait for the dead build forever, silently. The line goes to the launcher's output and to
    every rank's log.
    """
    said = []
    for lock in stale_build_locks():
        with contextlib.suppress(FileNotFoundError):
            lock.unlink()
            line = (
                f"removed {lock}: a DeepSpeed op build that was stopped left it, and every rank needing "
                f"the {lock.parent.name} op would have waited for that build forever; the op is built again"
            )
            print(f"zeropipe: {line}", file=sys.stderr, flush=True)
            said.append(line)
    return said


def run_settings(run: RunDir) -> RunSettings:
    """The run's ZeRO stage, rank count and offload, from the files the launcher wrote."""
    plan = run.read_plan_fields()
    zero = (run.read_json(run.ds_config, {}) or {}).get("zero_optimization") or {}

    def offloads(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") not in ("none", None)

    try:
        model = run.read_config_fields().get("model") or {}
    except (OSError, ZeroPipeError):
        model = {}
    checkpointing = model.get("gradient_checkpointing")
    return RunSettings(
        plan.get("zero_stage"),
        plan.get("world_size"),
        offloads("offload_optimizer"),
        offloads("offload_param"),
        plan.get("micro_batch_size"),
        checkpointing if isinstance(checkpointing, bool) else None,
    )


def disk_free(path: Path) -> int | None:
    """Free bytes on the disk of the run directory (a rank that cannot write may not say why: its log is there too)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def raise_keyboard_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
