"""Which machines a run uses and how many ranks each runs: hardware.nodes, a hostfile, or SLURM.

Pure functions over the config and an environment mapping (``os.environ`` by default), so
the SLURM reading is tested with a described environment. The hostfile is DeepSpeed's own
format, read by DeepSpeed's own parser (``HOST slots=N`` lines, ``#`` comments).

Rank numbering is the one torchrun and DeepSpeed use: node k runs the global ranks that
follow those of nodes 0..k-1, so rank 0 (which hosts the TCPStore of the rendezvous) runs on
the first node, the one MASTER_ADDR names.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from zeropipe.errors import ConfigError

# Names that mean "the machine this launcher runs on": started without SSH. Every other
# name goes through SSH, even one that resolves to an address of this machine (that is how
# the tests use 127.0.0.2 as a second host).
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Node:
    host: str
    ranks: int


@dataclass
class NodeLayout:
    """The machines of a run, in rank order, and how the launcher reaches them."""

    nodes: list[Node]
    master_addr: str
    launcher: str  # "ssh" or "slurm": how nodes other than this one are started
    source: str  # where the list came from, in words ("hardware.nodes", "hostfile H", "SLURM job 12")
    ssh_port: int | None = None
    ssh_options: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return sum(node.ranks for node in self.nodes)

    def first_rank(self, node_rank: int) -> int:
        return sum(node.ranks for node in self.nodes[:node_rank])

    def ranks_of(self, node_rank: int) -> list[int]:
        first = self.first_rank(node_rank)
        return list(range(first, first + self.nodes[node_rank].ranks))

    def node_of_rank(self, rank: int) -> int:
        for node_rank in range(len(self.nodes)):
            if rank in self.ranks_of(node_rank):
                return node_rank
        raise ValueError(f"rank {rank} is outside the {self.world_size} ranks of this layout")

    def to_dict(self) -> dict:
        return asdict(self)


def is_this_machine(host: str) -> bool:
    return host in LOCAL_NAMES or host in (socket.gethostname(), socket.getfqdn())


def parse_hostfile_text(text: str, where: str) -> list[Node]:
    """DeepSpeed's hostfile format, read by DeepSpeed's parser.

    Raises:
        ConfigError: a line that is not ``HOST slots=N``, a host twice, or no host.
    """
    # The private parser is DeepSpeed's definition of the format; its public wrapper only
    # adds reading the file and a warning when it is missing.
    from deepspeed.launcher.runner import _parse_hostfile

    try:
        pool = _parse_hostfile(text.splitlines())
    except ValueError as err:
        raise ConfigError([("hardware.hostfile", f"{where}: {err}; each line must read 'HOST slots=N' (DeepSpeed's hostfile format)")]) from None
    nodes = [Node(host, slots) for host, slots in pool.items()]
    for node in nodes:
        if node.ranks < 1:
            raise ConfigError([("hardware.hostfile", f"{where}: {node.host} has slots={node.ranks}; every host needs at least 1 slot (or remove the line)")])
    return nodes


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """``node[01-03,07],gpu-a1`` -> node01 node02 node03 node07 gpu-a1, in SLURM's order.

    ``scontrol show hostnames`` does this where SLURM is installed (see :func:`slurm_hostnames`);
    this parser covers the login-less case (a copied environment, a container without the
    SLURM client). Zero padding is kept; several bracket groups multiply (rack[1-2]-n[1-2]).

    Raises:
        ConfigError: unbalanced brackets or a range that is not numbers.
    """
    hosts: list[str] = []
    for item in split_top_level(nodelist):
        hosts += expand_item(item, nodelist)
    return hosts


def split_top_level(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def expand_item(item: str, whole: str) -> list[str]:
    match = re.match(r"^([^\[\]]*)\[([^\[\]]*)\](.*)$", item)
    if not match:
        if "[" in item or "]" in item:
            raise ConfigError([("SLURM_JOB_NODELIST", f"{whole!r}: unbalanced brackets in {item!r}")])
        return [item]
    prefix, ranges, rest = match.groups()
    expanded = []
    for part in ranges.split(","):
        bounds = part.split("-")
        if len(bounds) > 2 or not all(b.isdigit() for b in bounds):
            raise ConfigError([("SLURM_JOB_NODELIST", f"{whole!r}: {part!r} is not a number or a range N-M")])
        low, high = bounds[0], bounds[-1]
        width = len(low)
        for number in range(int(low), int(high) + 1):
            expanded.append(f"{prefix}{number:0{width}d}")
    return [head + tail for head in expanded for tail in expand_item(rest, whole)] if rest else expanded


def slurm_hostnames(nodelist: str) -> list[str]:
    """The allocation's host names: ``scontrol show hostnames`` when installed, else our parser."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20, check=True).stdout
            hosts = out.split()
            if hosts:
                return hosts
        except (OSError, subprocess.SubprocessError):
            pass  # a broken SLURM client: the environment still says it
    return expand_slurm_nodelist(nodelist)


