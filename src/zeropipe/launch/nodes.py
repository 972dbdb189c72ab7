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
import shlex
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

# A host name as ssh, srun and DeepSpeed's hostfile take it (user@host, an IPv6 address): never
# starting with '-', which ssh would read as an option (`-oProxyCommand=...` as a "host").
HOST_NAME = re.compile(r"^[A-Za-z0-9_\[][A-Za-z0-9._:%@\[\]-]{0,252}$")

# hardware.ssh_options is split into words (shlex) and only these pass: options that choose the
# key, the user, the port and how patient or strict ssh is. Everything else is refused, above all
# what runs a command or reads a config on this machine (ProxyCommand, LocalCommand, KnownHostsCommand,
# ProxyJump/-J, -F, Match exec, Include, PKCS11Provider...), forwards ports or writes files (-E, -S).
SSH_FLAGS_WITH_VALUE = {"-i": "IdentityFile", "-l": "User", "-p": "Port"}
SSH_FLAGS_ALONE = {"-4", "-6", "-q", "-v", "-vv", "-vvv", "-C", "-T", "-x", "-a", "-k"}
SSH_OPTION_KEYS = {
    key.lower(): key
    for key in (
        "IdentityFile", "IdentitiesOnly", "User", "Port", "StrictHostKeyChecking", "UserKnownHostsFile", "GlobalKnownHostsFile",
        "HostKeyAlias", "CheckHostIP", "UpdateHostKeys", "HashKnownHosts", "ConnectTimeout", "ConnectionAttempts",
        "ServerAliveInterval", "ServerAliveCountMax", "TCPKeepAlive", "BatchMode", "Compression", "AddressFamily", "LogLevel",
        "PreferredAuthentications", "PubkeyAuthentication", "PasswordAuthentication", "KbdInteractiveAuthentication",
        "GSSAPIAuthentication", "Ciphers", "MACs", "KexAlgorithms", "HostKeyAlgorithms", "PubkeyAcceptedAlgorithms",
    )
}  # fmt: skip
SSH_VALUE = re.compile(r"^[A-Za-z0-9_./~:@%+,=-]{1,1024}$")  # no spaces, quotes, $, ;, |, backquotes or newlines
PATH_OPTIONS = {"IdentityFile", "UserKnownHostsFile", "GlobalKnownHostsFile"}
# From a config submitted through the UI (confined, even under --trust-multinode) no option may name
# a file ssh reads or writes (-i KEY reads any file; UserKnownHostsFile + HostKeyAlias + HashKnownHosts=no
# append chosen text to any writable file), nor set the host-key policy: keys and known hosts are the
# launcher's own (its ~/.ssh/config), not the submitter's.
CONFINED_REFUSED = {
    "IdentityFile", "UserKnownHostsFile", "GlobalKnownHostsFile", "HostKeyAlias", "StrictHostKeyChecking", "UpdateHostKeys",
    "HashKnownHosts", "CheckHostIP",
}  # fmt: skip


def ssh_option_problem(word: str) -> str:
    return (f"{word!r} is not an ssh option ZeRO-Pipe passes on: hardware.ssh_options takes -i KEY, -l USER, -p PORT, "
            f"{', '.join(sorted(SSH_FLAGS_ALONE))} and -o KEY=VALUE for {', '.join(sorted(SSH_OPTION_KEYS.values()))}; "
            "put anything else (ProxyJump, ProxyCommand...) in ~/.ssh/config on this machine, where you chose it")  # fmt: skip


def ssh_arguments(options: str, confined: bool = False) -> list[str]:
    """hardware.ssh_options as ssh's arguments, each checked against the allow-list (``~`` expanded in file names).

    Args:
        confined: the config came through the UI: also refuse every option that names a file or sets
            the host-key policy (``CONFINED_REFUSED``).

    Raises:
        ConfigError: a word that is not an allowed option or value (naming it and what is allowed).
    """
    try:
        words = shlex.split(options or "")
    except ValueError as err:
        raise ConfigError([("hardware.ssh_options", f"cannot be split into words ({err}): check its quotes")]) from None
    out: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        if word in SSH_FLAGS_ALONE:
            out.append(word)
            index += 1
            continue
        flag, value = word[:2], word[2:]
        if flag in SSH_FLAGS_WITH_VALUE or flag == "-o":
            if not value:
                if index + 1 >= len(words):
                    raise ConfigError([("hardware.ssh_options", f"{word} needs a value after it")])
                value = words[index + 1]
                index += 1
            index += 1
            if flag == "-o":
                key, _, setting = value.replace("=", " ", 1).partition(" ")
                key, setting = key.strip(), setting.strip()
            else:
                key, setting = SSH_FLAGS_WITH_VALUE[flag], value
            name = SSH_OPTION_KEYS.get(key.lower())
            if name is None:
                raise ConfigError([("hardware.ssh_options", ssh_option_problem(f"-o {key}" if flag == "-o" else word))])
            if confined and name in CONFINED_REFUSED:
                raise ConfigError([("hardware.ssh_options", (f"{name} names a file ssh reads or writes, or chooses how host keys are trusted: "
                                                             "a config submitted through the UI may not set it, even with --trust-multinode; "
                                                             "put it in ~/.ssh/config of the user who runs the UI"))])  # fmt: skip
            if not SSH_VALUE.match(setting) or setting.startswith("-"):
                raise ConfigError([("hardware.ssh_options", (f"{name}'s value {setting!r} is not allowed: a plain word, number or file name "
                                                             "(no spaces, quotes, $, ;, | or leading '-')"))])  # fmt: skip
            if name == "Port" and not (setting.isdigit() and 1 <= int(setting) <= 65535):
                raise ConfigError([("hardware.ssh_options", f"Port {setting!r} is not a port number (1-65535)")])
            if name in PATH_OPTIONS:
                setting = os.path.expanduser(setting)
            out += ["-o", f"{name}={setting}"]
            continue
        raise ConfigError([("hardware.ssh_options", ssh_option_problem(word))])
    return out


