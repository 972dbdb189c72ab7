"""`zeropipe plan --nodes N`: ZeRO partitions over every node's ranks, host RAM is counted per node."""

from __future__ import annotations

import json

import yaml

from tests.unit.plan.test_plan_cli import run_plan
from zeropipe.plan.hardware import parse_hardware
from zeropipe.plan.memory import Choice
from zeropipe.plan.totals import per_node_terms
from zeropipe.plan.model_spec import spec_from_catalog


def plan_json(capsys, *argv: str) -> tuple[int, dict]:
    code = run_plan(*argv, "--json")
    return code, json.loads(capsys.readouterr().out)


def term(terms: list, name: str) -> int:
    return next(t["bytes"] if isinstance(t, dict) else t.bytes for t in terms if (t["name"] if isinstance(t, dict) else t.name) == name)


def test_a_second_node_makes_a_full_fine_tune_fit_and_halves_each_nodes_offloaded_states(capsys):
    # Llama 3.1 8B, full fine-tune, 4x24GB and 96 GB of RAM per box: one box has too little host RAM.
    code, one = plan_json(capsys, "--model", "llama-3.1-8b", "--gpus", "4x24GB", "--ram", "96GB", "--nodes", "1")
    assert code == 1 and one["best"] is None and "too much host RAM" in one["reason"]
    code, two = plan_json(capsys, "--model", "llama-3.1-8b", "--gpus", "4x24GB", "--ram", "96GB", "--nodes", "2")
    assert code == 0 and two["hardware"]["nodes"] == 2
    best = two["best"]
    assert best["fits"] and best["per_node_bytes"] <= two["usable_host_bytes"] and best["per_gpu_bytes"] <= two["usable_gpu_bytes"]
    assert two["fragment"]["deepspeed"]["zero_stage"] == best["choice"]["zero_stage"]
    # The same choice on one node: each node holds its 4 ranks' 1/8 shares instead of 1/4.
    same = next(c for c in one["candidates"] if c["choice"] == best["choice"])
    assert same["per_node_bytes"] > one["usable_host_bytes"]
    one_node_terms = per_node_terms(spec_from_catalog("llama-3.1-8b"), parse_hardware("4x24GB", "96GB", nodes=1), Choice(**best["choice"]))
    assert term(best["per_node_terms"], "rank processes") == term(one_node_terms, "rank processes")  # 4 ranks per node either way
    assert best["choice"]["offload_optimizer"]
    halved = term(best["per_node_terms"], "offloaded optimizer states") / term(one_node_terms, "offloaded optimizer states")
    assert abs(halved - 0.5) < 0.01


def test_per_node_terms_count_the_nodes_own_ranks_and_partition_over_all():
    spec = spec_from_catalog("llama-3.1-8b")
    choice = Choice(zero_stage=3, offload_optimizer=True, offload_param=False, precision="bf16", gradient_checkpointing=True, micro_batch_size=1)
    for nodes in (1, 2, 4):
        hardware = parse_hardware("4x24GB", "64GB", nodes=nodes)
        terms = {t.name: t.bytes for t in per_node_terms(spec, hardware, choice)}
        reference = {t.name: t.bytes for t in per_node_terms(spec, parse_hardware("4x24GB", "64GB", nodes=1), choice)}
        assert terms["rank processes"] == reference["rank processes"]
        assert abs(terms["offloaded optimizer states"] * nodes / reference["offloaded optimizer states"] - 1) < 0.01


def test_planning_a_multi_node_config_plans_for_its_nodes(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}},
                "data": {"synthetic": {"task": "arithmetic"}, "max_seq_len": 64},
                "hardware": {"gpus": 1, "accelerator": "cpu", "nodes": ["box1", "box2", "box3"]},
            }
        )
    )
    code, plan = plan_json(capsys, str(config))
    assert code == 0
    assert (plan["hardware"]["nodes"], plan["hardware"]["gpus_per_node"]) == (3, 1)
    assert any("3 nodes from hardware.nodes" in note for note in plan["hardware"]["notes"])
