"""A SLURM cluster on this one machine for the SLURM tests: Debian's slurmctld, two slurmd and munge.

Two slurmd daemons (nodes ``HOST`` and ``HOST-b``, both this machine, each on its own port)
make a two-node cluster; ``proctrack/linuxproc`` and ``task/none`` keep it away from cgroups.
Everything lives in a temporary directory with free ports; munged is started only when none
runs (and then stopped again).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "munge")
AVAILABLE = all(shutil.which(name) or os.path.exists(f"/usr/sbin/{name}") for name in DAEMONS) and os.geteuid() == 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


@dataclass
class Cluster:
    conf: Path
    nodes: list[str]
    procs: list[subprocess.Popen] = field(default_factory=list)
    munged_started: bool = False

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.munged_started:
            subprocess.run(["pkill", "-F", "/run/munge/munged.pid"], check=False)


def sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def ensure_munge() -> bool:
    """True when this call started munged."""
    if subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
        return False
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", sbin("munged")], check=True)
    return True


def start_cluster(directory: Path) -> Cluster:
    host = socket.gethostname()
    nodes = [host, f"{host}-b"]
    directory.mkdir(parents=True, exist_ok=True)
    ports = {"ctld": free_port(), nodes[0]: free_port(), nodes[1]: free_port()}
    conf = directory / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=zeropipe-test",
                f"SlurmctldHost={host}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"StateSaveLocation={directory}/state",
                f"SlurmdSpoolDir={directory}/spool-%n",
                f"SlurmctldPidFile={directory}/slurmctld.pid",
                f"SlurmdPidFile={directory}/slurmd-%n.pid",
                f"SlurmctldLogFile={directory}/slurmctld.log",
                f"SlurmdLogFile={directory}/slurmd-%n.log",
                f"SlurmctldPort={ports['ctld']}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "SchedulerType=sched/builtin",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_CPU",
                "ReturnToService=2",
                "MpiDefault=none",
                *(f"NodeName={node} NodeHostname={host} Port={ports[node]} CPUs=2 RealMemory=2000 State=UNKNOWN" for node in nodes),
                f"PartitionName=test Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4",
                "",
            ]
        )
    )
    (directory / "state").mkdir(exist_ok=True)
    cluster = Cluster(conf, nodes, munged_started=ensure_munge())
    try:
        cluster.procs.append(subprocess.Popen([sbin("slurmctld"), "-D", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)
        for node in nodes:
            cluster.procs.append(subprocess.Popen([sbin("slurmd"), "-D", "-f", str(conf), "-N", node], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + 30
        while time.time() < deadline:
            states = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, env=cluster.env).stdout.split()
            if states.count("idle") == len(nodes):
                return cluster
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster did not come up: sinfo says {states}; see {directory}/*.log")
    except BaseException:
        cluster.stop()
        raise
