"""Two nodes on this machine (127.0.0.1 directly, 127.0.0.2 through a real sshd), one CPU rank each.

The same tiny run as a single-node 2-rank run gives the same losses; a remote rank killed
with SIGKILL, or the SSH connection to the remote node cut (client or server side), brings
every rank down within 10 s and is named in the diagnosis, with no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

# A `train` that runs to its end (or is refused) is launched by this interpreter (conftest.zeropipe: a new launcher
# process costs 6-14 s of CI per command); the node agents and ranks are new processes, over ssh or not, either way.
# The tests that signal or kill the launcher start it as a new process (start_zeropipe).
from tests.integration.conftest import RESUME_STEPS, SAVE_EVERY, assert_ok, metrics, start_zeropipe, tiny_run_config, write_config, zeropipe
from tests.integration.sshd import SSHD, free_port_on_both, start_sshd

pytestmark = [pytest.mark.integration, pytest.mark.skipif(SSHD is None, reason="needs OpenSSH's server (apt-get install openssh-server; scripts/setup.sh installs it as root)")]

TEARDOWN_SECONDS = 10.0


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    # Both "nodes" share this machine's cores; forwarded to the remote node like every OMP_ variable.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def node_config(tmp_path: Path, sshd, name: str, max_steps: int = 6) -> dict:
    return tiny_run_config(
        tmp_path, name, train={"max_steps": max_steps, "log_every": 1, "save_every": 3}, deepspeed={"precision": "fp32"}, hardware=sshd.hardware()
    )


def processes_of(run_dir: Path) -> list[psutil.Process]:
    """Every rank and node agent of this run still alive, on either "node" (they share this machine)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if any(str(run_dir) in part for part in cmdline) and any(m in cmdline for m in ("zeropipe.launch.rank", "zeropipe.launch.node")):
            found.append(proc)
    return found


def wait_training(run_dir: Path, launcher, timeout: float = 240) -> dict:
    """status.json once both nodes' ranks run and a step is logged."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert launcher.poll() is None, launcher.stdout.read()
        status = json.loads((run_dir / "status.json").read_text()) if (run_dir / "status.json").exists() else {}
        nodes = status.get("nodes") or []
        if len(nodes) == 2 and all(node.get("pids") for node in nodes) and any(row.get("step", 0) >= 1 for row in metrics(run_dir)):
            return status
        time.sleep(0.3)
    raise AssertionError("the run did not start training in time")


def assert_all_gone_within(run_dir: Path, since: float) -> float:
    while processes_of(run_dir) and time.time() - since < TEARDOWN_SECONDS + 5:
        time.sleep(0.1)
    left = processes_of(run_dir)
    took = time.time() - since
    print(f"every rank and agent of {run_dir.name} gone {took:.2f} s after")
    assert not left, f"still alive {took:.1f} s later: {[p.cmdline() for p in left]}"
    assert took < TEARDOWN_SECONDS, f"ranks and agents took {took:.1f} s to go"
    return took


def test_two_nodes_over_ssh_train_like_one_node_with_two_ranks(tmp_path, sshd, uninterrupted):
    # The one-node run to match is the session's 2-rank ZeRO-2 fp32 reference (conftest.py): the
    # same model, data, seed and schedule, so these runs differ by the nodes alone.
    _, one_node = uninterrupted(2)
    config = node_config(tmp_path, sshd, "two-nodes", max_steps=RESUME_STEPS)
    config["train"].update(save_every=SAVE_EVERY, keep_last=10)
    two_nodes = write_config(tmp_path, config, "nodes.yaml")
    result = zeropipe("train", two_nodes)
    assert_ok(result)
    assert "2 nodes, world size 2: 127.0.0.1 ranks [0], 127.0.0.2 ranks [1]" in result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "two-nodes"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed"
    assert [(n["host"], n["transport"], n["ranks"]) for n in status["nodes"]] == [("127.0.0.1", "local", [0]), ("127.0.0.2", "ssh", [1])]
    assert all(n["host_ram_total_bytes"] > 0 and n["host_ram_peak_bytes"] > 0 for n in status["nodes"])
    # Every rank wrote its own shards into the shared run directory.
    checkpoint = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert len(list(checkpoint.rglob("zero_pp_rank_*_optim_states.pt"))) == 2
    losses = lambda run: [row["loss"] for row in metrics(run) if "loss" in row]
    assert len(losses(run_dir)) == RESUME_STEPS
    assert losses(run_dir) == pytest.approx(losses(one_node), rel=1e-5)
    assert not processes_of(run_dir)


def test_remote_rank_killed_brings_every_node_down_and_is_named(tmp_path, sshd):
    run_dir = tmp_path / "runs" / "kill-remote"
    launcher = start_zeropipe("train", write_config(tmp_path, node_config(tmp_path, sshd, "kill-remote", max_steps=400)))
    try:
        status = wait_training(run_dir, launcher)
        remote_rank_pid = status["nodes"][1]["pids"][0]
        killed_at = time.time()
        os.kill(remote_rank_pid, signal.SIGKILL)
        assert_all_gone_within(run_dir, killed_at)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, out
    assert "rank 1 on node 1 (127.0.0.2) was killed by SIGKILL" in out
    diagnosis = json.loads((run_dir / "status.json").read_text())["diagnosis"]
    assert (diagnosis["rank"], diagnosis["node"], diagnosis["how"]) == (1, "node 1 (127.0.0.2)", "was killed by SIGKILL")
    assert "rank 0 on node 0 (127.0.0.1)" in diagnosis["text"] and "effects, not causes" in diagnosis["text"]


def remote_agent(run_dir: Path) -> psutil.Process:
    (agent,) = [p for p in processes_of(run_dir) if "zeropipe.launch.node" in p.cmdline() and p.cmdline()[p.cmdline().index("--node-rank") + 1] == "1"]
    return agent


@pytest.mark.parametrize("side", ["client", "server", "agent"])
def test_lost_ssh_connection_stops_every_node(tmp_path, sshd, side):
    """The ssh client killed, sshd's processes for the connection killed, or the remote node agent killed with SIGKILL."""
    run_dir = tmp_path / "runs" / f"cut-{side}"
    launcher = start_zeropipe("train", write_config(tmp_path, node_config(tmp_path, sshd, f"cut-{side}", max_steps=400)))
    try:
        status = wait_training(run_dir, launcher)
        ssh_client = psutil.Process(status["pids"][1])
        assert ssh_client.name() == "ssh"
        # The client's own process, or sshd's processes serving this connection (children of the listener).
        victims = {
            "client": lambda: [ssh_client],
            "server": lambda: [p for p in psutil.Process(sshd.proc.pid).children(recursive=True) if p.name().startswith("sshd")],
            "agent": lambda: [remote_agent(run_dir)],
        }[side]()
        assert victims
        cut_at = time.time()
        for victim in victims:
            victim.kill()
        assert_all_gone_within(run_dir, cut_at)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 1, out
    assert "rank 1 on node 1 (127.0.0.2) was lost with its node" in out
    expected = {"client": "the ssh client", "server": "the SSH connection was lost", "agent": "the remote node agent was killed (ssh exited with 255"}[side]
    assert expected in out, out


