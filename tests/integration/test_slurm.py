"""sbatch of a ZeRO-Pipe run on a real one-machine SLURM cluster (tests/integration/slurm.py).

One node with two tasks: the ranks run on the batch node as without SLURM, their count read
from the allocation. Two nodes with one task each: the second node's agent is started with
srun, the run completes with one rank per node.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

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
    wait_until_idle(cluster)
    submitted = subprocess.run(
        ["sbatch", "--parsable", "-o", str(out), *options, "--wrap", f"{sys.executable} -m zeropipe train {path}"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )
    assert submitted.returncode == 0, f"sbatch: {submitted.stdout}{submitted.stderr}"
    job = submitted.stdout.strip().split(";")[0]
    try:
        state, exit_code = wait_for_job(cluster, job)
    except AssertionError as err:
        raise AssertionError(f"{err}\njob output:\n{out.read_text()[-4000:] if out.exists() else '(none)'}") from None
    finally:
        subprocess.run(["scancel", job], capture_output=True, env=cluster.env)  # a job still running is not left to the next test
    text = out.read_text() if out.exists() else ""
    assert (state, exit_code) == ("COMPLETED", "0:0"), f"job {job}: {state} {exit_code}\njob output:\n{text[-4000:]}"
    status = json.loads((tmp_path / "runs" / name / "status.json").read_text())
    return text, status


def wait_for_job(cluster, job: str, timeout: float = 240.0) -> tuple[str, str]:
    """The job's final state and exit code, polled every half second. `sbatch --wait` would do this, but it
    polls at 2, 10 and then every 42 s, which made each 15-second job take 42 s of CI."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        shown = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, env=cluster.env).stdout
        fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
        if fields.get("JobState") in TERMINAL:
            return fields["JobState"], fields.get("ExitCode", "")
        time.sleep(0.5)
    logs = "\n".join(f"{path.name}:\n{path.read_text()[-2000:]}" for path in sorted(cluster.conf.parent.glob("*.log")))
    raise AssertionError(f"job {job} did not finish in {timeout:.0f} s (state {fields.get('JobState')}):\n{logs}")


def wait_until_idle(cluster, timeout: float = 60.0) -> None:
    """Each job starts on idle nodes, as it did when `sbatch --wait` left half a minute between jobs: a node
    still finishing the previous job's epilogue would make the next job's srun step fail."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=cluster.env).stdout.split()
        if states and all(state == "idle" for state in states):
            return
        time.sleep(0.5)
    raise AssertionError(f"the test cluster's nodes did not come back idle: {states}")


TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


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
