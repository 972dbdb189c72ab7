"""Curricula in the config: how a stage's sections merge over the top level, and every stage's problems at once."""

from __future__ import annotations

import pytest
import yaml

from zeropipe.config.load import load_config
from zeropipe.config.stages import merge_stage, stage_configs
from zeropipe.errors import ConfigError

MODEL = {"config": {"model_type": "llama", "hidden_size": 32}}


def write(tmp_path, config: dict):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def problems(tmp_path, config: dict) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, config))
    return dict(info.value.problems)


def test_merge_is_key_by_key_and_a_named_data_source_replaces_the_top_levels():
    top = {"model": {**MODEL, "lora": {"r": 8, "target_modules": ["q_proj"]}}, "data": {"synthetic": {"task": "mixed"}, "max_seq_len": 64}, "train": {"lr": 1e-3, "max_steps": 5}}
    merged = merge_stage(top, {"name": "b", "model": {"lora": {"r": 16}}, "data": {"path": "a.jsonl"}, "train": {"lr": 1e-4}})
    assert merged["model"]["lora"] == {"r": 16, "target_modules": ["q_proj"]}
    assert merged["data"] == {"path": "a.jsonl", "max_seq_len": 64}, "data.synthetic must give way to the stage's data.path"
    assert merged["train"] == {"lr": 1e-4, "max_steps": 5}
    assert merge_stage(top, {"name": "c", "model": {"lora": None}})["model"]["lora"] is None
    assert "stages" not in merge_stage({**top, "stages": [{"name": "x"}]}, {"name": "x"})


def test_stage_configs_are_full_run_configs(tmp_path):
    config = load_config(
        write(
            tmp_path,
            {
                "model": MODEL,
                "data": {"synthetic": {"task": "arithmetic"}},
                "train": {"lr": 1e-3, "max_steps": 5},
                "stages": [
                    {"name": "lora", "model": {"lora": {"r": 4}}, "deepspeed": {"zero_stage": 2}},
                    {"name": "full", "train": {"lr": 1e-5, "schedule": "constant"}, "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu"}},
                ],
            },
        )
    )
    first, second = stage_configs(config)
    assert first.model.lora.r == 4 and second.model.lora is None
    assert (first.train.lr, second.train.lr, second.train.schedule, second.train.max_steps) == (1e-3, 1e-5, "constant", 5)
    assert (first.deepspeed.zero_stage, second.deepspeed.zero_stage, second.deepspeed.offload_optimizer) == (2, 3, "cpu")
    assert first.stages is None and second.data.synthetic.task == "arithmetic"


def test_every_stages_problems_are_reported_at_once_with_their_stage(tmp_path):
    found = problems(
        tmp_path,
        {
            "model": MODEL,
            "train": {"max_steps": 5},
            "stages": [
                {"name": "warm", "data": {"synthetic": {"task": "arithmetic"}}, "train": {"lrr": 3}},
                {"name": "warm", "data": {"path": str(tmp_path / "nope.jsonl")}, "model": {"path": "/elsewhere"}, "deepspeed": {"zero_stage": 1, "offload_param": "cpu"}},
                {"nmae": "x", "data": {"synthetic": {}}, "train": {"schedule": "cosinus"}},
            ],
        },
    )
    assert found["stages[0].train.lrr"] == "unknown key; did you mean 'lr'?"
    assert "also the name of stages[0]" in found["stages[1].name"]
    assert "nope.jsonl does not exist" in found["stages[1].data.path"]
    assert "the model is set once, at the top level" in found["stages[1].model.path"]
    assert "needs zero_stage 3 (you set 1)" in found["stages[1].deepspeed.offload_param"]
    assert found["stages[2].nmae"] == "unknown key; did you mean 'name'?" and "stages[2].name" in found
    assert "'cosine'" in found["stages[2].train.schedule"]
    # The top level has no data of its own, but every stage gives some: not a problem.
    assert "data" not in found


def test_a_top_level_problem_every_stage_inherits_is_reported_once(tmp_path):
    found = problems(tmp_path, {"model": MODEL, "train": {"lr": -1}, "stages": [{"name": "a"}, {"name": "b", "data": {"synthetic": {}}}]})
    assert "train.lr" in found and not any(key.endswith("].train.lr") for key in found)
    # No data at the top and none in stage a: only stage a is wrong.
    assert "stages[0].data" in found and "stages[1].data" not in found and "data" not in found


def test_empty_stages_and_mixture_problems(tmp_path):
    assert "add at least one stage" in problems(tmp_path, {"model": MODEL, "data": {"synthetic": {}}, "stages": []})["stages"]
    data = tmp_path / "a.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    found = problems(
        tmp_path,
        {"model": MODEL, "data": {"format": "alpaca", "mixture": [{"path": str(data), "synthetic": {}}, {"path": str(tmp_path / "gone.jsonl")}, {"synthetic": {"task": "shapes"}}, {"weight": 0}]}},
    )
    assert "exactly one of them" in found["data.mixture[0]"]
    assert "gone.jsonl does not exist" in found["data.mixture[1].path"]
    assert "a mixture holds text" in found["data.mixture[2].synthetic.task"]
    assert "greater than 0" in found["data.mixture[3].weight"]
    assert "data.mixture[N].format" in found["data.format"]
    assert "not data.path and data.mixture" in problems(tmp_path, {"model": MODEL, "data": {"path": str(data), "mixture": [{"path": str(data)}]}})["data"]


def test_overrides_reach_a_stage_by_its_index(tmp_path):
    config = {"model": MODEL, "data": {"synthetic": {}}, "stages": [{"name": "a"}, {"name": "b", "train": {"lr": 1e-3}}]}
    loaded = load_config(write(tmp_path, config), ["stages[1].train.lr=2e-5", "stages.0.deepspeed.zero_stage=3"])
    assert loaded.stages[1].train == {"lr": 2e-5} and loaded.stages[0].deepspeed == {"zero_stage": 3}
    with pytest.raises(ConfigError, match=r"stages\[2\].train.lr: stages has items 0 to 1"):
        load_config(write(tmp_path, config), ["stages[2].train.lr=1e-4"])