def test_launcher_killed_with_sigkill_leaves_nothing_on_any_node(tmp_path, sshd):
    """Nobody stops anything: the agents' stdin ends with the launcher (the ssh client's too), and they end their ranks."""
    run_dir = tmp_path / "runs" / "launcher-killed"
    launcher = start_zeropipe("train", write_config(tmp_path, node_config(tmp_path, sshd, "launcher-killed", max_steps=400)))
    try:
        status = wait_training(run_dir, launcher)
        transports = [psutil.Process(pid) for pid in status["pids"]]
        killed_at = time.time()
        launcher.kill()
        assert_all_gone_within(run_dir, killed_at)
        psutil.wait_procs(transports, timeout=5)
        assert not [p for p in transports if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()
    from zeropipe.rundir import RunDir

    assert RunDir(run_dir).read_status()["state"] == "lost"


def test_stop_reaches_every_node(tmp_path, sshd):
    """SIGTERM to the launcher (the UI's Stop, a scheduler) stops the ranks of both nodes; the run ends "stopped"."""
    run_dir = tmp_path / "runs" / "stop"
    # The nodes from a DeepSpeed hostfile this time.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes on loopback\n127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    config = node_config(tmp_path, sshd, "stop", max_steps=400)
    del config["hardware"]["nodes"]
    config["hardware"]["hostfile"] = str(hostfile)
    launcher = start_zeropipe("train", write_config(tmp_path, config))
    try:
        wait_training(run_dir, launcher)
        stopped_at = time.time()
        launcher.send_signal(signal.SIGTERM)
        assert_all_gone_within(run_dir, stopped_at)
        out, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, out
    assert "stopped; all ranks ended" in out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "stopped" and len(status["nodes"]) == 2


def test_an_output_dir_the_remote_node_does_not_share_is_refused_before_any_rank_starts(tmp_path):
    """127.0.0.2 sees its own empty disk at run.output_dir (a tmpfs mounted there in a private mount namespace)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    node_local_disk = f"unshare -m sh -c 'mount -t tmpfs node-local-disk {runs} && eval \"$SSH_ORIGINAL_COMMAND\"'"
    server = start_sshd(tmp_path / "sshd", force_command=node_local_disk)
    try:
        result = zeropipe("train", write_config(tmp_path, tiny_run_config(tmp_path, "unshared", deepspeed={"precision": "fp32"}, hardware=server.hardware())), timeout=300)
    finally:
        server.stop()
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "node 1 (127.0.0.2):" in out and "run.output_dir is not shared with the launching node" in out, out
    assert "no rank was started" in out
    run_dir = runs / "unshared"
    assert not list((run_dir / "logs").glob("rank*.log"))
    assert json.loads((run_dir / "status.json").read_text())["state"] == "failed"
    assert not processes_of(run_dir)


def test_a_node_with_other_versions_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    """127.0.0.2's Python finds another DeepSpeed first (a dist-info of version 0.0.1 ahead on its PYTHONPATH)."""
    # PYTHONPATH is always forwarded to the other nodes: set, it is in the remote command for sshd to rewrite.
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH") or str(Path(__file__).resolve().parents[2] / "src"))
    other = tmp_path / "other-site-packages"
    (other / "deepspeed-0.0.1.dist-info").mkdir(parents=True)
    (other / "deepspeed-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: deepspeed\nVersion: 0.0.1\n")
    other_environment = f"eval \"$(printf %s \"$SSH_ORIGINAL_COMMAND\" | sed 's|PYTHONPATH=|PYTHONPATH={other}:|')\""
    server = start_sshd(tmp_path / "sshd", force_command=other_environment)
    try:
        result = zeropipe("train", write_config(tmp_path, tiny_run_config(tmp_path, "versions", deepspeed={"precision": "fp32"}, hardware=server.hardware())), timeout=300)
    finally:
        server.stop()
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "node 1 (127.0.0.2) runs deepspeed 0.0.1 (this node: " in out, out
    assert "install the same versions on every node" in out and "no rank was started" in out
    assert not list((tmp_path / "runs" / "versions" / "logs").glob("rank*.log"))


def test_an_unreachable_node_is_named_and_nothing_starts(tmp_path):
    """127.0.0.2 on a port no sshd listens on: ssh's own message, the node, and no rank anywhere."""
    hardware = {"gpus": 1, "accelerator": "cpu", "nodes": ["127.0.0.1", "127.0.0.2"], "ssh_port": free_port_on_both()}
    result = zeropipe("train", write_config(tmp_path, tiny_run_config(tmp_path, "unreachable", deepspeed={"precision": "fp32"}, hardware=hardware)), timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "node 1 (127.0.0.2) is unreachable:" in out and "Connection refused" in out and "ssh 127.0.0.2 true" in out, out
    run_dir = tmp_path / "runs" / "unreachable"
    assert not list((run_dir / "logs").glob("rank*.log"))
    assert not processes_of(run_dir)


def test_a_diffusion_run_on_two_nodes_fills_its_caches_once_before_any_node_starts_ranks(tmp_path, sshd):
    """The caches are filled by one process on the launching node, into the shared run directory;
    the node agents (and so every rank on every node) start after it and only read them."""
    from zeropipe.data.videos import generate_moving_shapes_dataset

    clips = generate_moving_shapes_dataset(tmp_path / "videos", 4, seed=1, resolution=32, frames=5)
    config = {
        "run": {"name": "wan-nodes", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-wan"}, "lora": {"r": 4, "alpha": 4}},
        "data": {"path": str(clips), "images": {"resolution": 32, "bucket_step": 16}, "video": {"frame_buckets": [1, 5]}},
        "train": {"max_steps": 2, "micro_batch_size": 1, "log_every": 1},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "hardware": sshd.hardware(),
    }
    result = zeropipe("train", write_config(tmp_path, config, "wan-nodes.yaml"))
    assert_ok(result)
    run_dir = tmp_path / "runs" / "wan-nodes"
    setup_log = (run_dir / "logs" / "node_setup.log").read_text()
    assert "caches filled" in setup_log
    filled_at = re.search(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO caches filled", setup_log)[1]
    for rank in (0, 1):
        rank_log = (run_dir / "logs" / f"rank{rank}.log").read_text()
        assert "caches filled" not in rank_log
        assert re.search(rf"==== zeropipe rank {rank}/2 started (\S+ \S+) ====", rank_log)[1] >= filled_at
    assert [row["step"] for row in metrics(run_dir) if "loss" in row] == [1, 2]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