def expand_tasks_per_node(value: str, nodes: int) -> list[int]:
    """SLURM_TASKS_PER_NODE's compressed form: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ConfigError([("SLURM_TASKS_PER_NODE", f"{value!r}: cannot read {part!r} (expected N or N(xK))")])
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nodes:
        raise ConfigError([("SLURM_TASKS_PER_NODE", f"{value!r} describes {len(counts)} nodes but SLURM_JOB_NODELIST has {nodes}")])
    return counts


def in_slurm_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID") and env.get("SLURM_JOB_NODELIST"))


def slurm_layout(env: Mapping[str, str], gpus: int | str, hostnames=slurm_hostnames) -> NodeLayout:
    """The nodes of the SLURM allocation this command runs in, with their rank counts.

    Ranks per node: hardware.gpus when set, else the tasks per node the job asked for
    (SLURM_NTASKS_PER_NODE; SLURM_TASKS_PER_NODE when --ntasks was given), else the GPUs per
    node (SLURM_GPUS_ON_NODE), else SLURM_TASKS_PER_NODE. sbatch always sets
    SLURM_TASKS_PER_NODE, to one task per node when no task count was asked for: read first, it
    would start one rank per node of ``--nodes=2 --gpus-per-node=4``.

    Raises:
        ConfigError: the command runs as one of several tasks of a step (each would start
            the whole run), or the rank count cannot be read.
    """
    in_step = env.get("SLURM_STEP_ID") not in (None, "", "batch", "4294967294")  # the batch script is step "batch" (id 0xfffffffe)
    step_tasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or "1"
    if in_step and step_tasks.isdigit() and int(step_tasks) > 1:
        raise ConfigError(
            [
                (
                    "SLURM",
                    f"zeropipe train runs as one of {step_tasks} tasks of SLURM step {env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}: "
                    "every task would start the whole run. Run it once, in the sbatch script (not under srun -n N): it starts one rank per "
                    "task of the allocation itself",
                )
            ]
        )
    hosts = hostnames(env["SLURM_JOB_NODELIST"])
    if gpus != "auto":
        counts = [int(gpus)] * len(hosts)
        why = "hardware.gpus"
    elif env.get("SLURM_NTASKS_PER_NODE"):
        counts = [int(env["SLURM_NTASKS_PER_NODE"])] * len(hosts)
        why = "SLURM_NTASKS_PER_NODE"
    elif env.get("SLURM_TASKS_PER_NODE") and (env.get("SLURM_NTASKS") or not env.get("SLURM_GPUS_ON_NODE")):
        # SLURM_NTASKS is set only when the job asked for a task count (--ntasks).
        counts = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"], len(hosts))
        why = "SLURM_TASKS_PER_NODE"
    elif env.get("SLURM_GPUS_ON_NODE"):
        counts = [int(env["SLURM_GPUS_ON_NODE"])] * len(hosts)
        why = "SLURM_GPUS_ON_NODE (no task count asked for: one rank per GPU)"
    else:
        raise ConfigError([("hardware.gpus", "inside a SLURM allocation without tasks or GPUs per node: set hardware.gpus (ranks per node) or sbatch --ntasks-per-node")])
    node_id = env.get("SLURM_NODEID")
    if node_id not in (None, "", "0"):
        raise ConfigError([("SLURM", f"zeropipe train runs on node {node_id} of the allocation; run it on the first node ({hosts[0]}), as an sbatch script does")])
    job = env.get("SLURM_JOB_ID")
    layout = NodeLayout([Node(h, c) for h, c in zip(hosts, counts)], hosts[0], "slurm", f"SLURM job {job}")
    layout.notes.append(f"SLURM job {job}: {len(hosts)} node(s) ({', '.join(hosts)}), ranks per node from {why}: {counts}")
    return layout


def resolve_layout(hardware, gpus_per_node: int, env: Mapping[str, str] | None = None, hostnames=slurm_hostnames) -> NodeLayout | None:
    """The run's nodes, or None for a run on this machine only.

    Args:
        hardware: the config's hardware section.
        gpus_per_node: the ranks each node of hardware.nodes runs (hardware.gpus resolved here).
        env: the environment to read SLURM's variables from (os.environ by default).

    Raises:
        ConfigError: with the key and the fix.
    """
    env = os.environ if env is None else env
    if hardware.nodes and hardware.hostfile:
        raise ConfigError([("hardware.hostfile", "set hardware.nodes or hardware.hostfile, not both: they name the same machines")])
    if hardware.nodes:
        if len(set(hardware.nodes)) != len(hardware.nodes):
            raise ConfigError([("hardware.nodes", f"{hardware.nodes} names a host twice: list each machine once (hardware.gpus ranks run on each)")])
        nodes = [Node(host, gpus_per_node) for host in hardware.nodes]
        source, launcher = "hardware.nodes", "slurm" if hardware.launcher == "slurm" else "ssh"
    elif hardware.hostfile:
        path = os.path.expanduser(hardware.hostfile)
        try:
            text = open(path).read()
        except OSError as err:
            raise ConfigError([("hardware.hostfile", f"cannot read {path}: {err.strerror or err}")]) from None
        nodes = parse_hostfile_text(text, path)
        source, launcher = f"hostfile {path}", "slurm" if hardware.launcher == "slurm" else "ssh"
    elif hardware.launcher != "ssh" and in_slurm_allocation(env):
        layout = slurm_layout(env, hardware.gpus, hostnames)
        if hardware.master_addr:
            layout.master_addr = hardware.master_addr
        return layout
    else:
        if hardware.launcher == "slurm":
            raise ConfigError([("hardware.launcher", "slurm was asked for but this command does not run inside a SLURM allocation (no SLURM_JOB_ID): run it in an sbatch script or salloc")])
        return None
    return NodeLayout(nodes, hardware.master_addr or nodes[0].host, launcher, source, hardware.ssh_port, hardware.ssh_options)
