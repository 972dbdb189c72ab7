"""`check` judges the whole DeepSpeed JSON a user brings, as DeepSpeed and ZeRO-Pipe's ranks would (issue 27)."""

import json
from pathlib import Path

import pytest

from zeropipe.check.run import check_config
from zeropipe.config.load import validate_config

PEERS = Path(__file__).resolve().parents[2] / "fixtures" / "peers"


def config_for(tmp_path, ds_json):
    data = tmp_path / "train.jsonl"
    data.write_text('{"instruction": "hi", "output": "yo"}\n')
    if isinstance(ds_json, dict):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds_json))
    else:
        path = PEERS / ds_json
    raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data)}, "hardware": {"gpus": 2}, "deepspeed": {"config_file": str(path)}}
    return validate_config(raw)


def errors(config):
    return [f for f in check_config(config, accelerator="cpu") if f.severity == "error"]


@pytest.mark.parametrize("name", ["zero1_torch_compile.json", "zero2_torch_compile.json"])
def test_a_compile_block_deepspeed_rejects_is_an_error_naming_the_key(tmp_path, name):
    found = errors(config_for(tmp_path, f"axolotl/deepspeed_configs/{name}"))
    assert any(f.rule == "ZP009" and f.key == "deepspeed: compile.backend" and f.fix == "remove compile.backend" for f in found), [f.render() for f in found]


def test_autotp_is_refused_with_the_reason_and_the_fix(tmp_path):
    found = errors(config_for(tmp_path, "llama-factory/examples/deepspeed/ds_z2_autotp_config.json"))
    tp = [f for f in found if f.rule == "ZP020"]
    assert tp and tp[0].key == "deepspeed: tensor_parallel" and "Data inconsistency within the TP group" in tp[0].message and "ZeRO-3" in tp[0].fix


def test_nvme_offload_is_refused_not_planned_as_cpu(tmp_path):
    config = config_for(tmp_path, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    found = errors(config)
    assert any(f.rule == "ZP020" and f.key == "deepspeed: zero_optimization.offload_param.device" and "\"cpu\"" in f.fix for f in found), [f.render() for f in found]


@pytest.mark.parametrize(
    "name",
    ["axolotl/deepspeed_configs/zero1.json", "axolotl/deepspeed_configs/zero2.json", "axolotl/deepspeed_configs/zero3_bf16.json",
     "llama-factory/examples/deepspeed/ds_z2_config.json", "llama-factory/examples/deepspeed/ds_z3_config.json", "deepspeed/transformers/ds_config_zero2.json"],
)
def test_the_peers_plain_zero_jsons_pass_deepspeeds_whole_parser(tmp_path, name):
    assert not [f for f in errors(config_for(tmp_path, name)) if f.rule in ("ZP009", "ZP020")]


@pytest.mark.parametrize(
    ("ds_json", "words"),
    [({"zero_optimization": {"stage": 2, "sub_group_size": "auto"}}, 'no rule fills "auto" for zero_optimization.sub_group_size'),
     ("deepspeed/DeepSpeedExamples/bing_bert_1-bit_adam_nccl_deepspeed_bsz4k_onebitadam_config_seq128_nccl.json", "optimizer.type = 'OneBitAdam'")],
)
def test_what_stops_the_json_from_resolving_is_an_error_not_dropped(tmp_path, ds_json, words):
    """check used to pass these (only a batch problem was reported); train then failed."""
    found = [f for f in check_config(config_for(tmp_path, ds_json), accelerator="cuda") if f.severity == "error"]
    assert any(f.rule == "ZP009" and f.key == "deepspeed.config_file" and words in f.message for f in found), [f.render() for f in found]


def test_autoep_config_deepspeed_accepts_is_refused_with_the_failing_line(tmp_path):
    # DeepSpeed's own parser and validator accept the block (2 ranks, expert-parallel size 2, its Qwen3-MoE preset)...
    from deepspeed.module_inject.auto_ep_config import parse_autoep_config, validate_autoep_config

    block = {"enabled": True, "autoep_size": 2, "preset_model": "qwen3_moe"}
    validate_autoep_config(parse_autoep_config(block), 2, 1, 1, 1)
    # ...and its initialize fails with transformers 5: check says where and what to do instead.
    found = errors(config_for(tmp_path, {"zero_optimization": {"stage": 2}, "expert_parallel": block}))
    ep = [f for f in found if f.rule == "ZP020" and f.key == "deepspeed: expert_parallel"]
    assert ep and "auto_ep_presets/base.py line 326" in ep[0].message and "model.zero3_leaf_blocks" in ep[0].fix, [f.render() for f in found]
    assert not [f for f in errors(config_for(tmp_path, {"expert_parallel": {**block, "enabled": False}})) if f.key == "deepspeed: expert_parallel"]
