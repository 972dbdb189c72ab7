"""sbatch of a ZeRO-Pipe run on a real one-machine SLURM cluster (tests/integration/slurm.py).

One node with two tasks: the ranks run on the batch node as without SLURM, their count read
from the allocation. Two nodes with one task each: the second node's agent is started with
srun, the run completes with one rank per node.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.conftest import metrics, tiny_run_config, write_config
from tests.integration.slurm import AVAILABLE, start_cluster

pytestmark = [pytest.mark.integration, pytest.mark.skipif(not AVAILABLE, reason="needs root and Debian's slurmctld, slurmd, slurm-client and munge")]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    yield cluster
    cluster.stop()


def sbatch(cluster, tmp_path, name: str, *options: str) -> tuple[str, dict]:
    # hardware.gpus stays auto: the rank count comes from the allocation.
    config = tiny_run_config(tmp_path, name, train={"max_steps": 4, "log_every": 1}, deepspeed={"precision": "fp32"}, hardware={"gpus": "auto", "accelerator": "cpu"})
    path = write_config(tmp_path, config, f"{name}.yaml")
    out = tmp_path / f"{name}.out"
    env = cluster.env | {"OMP_NUM_THREADS": "1"}
    env.pop("DS_ACCELERATOR", None)
    result = subprocess.run(
        ["sbatch", "--wait", "-o", str(out), *options, "--wrap", f"{sys.executable} -m zeropipe train {path}"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    text = out.read_text() if out.exists() else ""
    assert result.returncode == 0, f"sbatch: {result.stdout}{result.stderr}\njob output:\n{text[-4000:]}"
    status = json.loads((tmp_path / "runs" / name / "status.json").read_text())
    return text, status


def test_sbatch_one_node_two_tasks(cluster, tmp_path):
    out, status = sbatch(cluster, tmp_path, "slurm-one", "--nodes=1", "--ntasks=2")
    assert "2 CPU ranks" in out, out
    assert status["state"] == "completed" and "nodes" not in status
    assert len([row for row in metrics(tmp_path / "runs" / "slurm-one") if "loss" in row]) == 4


def test_sbatch_two_nodes_starts_the_second_with_srun(cluster, tmp_path):
    out, status = sbatch(cluster, tmp_path, "slurm-two", "--nodes=2", "--ntasks-per-node=1")
    first, second = cluster.nodes
    assert f"2 nodes, world size 2: {first} ranks [0], {second} ranks [1]" in out, out
    assert status["state"] == "completed"
    assert [(n["host"], n["transport"], n["ranks"]) for n in status["nodes"]] == [(first, "local", [0]), (second, "srun", [1])]
    assert len([row for row in metrics(tmp_path / "runs" / "slurm-two") if "loss" in row]) == 4
