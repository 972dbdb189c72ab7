"""axolotl YAMLs -> ZeRO-Pipe keys, key by key; RL refused; datasets mapped by type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropipe.convert import ConversionError, convert_file


def model_dir(root: Path) -> Path:
    folder = root / "Llama-3.2-1B"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def write(tmp_path: Path, text: str, name: str = "axolotl.yml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def unmapped(conversion) -> dict:
    return dict(conversion.unmapped)


def test_qlora_example_maps_key_by_key(tmp_path):
    model = model_dir(tmp_path)
    data = tmp_path / "alpaca.jsonl"
    data.write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
    (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}))
    path = write(
        tmp_path,
        f"""
base_model: {model}
load_in_8bit: false
load_in_4bit: true
trust_remote_code: true
datasets:
  - path: alpaca.jsonl
    type: alpaca
val_set_size: 0.05
output_dir: ./outputs/qlora-out
adapter: qlora
lora_model_dir:
sequence_len: 1024
sample_packing: true
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_modules:
  - q_proj
  - v_proj
wandb_project: my-project
gradient_accumulation_steps: 4
micro_batch_size: 2
num_epochs: 2
max_steps: 100
optimizer: adamw_torch
lr_scheduler: cosine
cosine_min_lr_ratio: 0.1
learning_rate: 2e-4
bf16: auto
gradient_checkpointing: true
logging_steps: 5
save_steps: 50
save_total_limit: 3
eval_steps: 25
warmup_ratio: 0.1
weight_decay: 0.01
max_grad_norm: 0.3
adam_beta2: 0.95
seed: 7
flash_attention: true
deepspeed: zero2.json
train_on_inputs: false
""",
    )
    conversion = convert_file(path)
    assert conversion.tool == "axolotl"
    assert values(conversion) == {
        "model.path": str(model),
        "model.load_kwargs": {"trust_remote_code": True},
        "model.gradient_checkpointing": True,
        "model.attn_implementation": "sdpa",
        "model.lora.r": 32,
        "model.lora.alpha": 16.0,
        "model.lora.dropout": 0.05,
        "model.lora.target_modules": ["q_proj", "v_proj"],
        "model.quantization.load_in_4bit": True,
        "data.path": str(data),
        "data.format": "alpaca",
        "data.max_seq_len": 1024,
        "data.packing": True,
        "data.eval_fraction": 0.05,
        "train.eval_every": 25,
        "train.micro_batch_size": 2,
        "train.epochs": 2.0,
        "train.lr": 2e-4,
        "train.weight_decay": 0.01,
        "train.grad_clip": 0.3,
        "train.adam_beta2": 0.95,
        "train.max_steps": 100,
        "train.gradient_accumulation_steps": 4,
        "train.log_every": 5,
        "train.save_every": 50,
        "train.keep_last": 3,
        "run.seed": 7,
        "train.min_lr_ratio": 0.1,
        "train.schedule": "cosine",
        "train.warmup_steps": 10,  # warmup_ratio 0.1 x max_steps 100
        "deepspeed.precision": "bf16",
        "deepspeed.config_file": str(tmp_path / "zero2.json"),
        "deepspeed.zero_stage": 2,
        "deepspeed.offload_optimizer": "cpu",
        "run.output_dir": "outputs",
        "run.name": "qlora-out",
        "logging.wandb": True,
        "logging.wandb_project": "my-project",
    }
    assert conversion.unmapped == []
    assert conversion.already == ["optimizer: adamw_torch (DeepSpeed builds AdamW)", "train_on_inputs: false (loss on responses only)", "load_in_8bit: false"]


@pytest.mark.parametrize("rl", ["gdpo"])  # rl: grpo converts: tests/unit/convert/test_convert_grpo.py
def test_rl_methods_zeropipe_does_not_train_are_refused_with_the_reason(tmp_path, rl):
    path = write(tmp_path, f"base_model: x\nrl: {rl}\ndatasets:\n  - path: x\n    type: chatml.intel\n")
    with pytest.raises(ConversionError, match=rf"rl: {rl} asks for .* training, which ZeRO-Pipe does not do \(it trains dpo, ipo, orpo, simpo and kto"):
        convert_file(path)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ("rl: dpo\nrl_beta: 0.2\nrpo_alpha: 0.5\n", {"method": "dpo", "beta": 0.2, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
        ("rl: ipo\n", {"method": "dpo", "loss_type": ["ipo"]}),
        ("rl: dpo\ndpo_label_smoothing: 0.1\n", {"method": "dpo", "loss_type": ["robust"], "label_smoothing": 0.1}),
        ("rl: orpo\norpo_alpha: 0.1\n", {"method": "orpo", "beta": 0.1}),
        ("rl: simpo\nrl_beta: 2.0\nsimpo_gamma: 0.5\ncpo_alpha: 0.0\n", {"method": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0}),
        ("rl: kto\nrl_beta: 0.5\nkto_desirable_weight: 1.2\n", {"method": "kto", "beta": 0.5, "desirable_weight": 1.2}),
        ("reward_model: true\n", {"method": "reward"}),
    ],
    ids=["dpo-rpo", "ipo", "robust", "orpo", "simpo", "kto", "reward"],
)
def test_rl_keys_become_the_preference_section(tmp_path, keys, expected):
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"question": "q", "chosen": "a", "rejected": "b"}) + "\n")
    path = write(tmp_path, f"base_model: x\n{keys}datasets:\n  - path: {tmp_path / 'pairs.jsonl'}\n    type: chatml.intel\n")
    entries = {key: entry.value for key, entry in convert_file(path).entries.items()}
    assert {key.split(".", 1)[1]: value for key, value in entries.items() if key.startswith("preference.")} == expected
    assert entries["data.path"] == str(tmp_path / "pairs.jsonl")


def test_a_preference_recipes_held_out_share_is_listed_with_zeropipe_eval(tmp_path):
    """check refuses data.eval_fraction on a preference run: val_set_size is listed, not mapped into a config check refuses."""
    (tmp_path / "pairs.jsonl").write_text(json.dumps({"question": "q", "chosen": "a", "rejected": "b"}) + "\n")
    path = write(tmp_path, f"base_model: x\nrl: dpo\nval_set_size: 0.05\ndatasets:\n  - path: {tmp_path / 'pairs.jsonl'}\n    type: chatml.intel\n")
    conversion = convert_file(path)
    assert "data.eval_fraction" not in conversion.entries
    assert "zeropipe eval RUN --data FILE" in dict(conversion.unmapped)["val_set_size"]


def test_dataset_types_and_several_datasets_become_a_weighted_mixture(tmp_path):
    model = model_dir(tmp_path)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}) + "\n" for _ in range(3)))
    (tmp_path / "share.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}] * 5))
    (tmp_path / "custom.jsonl").write_text(json.dumps({"dialog": [{"speaker": "user", "text": "q"}]}) + "\n")
    (tmp_path / "text.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    path = write(
        tmp_path,
        f"""
