"""The machines of a run: hardware.nodes, DeepSpeed hostfiles, and SLURM allocations read from a described environment."""

from __future__ import annotations

import pytest

from zeropipe.config.schema import HardwareSection
from zeropipe.errors import ConfigError
from zeropipe.launch.nodes import expand_slurm_nodelist, expand_tasks_per_node, parse_hostfile_text, resolve_layout

# What sbatch --nodes=3 --ntasks-per-node=4 sets on the first node of the job (values from a
# real job's environment, names from sbatch(1) "OUTPUT ENVIRONMENT VARIABLES").
SLURM_THREE_NODES = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu[07-08],gpu10",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_NNODES": "3",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "12",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x3)",
    "SLURM_GPUS_ON_NODE": "4",
}


def parser_only(nodelist: str) -> list[str]:
    return expand_slurm_nodelist(nodelist)  # these tests must not depend on a SLURM client being installed


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node01", ["node01"]),
        ("node[01-03]", ["node01", "node02", "node03"]),
        ("gpu[07-08],gpu10", ["gpu07", "gpu08", "gpu10"]),
        ("n[8-10,12]", ["n8", "n9", "n10", "n12"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("a[1-2],b[3],c", ["a1", "a2", "b3", "c"]),
    ],
)
def test_slurm_nodelist_expands_like_scontrol(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[01-03", "node[a-b]", "node[1-2-3]"])
def test_a_nodelist_that_cannot_be_read_names_itself(bad):
    with pytest.raises(ConfigError) as err:
        expand_slurm_nodelist(bad)
    assert bad in str(err.value)


def test_tasks_per_node_compressed_form():
    assert expand_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(ConfigError, match="describes 2 nodes but SLURM_JOB_NODELIST has 3"):
        expand_tasks_per_node("4(x2)", 3)


def test_slurm_allocation_gives_nodes_ranks_and_master():
    layout = resolve_layout(HardwareSection(), 2, SLURM_THREE_NODES, hostnames=parser_only)
    assert [(n.host, n.ranks) for n in layout.nodes] == [("gpu07", 4), ("gpu08", 4), ("gpu10", 4)]
    assert (layout.world_size, layout.master_addr, layout.launcher) == (12, "gpu07", "slurm")
    assert layout.ranks_of(1) == [4, 5, 6, 7] and layout.node_of_rank(11) == 2
    assert "SLURM job 4242" in layout.source


def test_slurm_uneven_tasks_per_node_and_explicit_gpus():
    env = SLURM_THREE_NODES | {"SLURM_NTASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    layout = resolve_layout(HardwareSection(), 2, env, hostnames=parser_only)
    assert [n.ranks for n in layout.nodes] == [2, 2, 1] and layout.world_size == 5
    layout = resolve_layout(HardwareSection(gpus=1), 1, SLURM_THREE_NODES, hostnames=parser_only)
    assert [n.ranks for n in layout.nodes] == [1, 1, 1]


def test_slurm_gpus_per_node_without_a_task_count_starts_a_rank_per_gpu():
    # sbatch --nodes=2 --gpus-per-node=4 (no --ntasks...): sbatch still sets SLURM_TASKS_PER_NODE, to 1(x2).
    env = {
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "0",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_GPUS_ON_NODE": "4",
    }
    layout = resolve_layout(HardwareSection(), 2, env, hostnames=parser_only)
    assert [n.ranks for n in layout.nodes] == [4, 4] and layout.world_size == 8
    assert "SLURM_GPUS_ON_NODE" in layout.notes[0]
    # With a task count asked for (--ntasks=2), the tasks decide, as before.
    layout = resolve_layout(HardwareSection(), 2, env | {"SLURM_NTASKS": "2"}, hostnames=parser_only)
    assert [n.ranks for n in layout.nodes] == [1, 1]
    # A CPU allocation (no GPUs): the tasks per node.
    env.pop("SLURM_GPUS_ON_NODE")
    assert [n.ranks for n in resolve_layout(HardwareSection(), 2, env, hostnames=parser_only).nodes] == [1, 1]


def test_zeropipe_started_as_one_of_many_srun_tasks_is_refused():
    env = SLURM_THREE_NODES | {"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "12"}
    with pytest.raises(ConfigError, match="every task would start the whole run"):
        resolve_layout(HardwareSection(), 2, env, hostnames=parser_only)


def test_launched_from_another_node_than_the_first_is_refused():
    with pytest.raises(ConfigError, match="run it on the first node \\(gpu07\\)"):
        resolve_layout(HardwareSection(), 2, SLURM_THREE_NODES | {"SLURM_NODEID": "1"}, hostnames=parser_only)


def test_outside_slurm_and_without_nodes_the_run_stays_on_this_machine():
    assert resolve_layout(HardwareSection(), 2, {}) is None
    with pytest.raises(ConfigError, match="not run inside a SLURM allocation"):
        resolve_layout(HardwareSection(launcher="slurm"), 2, {})
    # launcher: ssh ignores an allocation the command happens to run in
    assert resolve_layout(HardwareSection(launcher="ssh"), 2, SLURM_THREE_NODES) is None


def test_hardware_nodes_run_gpus_ranks_each_with_the_first_as_master():
    layout = resolve_layout(HardwareSection(gpus=4, nodes=["box1", "box2"], ssh_port=2222), 4, {})
    assert [(n.host, n.ranks) for n in layout.nodes] == [("box1", 4), ("box2", 4)]
    assert (layout.world_size, layout.master_addr, layout.launcher, layout.ssh_port) == (8, "box1", "ssh", 2222)
    assert resolve_layout(HardwareSection(nodes=["box1", "box2"], master_addr="10.0.0.1"), 1, {}).master_addr == "10.0.0.1"


def test_hostfile_in_deepspeeds_format(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two boxes\nworker-1 slots=4\n\nworker-2 slots=2\n")
    layout = resolve_layout(HardwareSection(hostfile=str(hostfile)), 2, {})
    assert [(n.host, n.ranks) for n in layout.nodes] == [("worker-1", 4), ("worker-2", 2)]
    assert layout.world_size == 6 and layout.ranks_of(1) == [4, 5]


@pytest.mark.parametrize(
    ("text", "message"),
    [("box1 4\n", "line 1 is not a hostfile line"), ("box1 slots=2\nbox1 slots=2\n", "line 2 names a host of an earlier line again"), ("# nothing\n", "empty")],
)
def test_a_bad_hostfile_says_what_is_wrong(text, message):
    with pytest.raises(ConfigError) as err:
        parse_hostfile_text(text, "hosts.txt")
    assert message in str(err.value) and "hosts.txt" in str(err.value)


def test_nodes_and_hostfile_together_or_twice_the_same_host_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="not both"):
        resolve_layout(HardwareSection(nodes=["a"], hostfile="h"), 1, {})
    with pytest.raises(ConfigError, match="names a host twice"):
        resolve_layout(HardwareSection(nodes=["a", "a"]), 1, {})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_layout(HardwareSection(hostfile=str(tmp_path / "missing")), 1, {})


def test_a_curriculum_on_several_nodes_is_refused_before_anything_starts(tmp_path, capsys):
    """The curriculum runner starts every stage's ranks on this machine: several nodes would all be started here."""
    import yaml

    from zeropipe.cli.main import main

    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "run": {"output_dir": str(tmp_path / "runs")},
                "model": {"config": {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}},
                "data": {"synthetic": {"task": "arithmetic", "examples": 64}},
                "hardware": {"gpus": 1, "nodes": ["box1", "box2"]},
                "stages": [{"name": "a", "train": {"max_steps": 2}}],
            }
        )
    )
    # In-process: `zeropipe train` as the shell runs it, without a second interpreter's start-up.
    assert main(["train", str(config)]) != 0
    err = capsys.readouterr().err
    assert "stages: a curriculum runs on one node; this config names 2 (hardware.nodes)" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
