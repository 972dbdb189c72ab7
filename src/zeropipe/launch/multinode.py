"""The launcher of a multi-node run: start one node agent per node, watch them all, stop them all.

Each node runs ``python -m zeropipe.launch.node`` (this machine directly, the others over
OpenSSH or ``srun``), which runs that node's ranks with the single-node
:class:`~zeropipe.launch.supervisor.Supervisor` machinery. The ranks rendezvous through
torch.distributed's env:// (MASTER_ADDR/MASTER_PORT of the first node, RANK, WORLD_SIZE,
LOCAL_RANK, NODE_RANK), exactly as under torchrun.

What reaches the node the user watches: the run directory is shared by every node (checked:
each agent must find the token this launcher writes into it before any rank starts), so
metrics.jsonl (rank 0, on the first node), every rank's log and error record, and the
checkpoints (every rank writes its own shards) are all on it. The agents' JSON lines over
SSH's stdout carry what only a node knows: its versions, its host RAM and each rank's exit
(signal, code, log tail). The launcher writes them into status.json (``nodes``).

Why one ``ssh`` per node and not pdsh, as DeepSpeed's runner does: the agent's stdin is its
lifeline and its stop button. pdsh forwards no stdin (a remote ``cat`` under pdsh 2.34 gets
neither data nor EOF), so a remote node could neither be told to stop nor notice that the
launcher is gone; with one ssh per node, killing the ssh client or losing the connection
gives the remote agent EOF within milliseconds, and the launcher sees the node's stream end.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import psutil

from zeropipe.errors import LaunchError
from zeropipe.launch import oom
from zeropipe.launch.diagnose import Diagnosis, RankExit, choose_primary, diagnose
from zeropipe.launch.node import TOKEN_FILE, versions
from zeropipe.launch.nodes import NodeLayout, check_host, is_this_machine, ssh_arguments
from zeropipe.launch.supervisor import Outcome, Supervisor, disk_free, reserve_port, run_settings, signal_group, tail
from zeropipe.rundir import RunDir

HELLO_SECONDS = 60.0  # an agent that has not said hello by then is unreachable
PING_SECONDS = 1.0
POLL_SECONDS = 0.2
FAILURE_GRACE_SECONDS = 3.0  # after a failure the others have nothing to save: they are stopped quickly
STOP_GRACE_SECONDS = 10.0
STATUS_SECONDS = 2.0
# Forwarded to the other nodes, as DeepSpeed's runner forwards its EXPORT_ENVS prefixes.
EXPORTED_PREFIXES = ("PYTHON", "DS_", "NCCL_", "GLOO_", "ZEROPIPE_PLUGINS", "HF_", "TRANSFORMERS_", "TORCH", "OMP_", "MKL_", "CUDA_HOME", "UCX_")
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]


def exported_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    return {key: value for key, value in env.items() if key.startswith(EXPORTED_PREFIXES)}


def ssh_command(layout: NodeLayout, host: str, remote: list[str]) -> list[str]:
    """``ssh HOST 'cd CWD && env K=V ... python -u -m zeropipe.launch.node ...'`` (the same Python path on every node, as DeepSpeed assumes)."""
    command = ["ssh", *SSH_OPTIONS]
    if layout.ssh_port:
        command += ["-p", str(layout.ssh_port)]
    # Only the allow-listed options pass (never ProxyCommand, LocalCommand, -F, -J...), and the
    # host comes after "--", so that even a host name that slipped through is never an option.
    command += ssh_arguments(layout.ssh_options)
    check_host(host, "hardware.nodes")
    exports = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(exported_environment().items()))
    script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec env {exports} {' '.join(shlex.quote(part) for part in remote)}"
    return command + ["--", host, script]


def srun_command(host: str, remote: list[str]) -> list[str]:
    """One srun step per node of the allocation (stdin and stdout carried like SSH's), sharing the allocation's CPUs."""
    return ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--kill-on-bad-exit=1", "--export=ALL", *remote]


def node_label(node_rank: int, host: str) -> str:
    return f"node {node_rank} ({host})"


@dataclass
class Connection:
    """One node agent, as the launcher sees it."""

    node_rank: int
    host: str
    ranks: list[int]
    proc: subprocess.Popen
    transport: str  # "local", "ssh" or "srun"
    hello: dict | None = None
    done: dict | None = None
    ended_at: float | None = None  # its stream ended
    stray: deque = field(default_factory=lambda: deque(maxlen=20))  # lines that were not events (ssh's own errors)
    host_ram_peak_bytes: int = 0
    host_ram_used_bytes: int = 0
    rank_rss_peak_bytes: list[int] = field(default_factory=list)

    @property
    def label(self) -> str:
        return node_label(self.node_rank, self.host)

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass  # its stream's end says it better

    def lost_how(self) -> str:
        """Why the stream ended without the agent saying done: the transport's exit, in words."""
        try:
            code = self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            code = None
        said = "; ".join(line for line in self.stray if line)[-300:]
        if self.transport == "local":
            if code is not None and code < 0:
                return f"its node agent (pid {self.proc.pid}) was killed by {signal.Signals(-code).name}"
            return f"its node agent (pid {self.proc.pid}) exited with code {code}" + (f": {said}" if said else "")
        tool = "ssh" if self.transport == "ssh" else "srun"
        if code is not None and code < 0:
            return f"the {tool} connection was cut: the {tool} client (pid {self.proc.pid}) was killed by {signal.Signals(-code).name}"
        if code == 255 and tool == "ssh":
            return "the SSH connection was lost or the remote node agent was killed (ssh exited with 255" + (f": {said})" if said else ")")
        return f"{tool} exited with code {code}" + (f": {said}" if said else "")

    def to_status(self) -> dict:
        hello = self.hello or {}
        return {
            "node_rank": self.node_rank,
            "host": self.host,
            "hostname": hello.get("host"),
            "transport": self.transport,
            "ranks": self.ranks,
            "host_ram_total_bytes": hello.get("host_ram_total_bytes"),
            "host_ram_used_bytes": self.host_ram_used_bytes or hello.get("host_ram_used_bytes"),
            "host_ram_peak_bytes": self.host_ram_peak_bytes,
            "rank_rss_peak_bytes": self.rank_rss_peak_bytes,
            "versions": hello.get("versions"),
            "pids": (self.done or {}).get("pids") or hello.get("rank_pids"),
        }


class MultiNodeSupervisor:
    """Start, watch and stop the node agents of one run; the same outcome as a single-node :class:`Supervisor`."""

    def __init__(self, run: RunDir, layout: NodeLayout, accelerator: str, master_port: int | None = None, on_tick: Callable[[], None] | None = None):
        self.run = run
        self.layout = layout
        self.accelerator = accelerator
        self.world_size = layout.world_size
        # The port held for the run's life when zeropipe picks it (hardware.master_port unset): see reserve_port.
        self.port, self.port_reservation = (master_port, None) if master_port else reserve_port()
        self.on_tick = on_tick
        self.events: queue.Queue[tuple[int, dict]] = queue.Queue()
        self.connections: list[Connection] = []
        self.status_error: str | None = None
        self.interrupted = False
        self.oom_kills_at_start = oom.cgroup_oom_kills()
        self.stopping_events: list[tuple[int, dict]] = []
        self.setup: Supervisor | None = None

    # ------------------------------------------------------------------ start
    def agent_command(self, node_rank: int, token: str) -> list[str]:
        node = self.layout.nodes[node_rank]
        return [
            sys.executable, "-u", "-m", "zeropipe.launch.node", str(self.run.path.resolve()),
            "--node-rank", str(node_rank), "--first-rank", str(self.layout.first_rank(node_rank)), "--ranks", str(node.ranks),
            "--world-size", str(self.world_size), "--master-addr", self.layout.master_addr, "--master-port", str(self.port),
            "--accelerator", self.accelerator, "--owner-pid", str(os.getpid()), "--token", token,
        ]

    def connect(self, node_rank: int, token: str) -> Connection:
        node = self.layout.nodes[node_rank]
        remote = self.agent_command(node_rank, token)
        if is_this_machine(node.host):
            command, transport = remote, "local"
        elif self.layout.launcher == "slurm":
            command, transport = srun_command(node.host, remote), "srun"
        else:
            if not shutil.which("ssh"):
                raise LaunchError(f"{node.host} is started over SSH but this machine has no ssh client: install OpenSSH's client (apt-get install openssh-client)")
            command, transport = ssh_command(self.layout, node.host, remote), "ssh"
        # Its own session: a terminal's Ctrl-C reaches only the launcher, which then stops every node in order.
        proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        connection = Connection(node_rank, node.host, self.layout.ranks_of(node_rank), proc, transport)
        threading.Thread(target=self.read, args=(connection,), name=f"zeropipe-node-{node_rank}", daemon=True).start()
        return connection

    def read(self, connection: Connection) -> None:
        for line in connection.proc.stdout:
            line = line.rstrip("\n")
            try:
                event = json.loads(line) if line.startswith("{") else None
            except json.JSONDecodeError:
                event = None
            if isinstance(event, dict) and "event" in event:
                self.events.put((connection.node_rank, event))
            elif line.strip():
                connection.stray.append(line.strip())
        self.events.put((connection.node_rank, {"event": "eof"}))

    def start(self) -> None:
        """Start every node's agent, check what they report, then let them start their ranks.

        A run that fills its caches first starts only that setup process here, on this node, and
        wait() starts the agents once it has finished (no rank anywhere holds an encoder).

        Raises:
            LaunchError: a node is unreachable, does not share the run directory, or runs other
                versions of torch/DeepSpeed/transformers/ZeRO-Pipe; no rank has started anywhere.
        """
        self.run.require_owner()
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("MultiNodeSupervisor.start must run in the main thread")
        # A run that must fill its caches first (RunPlan.node_setup) fills them once, here, with one
        # copy of each encoder, into the shared run directory; wait() starts the node agents after.
        if self.run.read_plan_fields().get("node_setup"):
            self.setup = Supervisor(self.run, self.world_size, self.accelerator, self.port, on_tick=self.on_tick, setup_only=True)
            self.setup.start()
            return
        self.start_agents()

    def start_agents(self) -> None:
        self.previous_handlers = {sig: signal.signal(sig, self.interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            token = secrets.token_hex(16)
            token_path = self.run.path / TOKEN_FILE
            token_path.parent.mkdir(exist_ok=True)
            token_path.write_text(token + "\n")
            for node_rank in range(len(self.layout.nodes)):
                self.connections.append(self.connect(node_rank, token))
            self.await_hellos()
            problems = self.hello_problems()
            if problems:
                raise LaunchError("the run cannot start on these nodes (no rank was started):\n  " + "\n  ".join(problems))
            for connection in self.connections:
                connection.send("start")
        except BaseException as err:
            self.stop_all(0)
            self.record(state="stopped" if isinstance(err, KeyboardInterrupt) else "failed", ended_at=time.time(),
                        diagnosis={"text": str(err), "cause": str(err), "fix": ""} if isinstance(err, LaunchError) else None)
            self.restore_handlers()
            raise
        self.record(state="running", pids=[c.proc.pid for c in self.connections], supervisor_pid=os.getpid(), started_at=time.time(),
                    diagnosis=None, nodes=self.node_status())

    def await_hellos(self) -> None:
        deadline = time.monotonic() + HELLO_SECONDS
        while any(c.hello is None and c.ended_at is None for c in self.connections) and time.monotonic() < deadline:
            self.drain(timeout=0.2)
        for connection in self.connections:
            connection.send("ping")

    def hello_problems(self) -> list[str]:
        """Everything that stops the run before any rank starts, one line per node and problem."""
        problems = []
        here = versions()
        for c in self.connections:
            if c.hello is None:
                how = c.lost_how() if c.ended_at is not None else f"no answer within {HELLO_SECONDS:.0f} s"
                fix = f"check `ssh {c.host} true` works without a password prompt" if c.transport == "ssh" else "check the node is up"
                problems.append(f"{c.label} is unreachable: {how}; {fix}")
                continue
            if c.ended_at is not None:
                problems.append(f"{c.label} ended before its ranks could start: {c.lost_how()}")
                continue
            if c.hello.get("problem"):
                problems.append(f"{c.label}: {c.hello['problem']}")
            theirs = c.hello.get("versions") or {}
            differing = [f"{name} {theirs.get(name)} (this node: {here[name]})" for name in here if theirs.get(name) != here[name]]
            if differing:
                problems.append(f"{c.label} runs {', '.join(differing)}: install the same versions on every node (a mismatch fails inside collectives)")
        return problems

    # ------------------------------------------------------------------ watch
    def drain(self, timeout: float) -> list[tuple[int, dict]]:
        """Apply the events that arrived (hello, memory, done, eof); return the rank exits and node losses among them."""
        got = []
        with contextlib.suppress(queue.Empty):  # nothing (more) arrived
            item = self.events.get(timeout=timeout)
            while True:
                got.append(item)
                item = self.events.get_nowait()
        important = []
        for node_rank, event in got:
            connection = self.connections[node_rank]
            kind = event["event"]
            if kind == "hello":
                connection.hello = event
            elif kind == "started":
                connection.hello = (connection.hello or {}) | {"rank_pids": event.get("pids")}
            elif kind == "memory":
                connection.host_ram_used_bytes = event.get("host_ram_used_bytes", 0)
                connection.host_ram_peak_bytes = max(connection.host_ram_peak_bytes, event.get("host_ram_peak_bytes", 0))
                connection.rank_rss_peak_bytes = event.get("rank_rss_peak_bytes") or connection.rank_rss_peak_bytes
            elif kind == "done":
                connection.done = event
                connection.host_ram_peak_bytes = max(connection.host_ram_peak_bytes, event.get("host_ram_peak_bytes") or 0)
                connection.rank_rss_peak_bytes = event.get("rank_rss_peak_bytes") or connection.rank_rss_peak_bytes
            elif kind == "eof":
                connection.ended_at = time.time()
                if connection.done is None:
                    important.append((node_rank, event))
            elif kind in ("exit", "agent_error"):
                important.append((node_rank, event | {"seen_at": time.time()}))
        return important

    def wait(self) -> Outcome:
        """Block until every rank on every node has finished, one has failed, a node was lost, or the user stopped the run."""
        if self.setup is not None:
            setup, self.setup = self.setup, None
            outcome = setup.wait()
            if outcome.state != "completed":
                return outcome
            self.start_agents()
        exits: dict[int, RankExit] = {}
        last_ping = last_status = time.monotonic()
        try:
            while True:
                for node_rank, event in self.drain(POLL_SECONDS):
                    self.note(exits, node_rank, event)
                for c in self.connections:
                    # A stream that ended without "done" while its end was being read elsewhere (at start-up).
                    if c.ended_at is not None and c.done is None and any(rank not in exits for rank in c.ranks):
                        self.note(exits, c.node_rank, {"event": "eof"})
                if any(e.returncode != 0 for e in exits.values()):
                    return self.fail(exits)
                if len(exits) == self.world_size and all(c.done for c in self.connections):
                    self.finish_transports()
                    self.record(state="completed", ended_at=time.time(), **self.memory_status())
                    return self.outcome("completed")
                now = time.monotonic()
                if now - last_ping >= PING_SECONDS:
                    last_ping = now
                    for connection in self.connections:
                        connection.send("ping")
                if now - last_status >= STATUS_SECONDS:
                    last_status = now
                    self.record(nodes=self.node_status())
                if self.on_tick:
                    self.on_tick()
        except KeyboardInterrupt:
            self.stop_all(STOP_GRACE_SECONDS)
            self.record(state="stopped", ended_at=time.time(), **self.memory_status())
            return self.outcome("stopped")
        except BaseException as err:
            self.stop_all(0)
            text = f"the launcher failed while watching the nodes ({type(err).__name__}: {err}); every rank on every node was stopped"
            self.record(state="failed", ended_at=time.time(), diagnosis={"text": text, "cause": f"{type(err).__name__}: {err}", "fix": "resume with --resume"}, **self.memory_status())
            raise
        finally:
            self.restore_handlers()

    def note(self, exits: dict[int, RankExit], node_rank: int, event: dict) -> None:
        """A rank's exit, or a node whose stream ended without saying done (every rank it had left is lost with it)."""
        connection = self.connections[node_rank]
        if event["event"] == "exit":
            rank = event["rank"]
            if rank in exits:
                return
            seen_at = event["seen_at"] + (60 if event.get("stopped") else 0)  # stopped by us: an effect by construction
            exits[rank] = RankExit(rank, event["returncode"], seen_at, event.get("log_tail") or [], event.get("error"), event.get("pid"), node=connection.label)
        elif event["event"] == "agent_error":
            for rank in connection.ranks:
                exits.setdefault(rank, self.lost_exit(connection, rank, f"its node agent could not start the ranks: {event.get('message')}", time.time()))
        else:  # eof without done
            how = connection.lost_how()
            for rank in connection.ranks:
                if rank not in exits:
                    exits[rank] = self.lost_exit(connection, rank, how, connection.ended_at or time.time())

    def lost_exit(self, connection: Connection, rank: int, how: str, seen_at: float) -> RankExit:
        return RankExit(rank, -signal.SIGKILL, seen_at, node=connection.label, lost=how)

    def fail(self, exits: dict[int, RankExit]) -> Outcome:
        # A moment for the other exits of the same event to arrive (a node's several ranks, the survivors' errors).
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            for node_rank, event in self.drain(0.1):
                self.note(exits, node_rank, event)
        first = min(e.seen_at for e in exits.values() if e.returncode != 0)
        self.stop_all(FAILURE_GRACE_SECONDS)
        for node_rank, event in self.stopping_events + self.drain(0):
            self.note(exits, node_rank, event)
        for connection in self.connections:
            for rank in connection.ranks:
                if rank not in exits:
                    exits[rank] = RankExit(rank, -signal.SIGKILL, first + 60, node=connection.label)
        ordered = [exits[rank] for rank in sorted(exits)]
        for e in ordered:
            if not e.log_tail and e.returncode != 0:
                e.log_tail = tail(self.run.rank_log(e.rank))  # the shared run directory has every rank's log

        primary = choose_primary(ordered)
        primary_node = self.connections[self.layout.node_of_rank(primary.rank)]
        total = (primary_node.hello or {}).get("host_ram_total_bytes") or psutil.virtual_memory().total
        killed_here = primary.signal_name == "SIGKILL" and primary_node.transport == "local" and not primary.lost
        diagnosis: Diagnosis = diagnose(
            ordered,
            primary_node.host_ram_peak_bytes,
            total,
            primary=primary,
            disk_free_bytes=disk_free(self.run.path),
            oom=oom.gather(self.oom_kills_at_start, total) if killed_here else None,
            settings=run_settings(self.run),
        )
        self.record(state="failed", ended_at=time.time(), diagnosis=diagnosis.to_dict(), **self.memory_status())
        return self.outcome("failed", diagnosis)

    # ------------------------------------------------------------------ stop
    def stop_all(self, grace: float) -> None:
        """Tell every agent to stop its ranks (SIGTERM, then SIGKILL after ``grace``), then end the transports.

        An agent that does not confirm within grace + 5 s is cut off: its ssh/srun/agent process is
        killed, which ends a remote agent's stdin, and it kills its ranks on its own.
        """
        for connection in self.connections:
            if connection.ended_at is None:
                connection.send(f"stop {grace:g}")
        deadline = time.monotonic() + grace + 5
        while time.monotonic() < deadline and any(c.done is None and c.ended_at is None for c in self.connections):
            try:
                self.stopping_events += self.drain(0.1)  # the stopped ranks' exits, for the diagnosis
            except KeyboardInterrupt:
                break  # a second Ctrl-C: cut them off now
        self.finish_transports(wait=2.0)

    def finish_transports(self, wait: float = 5.0) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError, ValueError):  # the connection already ended
                connection.proc.stdin.close()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.connections):
            time.sleep(0.05)
        for connection in self.connections:
            if connection.proc.poll() is None:
                signal_group(connection.proc.pid, signal.SIGKILL)
                connection.proc.wait()

    def interrupt(self, signum, frame) -> None:
        if self.interrupted:
            return
        self.interrupted = True
        raise KeyboardInterrupt

    def restore_handlers(self) -> None:
        for sig, handler in getattr(self, "previous_handlers", {}).items():
            signal.signal(sig, handler)

    # ------------------------------------------------------------------ status
    def node_status(self) -> list[dict]:
        return [c.to_status() for c in self.connections]

    def memory_status(self) -> dict:
        rank_rss = [0] * self.world_size
        for c in self.connections:
            for rank, rss in zip(c.ranks, c.rank_rss_peak_bytes):
                rank_rss[rank] = rss
        return {
            "host_ram_peak_bytes": max((c.host_ram_peak_bytes for c in self.connections), default=0),
            "rank_rss_peak_bytes": rank_rss,
            "nodes": self.node_status(),
        }

    def record(self, **fields) -> None:
        try:
            self.run.write_status(**fields)
        except OSError as err:
            self.status_error = f"could not record {fields.get('state', 'the state')!r} in {self.run.status_file}: {err.strerror or err}"

    def outcome(self, state: str, diagnosis: Diagnosis | None = None) -> Outcome:
        memory = self.memory_status()
        return Outcome(state, diagnosis, memory["host_ram_peak_bytes"], memory["rank_rss_peak_bytes"], self.status_error)


def probe_nodes(layout: NodeLayout, timeout: float = 30.0) -> list[dict]:
    """Ask every node's agent to say hello (host, versions, interfaces) without starting anything.

    Returns one dict per node: the agent's hello, or ``{"host": ..., "unreachable": why}``.
    The agents run over the same transport a launch would use, in parallel.
    """
    probes = []
    for node_rank, node in enumerate(layout.nodes):
        remote = [sys.executable, "-u", "-m", "zeropipe.launch.node", os.getcwd(), "--node-rank", str(node_rank), "--probe"]
        if is_this_machine(node.host):
            command = remote
        elif layout.launcher == "slurm":
            command = srun_command(node.host, remote)
        else:
            command = ssh_command(layout, node.host, remote)
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        except OSError as err:
            probes.append((node, None, str(err)))
            continue
        probes.append((node, proc, None))
    reports = []
    deadline = time.monotonic() + timeout
    for node, proc, error in probes:
        if proc is None:
            reports.append({"host": node.host, "unreachable": error})
            continue
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.communicate()
            reports.append({"host": node.host, "unreachable": f"no answer within {timeout:.0f} s"})
            continue
        hello = next((json.loads(line) for line in out.splitlines() if line.startswith('{"event": "hello"')), None)
        if hello is None:
            said = " ".join(line.strip() for line in (err or out).splitlines() if line.strip())[-300:]
            reports.append({"host": node.host, "unreachable": f"exit code {proc.returncode}" + (f": {said}" if said else "")})
        else:
            reports.append(hello | {"host": node.host, "hostname": hello.get("host")})
    return reports