def hardware_problems(hardware: object, confined: bool = False) -> list[tuple[str, str]]:
    """The ssh options and host names of a hardware section (plain values), each problem with its key.

    What ``resolve_layout`` refuses, said when a config is validated (the UI's check and launch
    of a config naming other machines), before anything is resolved or started.
    """
    if not isinstance(hardware, dict):
        return []
    problems: list[tuple[str, str]] = []
    checks = [(lambda: ssh_arguments(hardware.get("ssh_options") or "", confined)) if isinstance(hardware.get("ssh_options") or "", str) else None]
    nodes = hardware.get("nodes")
    if isinstance(nodes, list):
        checks += [(lambda host=host, index=index: check_host(host, f"hardware.nodes[{index}]")) for index, host in enumerate(nodes)]
    if hardware.get("master_addr") is not None:
        checks.append(lambda: check_host(hardware["master_addr"], "hardware.master_addr"))
    for check in filter(None, checks):
        try:
            check()
        except ConfigError as err:
            problems += err.problems
    return problems


def check_host(host: object, key: str) -> str:
    """A host name that ssh, srun and the node agent take as a host and never as an option.

    Raises:
        ConfigError: naming ``key``: not a string, empty, starting with '-', or with spaces or shell characters.
    """
    if not isinstance(host, str) or not (HOST_NAME.match(host) or is_ipv6_address(host)):
        raise ConfigError([(key, (f"{str(host)[:100]!r} is not a host name: letters, digits, '.', '-', '_', ':', '@' and '[]', "
                                  "not starting with '-' (a name starting with '-' would be read as an ssh option)"))])  # fmt: skip
    return host


def is_ipv6_address(host: str) -> bool:
    """An IPv6 address written bare (``::1``, ``fe80::1%eth0``): it may start with ':', never with '-'."""
    import ipaddress

    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


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


# DeepSpeed's hostfile line (deepspeed.launcher.runner._parse_hostfile's pattern): HOST slots=N.
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")


def parse_hostfile_text(text: str, where: str) -> list[Node]:
    """DeepSpeed's hostfile format (``HOST slots=N`` lines, ``#`` comments), as its runner reads it.

    Read here rather than by DeepSpeed's ``_parse_hostfile``, which logs the whole file when a
    line is wrong: the file named may be anything (a hostfile: /etc/shadow), so an error names
    the file and the line number, never what the line holds.

    Raises:
        ConfigError: a line that is not ``HOST slots=N``, a host twice, or no host.
    """
    nodes: dict[str, Node] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = HOSTFILE_LINE.search(line)
        if not match:
            raise ConfigError([("hardware.hostfile", f"{where}: line {number} is not a hostfile line; each line must read 'HOST slots=N' (DeepSpeed's hostfile format)")])
        host, slots = match.group(1), int(match.group(2))
        if host in nodes:
            raise ConfigError([("hardware.hostfile", f"{where}: line {number} names a host of an earlier line again (multiple entries for one host): list each machine once")])
        if not HOST_NAME.match(host):
            raise ConfigError([("hardware.hostfile", (f"{where}: line {number} does not start with a host name (letters, digits, '.', '-', '_', ':', '@'; "
                                                      "not starting with '-', which ssh would read as an option)"))])  # fmt: skip
        if slots < 1:
            raise ConfigError([("hardware.hostfile", f"{where}: line {number} has slots={slots}; every host needs at least 1 slot (or remove the line)")])
        nodes[host] = Node(host, slots)
    if not nodes:
        raise ConfigError([("hardware.hostfile", f"{where} is empty or names no host: each line must read 'HOST slots=N' (DeepSpeed's hostfile format)")])
    return list(nodes.values())


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
        nodes = [Node(check_host(host, f"hardware.nodes[{index}]"), gpus_per_node) for index, host in enumerate(hardware.nodes)]
        source, launcher = "hardware.nodes", "slurm" if hardware.launcher == "slurm" else "ssh"
    elif hardware.hostfile:
        path = os.path.expanduser(hardware.hostfile)
        try:
            text = open(path).read()
        except OSError as err:
            raise ConfigError([("hardware.hostfile", f"cannot read {path}: {err.strerror or err}")]) from None
        except UnicodeDecodeError:
            raise ConfigError([("hardware.hostfile", f"{path} is not a text file: a hostfile has one 'HOST slots=N' line per machine")]) from None
        nodes = parse_hostfile_text(text, path)
        source, launcher = f"hostfile {path}", "slurm" if hardware.launcher == "slurm" else "ssh"
    elif hardware.launcher != "ssh" and in_slurm_allocation(env):
        layout = slurm_layout(env, hardware.gpus, hostnames)
        if hardware.master_addr:
            layout.master_addr = check_host(hardware.master_addr, "hardware.master_addr")
        return layout
    else:
        if hardware.launcher == "slurm":
            raise ConfigError([("hardware.launcher", "slurm was asked for but this command does not run inside a SLURM allocation (no SLURM_JOB_ID): run it in an sbatch script or salloc")])
        return None
    if hardware.master_addr:
        check_host(hardware.master_addr, "hardware.master_addr")
    ssh_arguments(hardware.ssh_options)  # refused now, with the key, rather than when ssh starts
    return NodeLayout(nodes, hardware.master_addr or nodes[0].host, launcher, source, hardware.ssh_port, hardware.ssh_options)
