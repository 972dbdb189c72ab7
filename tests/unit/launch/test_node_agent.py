"""The node agent's hello, its lifeline (stdin's end, a silent launcher), and diagnoses across nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from zeropipe.launch.diagnose import RankExit, diagnose
from zeropipe.launch.node import HEARTBEAT_TIMEOUT, TOKEN_FILE, shared_problem, too_few_gpus, versions, visible_gpu_count

SRC = Path(__file__).resolve().parents[3] / "src"


def agent(run_dir: Path, token: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "zeropipe.launch.node", str(run_dir), "--node-rank", "1", "--token", token],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def test_the_run_directory_must_hold_the_launchers_token(tmp_path):
    run_dir = tmp_path / "run"
    assert "does not exist" in shared_problem(run_dir, "abc", "box2")
    run_dir.mkdir()
    assert "holds no launch token" in shared_problem(run_dir, "abc", "box2")
    (run_dir / "nodes").mkdir()
    (run_dir / TOKEN_FILE).write_text("older\n")
    problem = shared_problem(run_dir, "abc", "box2")
    assert "holds another launch's token" in problem and "run.output_dir is not shared" in problem and "on box2" in problem
    (run_dir / TOKEN_FILE).write_text("abc\n")
    assert shared_problem(run_dir, "abc", "box2") is None


def test_hello_reports_versions_and_the_agent_leaves_when_its_stdin_ends(tmp_path):
    proc = agent(tmp_path / "nowhere", "t0k3n")
    hello = json.loads(proc.stdout.readline())
    assert hello["event"] == "hello" and hello["node_rank"] == 1
    assert hello["versions"] == versions() and hello["host_ram_total_bytes"] > 0
    assert "run.output_dir is not shared" in hello["problem"]
    closed_at = time.time()
    proc.stdin.close()  # the SSH connection ended
    done = json.loads(proc.stdout.readline())
    assert (done["event"], done["state"], done["why"]) == ("done", "stopped", "eof")
    assert proc.wait(timeout=10) == 0 and time.time() - closed_at < 5


def test_a_silent_launcher_is_a_lost_launcher(tmp_path):
    proc = agent(tmp_path, "t0k3n")
    json.loads(proc.stdout.readline())
    started = time.time()
    done = json.loads(proc.stdout.readline())  # no ping ever comes
    assert (done["state"], done["why"]) == ("stopped", "silent")
    assert HEARTBEAT_TIMEOUT - 1 <= time.time() - started <= HEARTBEAT_TIMEOUT + 5
    proc.stdin.close()
    proc.wait(timeout=10)


def test_the_diagnosis_names_the_node_of_the_first_death():
    killed = RankExit(3, -9, 100.0, node="node 1 (box2)")
    reset = RankExit(0, 1, 100.3, log_tail=["RuntimeError: Connection reset by peer"], node="node 0 (box1)")
    diagnosis = diagnose([reset, killed], 20 * 10**9, 64 * 10**9)
    assert (diagnosis.rank, diagnosis.node) == (3, "node 1 (box2)")
    text = diagnosis.render()
    assert text.startswith("rank 3 on node 1 (box2) was killed by SIGKILL")
    assert "rank 0 on node 0 (box1) exited 1" in text


def test_a_lost_node_is_the_cause_not_the_survivors_connection_errors():
    lost = RankExit(1, -9, 100.2, node="node 1 (box2)", lost="the SSH connection was lost or the remote node agent was killed (ssh exited with 255)")
    survivor = RankExit(0, 1, 100.0, log_tail=["torch.distributed.DistNetworkError: Connection reset by peer"], node="node 0 (box1)")
    diagnosis = diagnose([survivor, lost], 0, 64 * 10**9)
    text = diagnosis.render()
    assert text.startswith("rank 1 on node 1 (box2) was lost with its node: the SSH connection was lost")
    assert "ssh HOST true" in diagnosis.fix
    assert "rank 0 on node 0 (box1) exited 1" in text


def test_a_node_with_fewer_gpus_than_its_slots_is_named_before_any_rank_starts(tmp_path):
    """A hostfile's slots=4 on a 2-GPU node: the agent says so in its hello, and the launcher refuses to start (issue 31)."""
    driver = tmp_path / "gpus"
    driver.mkdir()
    for bus in ("0000:01:00.0", "0000:02:00.0"):
        (driver / bus).mkdir()
    assert visible_gpu_count({}, driver) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2"}, driver) == 3
    assert visible_gpu_count({}, tmp_path / "no-driver") is None
    problem = too_few_gpus("cuda", 4, 2, "gpu07")
    assert "gpu07 has 2 GPU(s) but 4 ranks are assigned to it" in problem and "slots=2" in problem
    assert too_few_gpus("cuda", 2, 2, "gpu07") is None
    assert too_few_gpus("cpu", 4, 0, "box") is None, "CPU ranks need no GPU"
    assert too_few_gpus("cuda", 4, None, "gpu07") is None, "unknown: left to the ranks"
