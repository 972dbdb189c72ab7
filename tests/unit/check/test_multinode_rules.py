"""The multi-node traps `zeropipe check` finds: interfaces, unreachable hosts, version drift, a taken port."""

from __future__ import annotations

import socket

import pytest
import yaml

from zeropipe.check.run import check_config
from zeropipe.config.load import validate_config
from zeropipe.launch.node import versions
from zeropipe.launch.resolve import resolve_run

TWO_NODES = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"synthetic": {"task": "arithmetic", "examples": 64}},
             "hardware": {"gpus": 1, "accelerator": "cpu", "nodes": ["127.0.0.1", "box2"]}}


def findings(raw: dict, reports: list[dict] | None = None) -> dict[str, list]:
    by_rule: dict[str, list] = {}
    for finding in check_config(resolve_run(validate_config(raw), fill_auto_knobs=False), node_reports=reports):
        by_rule.setdefault(finding.rule, []).append(finding)
    return by_rule


def report(host: str, **fields) -> dict:
    return {"host": host, "versions": versions(), "interfaces": ["eth0"]} | fields


def test_several_interfaces_without_a_chosen_one_is_warned(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    found = findings(TWO_NODES, [report("127.0.0.1"), report("box2", interfaces=["docker0", "eth0"])])
    (warning,) = found["ZP015"]
    assert warning.severity == "warning" and warning.key == "GLOO_SOCKET_IFNAME"
    assert "box2 has 2 network interfaces (docker0, eth0)" in warning.message
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert "ZP015" not in findings(TWO_NODES, [report("127.0.0.1"), report("box2", interfaces=["docker0", "eth0"])])


def test_the_nccl_variable_is_named_for_gpu_runs(monkeypatch):
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    from zeropipe.check.multinode import interface_unchosen
    from zeropipe.check.run import build_context

    context = build_context(resolve_run(validate_config(TWO_NODES), accelerator="cuda", fill_auto_knobs=False), node_reports=[report("box2", interfaces=["ib0", "eth0"])])
    assert context.accelerator == "cuda"
    ((key, message, fix),) = interface_unchosen(context)
    assert key == "NCCL_SOCKET_IFNAME" and "NCCL_SOCKET_IFNAME=ib0" in fix


def test_a_node_with_other_versions_is_an_error():
    theirs = versions() | {"torch": "2.0.1", "deepspeed": "0.14.0"}
    (error,) = findings(TWO_NODES, [report("127.0.0.1"), report("box2", versions=theirs)])["ZP017"]
    assert error.severity == "error"
    assert f"box2 runs torch 2.0.1 (this machine: {versions()['torch']}), deepspeed 0.14.0" in error.message
    assert "ZP017" not in findings(TWO_NODES, [report("127.0.0.1"), report("box2")])


def test_a_taken_master_port_is_an_error():
    with socket.socket() as listener:
        listener.bind(("", 0))
        listener.listen()
        port = listener.getsockname()[1]
        raw = TWO_NODES | {"hardware": TWO_NODES["hardware"] | {"master_port": port}}
        (error,) = findings(raw, [report("127.0.0.1"), report("box2")])["ZP018"]
        assert f"port {port} on this machine cannot be used" in error.message and error.key == "hardware.master_port"
    assert "ZP018" not in findings(raw, [report("127.0.0.1"), report("box2")])


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_zeropipe_check_asks_each_node_and_names_an_unreachable_host(tmp_path, capsys):
    # 127.0.0.3 on a port nobody listens on: ssh fails at once with "Connection refused";
    # 127.0.0.1 is this machine, whose agent answers without SSH.
    raw = TWO_NODES | {"hardware": TWO_NODES["hardware"] | {"nodes": ["127.0.0.1", "127.0.0.3"], "ssh_port": free_port()}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    # In-process: `zeropipe check` as the shell runs it, without a second interpreter's start-up.
    from zeropipe.cli.main import main

    assert main(["check", str(config), "--json"]) == 1
    import json

    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)["findings"]}
    assert "127.0.0.3 did not answer over ssh" in found["ZP016"]["message"]
    assert "Connection refused" in found["ZP016"]["message"]
    assert "ssh 127.0.0.3 true" in found["ZP016"]["fix"]
    assert "ZP017" not in found  # this machine's agent answered with this machine's versions