base_model: {model}
datasets:
  - path: chat.jsonl
    type: chat_template
    roles_to_train: ["assistant"]
  - path: share.json
    type: chat_template
    field_messages: conversations
    message_field_role: from
    message_field_content: value
    roles:
      user: [human]
      assistant: [gpt]
  - path: custom.jsonl
    type: chat_template
    field_messages: dialog
    message_property_mappings:
      role: speaker
      content: text
  - path: text.jsonl
    type: completion
    field: body
  - path: mhenrichsen/alpaca_2k_test
    type: alpaca
  - path: chat.jsonl
    type: oasst
""",
    )
    conversion = convert_file(path)
    assert values(conversion)["data.mixture"] == [
        {"path": str(tmp_path / "chat.jsonl"), "format": "chat", "weight": 3.0},
        {"path": str(tmp_path / "share.json"), "format": "sharegpt", "weight": 5.0},
    ]
    why = unmapped(conversion)
    assert "rename the keys in the file" in why["datasets[2].field_messages"]
    assert "read from a 'text' key" in why["datasets[3].field"]
    assert "huggingface-cli download --repo-type dataset mhenrichsen/alpaca_2k_test" in why["datasets[4]"]
    assert "'oasst': ZeRO-Pipe reads alpaca, chat_template, sharegpt and completion data" in why["datasets[5].type"]


def test_full_finetune_hub_model_and_leftovers(tmp_path):
    (tmp_path / "data.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    path = write(
        tmp_path,
        """
base_model: NousResearch/Llama-3.2-1B
datasets:
  - path: data.jsonl
    type: completion
lora_r: 8
load_in_8bit: true
fsdp:
  - full_shard
special_tokens:
  pad_token: <|end_of_text|>
evals_per_epoch: 4
warmup_ratio: 0.05
lr_scheduler: rex
optimizer: lion_8bit
wandb_entity:
some_future_key: 1
""",
    )
    conversion = convert_file(path)
    got = values(conversion)
    assert "model.lora.r" not in got and got["data.format"] == "text" and got["deepspeed.precision"] == "fp32"
    assert got["model.path"] == "NousResearch/Llama-3.2-1B"
    why = unmapped(conversion)
    assert "huggingface-cli download NousResearch/Llama-3.2-1B --local-dir DIR" in why["base_model"]
    assert "full fine-tune" in why["lora_r"]
    assert "an 8-bit base trains adapters only" in why["load_in_8bit"]  # no adapter here: a full fine-tune
    assert "FSDP's full_shard is ZeRO-3" in why["fsdp"]
    assert "warmup_steps" in why["warmup_ratio"]
    assert "'rex'" in why["lr_scheduler"] and "'lion_8bit'" in why["optimizer"]
    assert "some_future_key" in why and "wandb_entity" not in why  # empty keys are simply unset


def test_bad_yaml_is_clear(tmp_path):
    path = write(tmp_path, "base_model: x\ndatasets:\n  - path: a\n   type: alpaca\n")
    with pytest.raises(ConversionError, match=r"axolotl.yml is not valid YAML at line \d+, column \d+"):
        convert_file(path)
