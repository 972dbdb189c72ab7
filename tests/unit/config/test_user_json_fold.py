"""A user's DeepSpeed JSON folded into the run (issue 27): config.yaml and ds_config.json say what ran."""

import json
from pathlib import Path

import pytest
import yaml

from zeropipe.config.deepspeed import build_deepspeed_config
from zeropipe.config.load import load_config
from zeropipe.errors import ConfigError
from zeropipe.launch.resolve import resolve_run

PEERS = Path(__file__).resolve().parents[2] / "fixtures" / "peers"


def config_with(tmp_path, ds_json, *overrides):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text('{"instruction": "hi", "output": "yo"}\n')
    if isinstance(ds_json, dict):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds_json))
    else:
        path = ds_json
    raw = {"model": {"config": {"model_type": "llama", "hidden_size": 32}}, "data": {"path": str(data_file)}, "deepspeed": {"config_file": str(path)}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    return load_config(tmp_path / "run.yaml", list(overrides))


def test_bf16_auto_with_fp16_off_keeps_the_configs_precision(tmp_path):
    """LLaMA-Factory's ds_z3_fp8_config.json: bf16 "auto", fp16 false is not a request for fp32."""
    config = config_with(tmp_path, PEERS / "llama-factory/examples/deepspeed/ds_z3_fp8_config.json", "deepspeed.precision=bf16")
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert resolved.config.deepspeed.precision == "bf16"
    assert not resolved.conflicts
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config).config
    assert ds["bf16"]["enabled"] is True and ds["fp16"]["enabled"] is False


def test_both_off_is_still_fp32(tmp_path):
    config = config_with(tmp_path, {"bf16": {"enabled": False}, "fp16": {"enabled": False}}, "deepspeed.precision=bf16")
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert resolved.config.deepspeed.precision == "fp32" and [key for key, _ in resolved.conflicts] == ["deepspeed.precision"]


def test_an_explicit_optimizer_and_scheduler_are_what_config_yaml_records(tmp_path):
    """transformers' ds_config_zero3.json: AdamW lr 3e-5, betas (0.8, 0.999), WarmupLR 500 steps ran; the config must say so."""
    config = config_with(tmp_path, PEERS / "deepspeed/transformers/ds_config_zero3.json", "train.lr=0.001", "train.schedule=cosine")
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    train = resolved.config.train
    assert (train.lr, train.adam_beta1, train.weight_decay, train.schedule, train.warmup_steps) == (3e-5, 0.8, 3e-7, "constant", 500)
    # The YAML set lr and schedule itself: both are named as conflicts (ZP014), the JSON's values win.
    assert {"train.lr", "train.schedule"} <= {key for key, _ in resolved.conflicts}
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config).config
    assert ds["optimizer"]["params"]["lr"] == train.lr and ds["scheduler"]["params"]["warmup_max_lr"] == train.lr


def test_an_auto_scheduler_block_still_decides_the_schedule(tmp_path):
    """transformers' ds_config_zero2.json: WarmupLR with "auto" params is a constant schedule, not the config's cosine."""
    config = config_with(tmp_path, PEERS / "deepspeed/transformers/ds_config_zero2.json", "train.lr=0.0001", "train.warmup_steps=7")
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert (resolved.config.train.schedule, resolved.config.train.lr, resolved.config.train.warmup_steps) == ("constant", 1e-4, 7)
    assert "train.schedule = 'constant'" in " ".join(resolved.notes)
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config).config
    assert ds["scheduler"] == {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 7, "warmup_type": "linear"}}


