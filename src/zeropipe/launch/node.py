"""The node agent: ``python -m zeropipe.launch.node RUN_DIR --node-rank K ...``, one per node of a multi-node run.

The launcher on the first node starts one agent per node (itself for this machine, over SSH
or ``srun`` for the others; see ``zeropipe.launch.multinode``). An agent runs this node's
ranks with the same :class:`~zeropipe.launch.supervisor.Supervisor` a single-node run uses
(one process group per rank, host-RAM sampling) and talks to the launcher over its own
stdin/stdout, which SSH and srun carry:

- stdout, one JSON object per line: ``hello`` (host, versions, RAM, whether the run directory
  is the launcher's), ``started``, ``memory`` every second, ``exit`` for each rank that ends
  (signal or code, its log tail and error record), ``done``.
- stdin, one command per line: ``start``, ``ping`` (the launcher is alive), ``stop GRACE``.

The channel is also the agent's lifeline. When it ends (the launcher died, ``ssh`` was killed,
the TCP connection dropped: stdin reads EOF) or stays silent for HEARTBEAT_TIMEOUT seconds (a
network partition that leaves the socket half open), the agent kills its ranks and exits.
The ranks die with the agent itself (``zeropipe.launch.rank.die_with_launcher``: their parent
is the agent), so killing the agent with SIGKILL leaves no rank behind either.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import socket
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import psutil

HEARTBEAT_TIMEOUT = 6.0  # seconds without a line from the launcher: it is gone
MEMORY_SECONDS = 1.0
TOKEN_FILE = "nodes/token"
VERSIONED = ("torch", "deepspeed", "transformers", "zeropipe")


def versions() -> dict[str, str]:
    """The versions that must match on every node: a mismatch fails inside collectives, hours later or at once."""
    found = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def network_interfaces() -> list[str]:
    """Names of the up, non-loopback interfaces with an IPv4 address (the ones NCCL/gloo could pick)."""
    stats = psutil.net_if_stats()
    names = []
    for name, addresses in psutil.net_if_addrs().items():
        if name == "lo" or not (stats.get(name) and stats[name].isup):
            continue
        if any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses):
            names.append(name)
    return sorted(names)


def visible_gpu_count(environ=os.environ, driver_dir: Path = Path("/proc/driver/nvidia/gpus")) -> int | None:
    """The NVIDIA GPUs the ranks here would see, without importing torch (seconds in a probe); None: not known.

    CUDA_VISIBLE_DEVICES when set, else the devices NVIDIA's driver lists.
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip() and not device.strip().startswith("-")])
    try:
        return len(list(driver_dir.iterdir()))
    except OSError:
        return None


def too_few_gpus(accelerator: str, ranks: int, gpus: int | None, host: str) -> str | None:
    """Why this node cannot run its ranks, one per GPU: otherwise the extra ones fail in set_device with no word of why."""
    if accelerator != "cuda" or gpus is None or ranks <= gpus:
        return None
    return (
        f"{host} has {gpus} GPU(s) but {ranks} ranks are assigned to it (one rank per GPU): give it slots={gpus} in the hostfile, "
        f"ranks: {gpus} in hardware.nodes, or as many SLURM tasks per node as GPUs"
    )


def shared_problem(run_dir: Path, token: str, host: str) -> str | None:
    """Why this node cannot use the run directory, or None: it must hold the token the launcher just wrote.

    A node-local disk at the same path holds no token (or an older one): the ranks here would
    read no prepared data and write their checkpoint shards where the other nodes never look.
    """
    path = run_dir / TOKEN_FILE
    try:
        found = path.read_text().strip()
    except OSError:
        found = None
    if found == token:
        return None
    what = "does not exist" if not run_dir.is_dir() else ("holds no launch token" if found is None else "holds another launch's token")
    return (
        f"{run_dir} on {host} {what}: run.output_dir is not shared with the launching node. Every node reads the prepared data "
        f"from the run directory and writes its ranks' checkpoint shards into it: put run.output_dir on a filesystem every node "
        f"mounts at the same path (NFS, a cluster filesystem)"
    )


