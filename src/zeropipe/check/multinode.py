"""The traps of a multi-node run, checked before anything starts.

Unreachable hosts and versions that differ between nodes are found by asking each node's
agent to say hello (``zeropipe check`` does; ``zeropipe train`` learns the same from the
agents before any rank starts). The network-interface and port rules look at this machine.
"""

from __future__ import annotations

import errno
import socket

from zeropipe.check.rules import CheckContext, rule
from zeropipe.launch.node import network_interfaces, versions
from zeropipe.launch.nodes import is_this_machine

NCCL_ENV_DOCS = "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-socket-ifname"


def socket_variable(accelerator: str) -> str:
    """The variable that picks the interface of the collectives: NCCL's on GPUs, gloo's on CPU ranks."""
    return "NCCL_SOCKET_IFNAME" if accelerator == "cuda" else "GLOO_SOCKET_IFNAME"


@rule("ZP015", "warning", "several network interfaces and none chosen for the collectives", NCCL_ENV_DOCS)
def interface_unchosen(ctx: CheckContext):
    if ctx.nodes is None:
        return []
    import os

    variable = socket_variable(ctx.accelerator)
    if os.environ.get(variable):
        return []
    found = []
    reports = ctx.node_reports or [{"host": ctx.nodes.nodes[0].host, "interfaces": network_interfaces()}]
    for report in reports:
        interfaces = report.get("interfaces") or []
        if len(interfaces) > 1:
            found.append(
                (
                    variable,
                    f"{report['host']} has {len(interfaces)} network interfaces ({', '.join(interfaces)}) and {variable} is unset: "
                    "the collectives may pick one the other nodes cannot reach (a docker bridge, a second LAN) and hang until they time out",
                    f"export {variable}=<the interface on the nodes' shared network> (e.g. {variable}={interfaces[0]}) before zeropipe train; it is passed to every node",
                )
            )
    return found


@rule("ZP016", "error", "a node that cannot be reached", "docs/multinode.md#ssh")
def node_unreachable(ctx: CheckContext):
    how = "srun" if ctx.nodes is not None and ctx.nodes.launcher == "slurm" else "ssh"
    return [
        (
            "hardware.nodes" if ctx.config.hardware.nodes else "hardware.hostfile",
            f"{report['host']} did not answer over {how}: {report['unreachable']}",
            f"check that `ssh {report['host']} true` works without a password prompt (a key in ~/.ssh/authorized_keys there; "
            "hardware.ssh_port / ssh_options), and that the same Python and ZeRO-Pipe are installed at the same path there",
        )
        for report in ctx.node_reports or []
        if report.get("unreachable")
    ]


@rule("ZP017", "error", "torch, DeepSpeed or transformers versions differ between nodes", "docs/multinode.md")
def versions_differ(ctx: CheckContext):
    here = versions()
    found = []
    for report in ctx.node_reports or []:
        theirs = report.get("versions")
        if not theirs:
            continue
        differing = [f"{name} {theirs.get(name)} (this machine: {here[name]})" for name in here if theirs.get(name) != here[name]]
        if differing:
            found.append(
                (
                    "hardware.nodes",
                    f"{report['host']} runs {', '.join(differing)}: ranks with different versions fail inside the collectives",
                    "install the same versions on every node (the same scripts/setup.sh, or one shared environment)",
                )
            )
    return found


def port_taken(port: int) -> str | None:
    """Why the rendezvous port cannot be listened on here, or None when it is free."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError as err:
            return "another process listens on it" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
    return None


@rule("ZP018", "error", "the rendezvous port is taken", "https://pytorch.org/docs/stable/distributed.html#environment-variable-initialization")
def master_port_taken(ctx: CheckContext):
    port = ctx.config.hardware.master_port
    if port is None:
        return []
    master = ctx.nodes.master_addr if ctx.nodes is not None else "127.0.0.1"
    if not is_this_machine(master) and ctx.nodes is not None and master != ctx.nodes.nodes[0].host:
        return []
    if ctx.nodes is not None and not is_this_machine(ctx.nodes.nodes[0].host):
        return []  # rank 0 listens on another machine: only that machine can tell
    why = port_taken(port)
    if why is None:
        return []
    return [("hardware.master_port", f"port {port} on this machine cannot be used for the rendezvous: {why}", "choose another free port, or leave hardware.master_port unset (a free one is picked)")]