def test_what_a_json_leaves_out_is_the_configs_and_is_written_in(tmp_path):
    """Not DeepSpeed's defaults (betas 0.999, 1000 warm-up steps at a 0.001 peak, a log warm-up), which config.yaml would not say."""
    ds_json = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100}}}
    config = config_with(tmp_path, ds_json, "train.adam_beta2=0.95", "train.warmup_steps=3")
    resolved = resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)
    train = resolved.config.train
    assert (train.schedule, train.lr, train.warmup_steps, train.min_lr_ratio) == ("linear", 1e-4, 3, 0.0)
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config).config
    assert ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert ds["scheduler"]["params"]["warmup_num_steps"] == 3 and ds["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert ds["scheduler"]["params"]["warmup_type"] == "linear" and ds["scheduler"]["params"]["total_num_steps"] == 100
    # No precision or ZeRO block in the file: the config's are written in, not DeepSpeed's fp32 and stage 0.
    assert ds["zero_optimization"]["stage"] == resolved.config.deepspeed.zero_stage
    assert ("bf16" in ds or "fp16" in ds) or resolved.config.deepspeed.precision == "fp32"


@pytest.mark.parametrize(("block", "words"), [({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}, "optimizer.type = 'OneBitAdam'"),
                                              ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type = 'OneCycle'")])
def test_an_optimizer_or_scheduler_the_config_cannot_describe_is_refused(tmp_path, block, words):
    config = config_with(tmp_path, block)
    with pytest.raises(ConfigError, match=words):
        resolve_run(config, world_size=2, accelerator="cpu", fill_auto_knobs=False)


def test_the_saved_config_yaml_and_ds_config_json_say_the_same_run(tmp_path):
    """prepare_run writes what ran: config.yaml's lr, betas, schedule and warm-up are the JSON's optimizer and scheduler."""
    from zeropipe.config.load import validate_config
    from zeropipe.launch.prepare import prepare_run

    ds_json = tmp_path / "ds.json"
    ds_json.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "bf16": {"enabled": "auto"}, "fp16": {"enabled": False},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 2, "warmup_type": "linear"}},
        "zero_optimization": {"stage": 2},
    }))
    tiny = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = validate_config({
        "run": {"name": "json", "output_dir": str(tmp_path / "runs")}, "model": {"config": tiny},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4, "micro_batch_size": 4, "lr": 1e-3, "schedule": "cosine"},
        "deepspeed": {"config_file": str(ds_json), "precision": "fp32"}, "hardware": {"gpus": 2, "accelerator": "cpu"},
    })
    resolved = resolve_run(config, accelerator="cpu")
    prepared = prepare_run(resolved)
    saved = yaml.safe_load(prepared.run.config.read_text())
    ds = json.loads(prepared.run.ds_config.read_text())
    assert (saved["train"]["lr"], saved["train"]["adam_beta1"], saved["train"]["schedule"], saved["train"]["warmup_steps"]) == (3e-5, 0.8, "constant", 2)
    assert ds["optimizer"]["params"]["lr"] == saved["train"]["lr"] and ds["scheduler"]["params"]["warmup_num_steps"] == saved["train"]["warmup_steps"]
    assert ds["zero_optimization"]["stage"] == saved["deepspeed"]["zero_stage"] == 2
    # The YAML's own lr and schedule lost to the JSON: said (ZP014), not silently replaced.
    assert {"train.lr", "train.schedule"} <= {key for key, _ in resolved.conflicts}


def test_a_json_muon_or_adafactor_becomes_train_optimizer_and_lamb_is_refused(tmp_path):
    """DeepSpeed runs the JSON's optimizer, so config.yaml says it: Muon and Adafactor fold into train.optimizer."""
    muon = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.9}}}
    resolved = resolve_run(config_with(tmp_path, muon), world_size=2, accelerator="cpu", fill_auto_knobs=False)
    assert resolved.config.train.optimizer == "muon" and resolved.config.train.muon_momentum == 0.9 and resolved.config.train.lr == 0.02
    assert any("train.optimizer = 'muon'" in note for note in resolved.notes)
    ds = build_deepspeed_config(resolved.config, world_size=2, total_steps=10, user_json=resolved.user_ds_config)
    assert ds.config["zero_optimization"]["reduce_scatter"] is False and ds.config["zero_allow_untested_optimizer"] is True
    assert any("reduce_scatter" in line for line in ds.filled)
    adafactor = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adafactor", "params": {"lr": 1e-3}}}
    assert resolve_run(config_with(tmp_path, adafactor), world_size=2, accelerator="cpu", fill_auto_knobs=False).config.train.optimizer == "adafactor"
    with pytest.raises(ConfigError, match="'Lamb'.*AdamW, Muon or Adafactor"):
        resolve_run(config_with(tmp_path, {"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}), world_size=2, accelerator="cpu", fill_auto_knobs=False)