class Agent:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.host = socket.gethostname()
        self.lock = threading.Lock()
        self.commands: queue.Queue[str] = queue.Queue()
        self.last_heard = time.monotonic()
        self.supervisor = None

    def emit(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "node_rank": self.args.node_rank, **fields})
        with self.lock:
            try:
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
            except (BrokenPipeError, OSError):
                self.commands.put("eof")  # nobody reads us any more: the launcher is gone

    def listen(self) -> None:
        """Read commands from the launcher; EOF means the launcher or the connection is gone."""
        for line in sys.stdin:
            self.last_heard = time.monotonic()
            command = line.strip()
            if command.startswith("stop") and self.supervisor is not None and command.split()[1:2] == ["0"]:
                self.supervisor.hurry = True
            if command and command != "ping":
                self.commands.put(command)
        self.commands.put("eof")

    def next_command(self, timeout: float) -> str | None:
        try:
            return self.commands.get(timeout=timeout)
        except queue.Empty:
            if time.monotonic() - self.last_heard > HEARTBEAT_TIMEOUT:
                return "silent"
            return None

    def hello(self) -> dict:
        args = self.args
        problem = None if args.probe else shared_problem(Path(args.run_dir), args.token, self.host)
        gpus = visible_gpu_count()
        if problem is None and not args.probe:
            problem = too_few_gpus(args.accelerator, args.ranks, gpus, self.host)
        memory = psutil.virtual_memory()
        return dict(
            host=self.host,
            pid=os.getpid(),
            versions=versions(),
            interfaces=network_interfaces(),
            host_ram_total_bytes=memory.total,
            host_ram_used_bytes=memory.used,
            cpus=os.cpu_count(),
            gpus=gpus,
            problem=problem,
        )

    def run(self) -> int:
        args = self.args
        # A signal to the agent itself (a scheduler, sshd closing the session) stops the ranks promptly.
        # Not SIG_IGN: an ignored signal stays ignored in the ranks it starts.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self.terminated)
        self.emit("hello", **self.hello())
        if args.probe:
            return 0
        threading.Thread(target=self.listen, name="zeropipe-node-commands", daemon=True).start()
        while True:
            command = self.next_command(0.5)
            if command == "start":
                break
            if command is not None:
                self.emit("done", state="stopped", why=command)
                return 0
        from zeropipe.launch.supervisor import Supervisor
        from zeropipe.rundir import RunDir

        self.supervisor = supervisor = Supervisor(
            RunDir(args.run_dir), args.world_size, args.accelerator, args.master_port,
            first_rank=args.first_rank, local_ranks=args.ranks, master_addr=args.master_addr, node_rank=args.node_rank,
        )
        try:
            supervisor.spawn_ranks({"ZEROPIPE_RUN_OWNER_PID": str(args.owner_pid)})
        except BaseException as err:  # noqa: BLE001 - said to the launcher, then every started rank is stopped
            self.emit("agent_error", message=f"{type(err).__name__}: {err}")
            supervisor.hurry = True
            supervisor.stop_all()
            self.emit("done", state="failed")
            return 1
        self.emit("started", pids=[p.pid for p in supervisor.procs])
        return self.watch()

    def watch(self) -> int:
        supervisor = self.supervisor
        reported: set[int] = set()
        last_memory = float("-inf")
        while True:
            supervisor.sample_memory()
            if time.monotonic() - last_memory >= MEMORY_SECONDS:
                last_memory = time.monotonic()
                self.emit(
                    "memory",
                    host_ram_used_bytes=psutil.virtual_memory().used,
                    host_ram_peak_bytes=supervisor.host_ram_peak,
                    rank_rss_peak_bytes=supervisor.rank_rss_peak,
                )
            self.report_exits(reported)
            if len(reported) == len(supervisor.procs):
                self.emit("done", state="completed", host_ram_peak_bytes=supervisor.host_ram_peak, rank_rss_peak_bytes=supervisor.rank_rss_peak)
                return 0
            command = self.next_command(0.2)
            if command is None:
                continue
            # "stop GRACE" from the launcher; "eof"/"silent": the launcher or the connection is gone.
            if command in ("eof", "silent", "terminated"):
                supervisor.hurry = True
            else:
                parts = command.split()
                if parts[0] != "stop":
                    continue
                grace = float(parts[1]) if len(parts) > 1 else 10.0
                hurry = threading.Timer(grace, lambda: setattr(supervisor, "hurry", True))
                hurry.daemon = True  # the agent exits once its ranks are gone, not when the timer would fire
                hurry.start()
            supervisor.stop_all()
            self.report_exits(reported, stopped=True)
            self.emit("done", state="stopped", why=command, host_ram_peak_bytes=supervisor.host_ram_peak, rank_rss_peak_bytes=supervisor.rank_rss_peak)
            return 0

    def report_exits(self, reported: set[int], stopped: bool = False) -> None:
        from zeropipe.launch.supervisor import tail

        run = self.supervisor.run
        for local_rank, proc in enumerate(self.supervisor.procs):
            rank = self.supervisor.ranks[local_rank]
            if rank in reported or proc.poll() is None:
                continue
            reported.add(rank)
            self.emit(
                "exit",
                rank=rank,
                returncode=proc.returncode,
                pid=proc.pid,
                stopped=stopped,
                log_tail=tail(run.rank_log(rank)) if proc.returncode != 0 else [],
                error=run.read_json(run.rank_error(rank)),
            )

    def terminated(self, signum, frame) -> None:
        # SIGTERM/SIGHUP to the agent (a scheduler, sshd closing the session): stop the ranks promptly.
        self.commands.put("terminated")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zeropipe.launch.node", description="ZeRO-Pipe node agent (started by the launcher)")
    parser.add_argument("run_dir")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--first-rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1, help="ranks on this node")
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=29500)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--owner-pid", type=int, default=0, help="the launcher's pid (the run directory's owner)")
    parser.add_argument("--token", default="", help="what RUN_DIR/nodes/token must hold (the run directory is shared)")
    parser.add_argument("--probe", action="store_true", help="only say hello (host, versions, interfaces) and exit: zeropipe check")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return Agent(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
