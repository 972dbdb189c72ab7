"""LLaMA-Factory YAMLs and dataset_info.json -> ZeRO-Pipe keys, key by key; RL stages refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zeropipe.convert import ConversionError, convert_file


def model_dir(root: Path, vision: bool = False) -> Path:
    folder = root / ("Qwen2-VL-tiny" if vision else "Llama-tiny")
    folder.mkdir()
    config = {"model_type": "llava", "vision_config": {}, "text_config": {}} if vision else {"model_type": "llama"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def dataset_dir(root: Path, info: dict, files: dict[str, object]) -> Path:
    folder = root / "data"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(json.dumps(info))
    for name, records in files.items():
        (folder / name).write_text(json.dumps(records))
    return folder


def write(tmp_path: Path, text: str, name: str = "llama3_lora_sft.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def unmapped(conversion) -> dict:
    return dict(conversion.unmapped)


ALPACA = [{"instruction": "q", "input": "", "output": "a"}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
OPENAI = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 4


def test_lora_sft_example_maps_key_by_key(tmp_path):
    model = model_dir(tmp_path)
    data = dataset_dir(tmp_path, {"alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}, {"alpaca_en_demo.json": ALPACA})
    path = write(
        tmp_path,
        f"""
### model
model_name_or_path: {model}
trust_remote_code: true
### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 16
lora_target: q_proj,v_proj
quantization_bit: 4
### dataset
dataset: alpaca_en_demo
dataset_dir: {data}
cutoff_len: 1024
neat_packing: true
### output
output_dir: saves/llama3-8b/lora/sft
logging_steps: 10
save_steps: 500
### train
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
learning_rate: 1.0e-4
num_train_epochs: 2.0
lr_scheduler_type: cosine
warmup_steps: 30
bf16: true
val_size: 0.1
eval_steps: 100
train_on_prompt: false
""",
    )
    conversion = convert_file(path)
    assert conversion.tool == "llama-factory"
    assert values(conversion) == {
        "model.path": str(model),
        "model.load_kwargs": {"trust_remote_code": True},
        "model.gradient_checkpointing": True,
        "model.lora.r": 16,
        "model.lora.alpha": 32.0,  # LLaMA-Factory's default: 2 x rank
        "model.lora.dropout": 0.0,
        "model.lora.target_modules": ["q_proj", "v_proj"],
        "model.quantization.load_in_4bit": True,
        "model.quantization.double_quant": True,
        "model.quantization.quant_type": "nf4",
        "data.path": str(data / "alpaca_en_demo.json"),
        "data.format": "alpaca",
        "data.max_seq_len": 1024,
        "data.packing": True,
        "data.eval_fraction": 0.1,
        "train.eval_every": 100,
        "train.micro_batch_size": 2,
        "train.epochs": 2.0,
        "train.lr": 1e-4,
        "train.warmup_steps": 30,
        "train.gradient_accumulation_steps": 8,
        "train.log_every": 10,
        "train.save_every": 500,
        "train.schedule": "cosine",
        "train.min_lr_ratio": 0.0,
        "deepspeed.precision": "bf16",
        "run.output_dir": "saves/llama3-8b/lora",
        "run.name": "sft",
    }
    assert conversion.unmapped == []


def test_defaults_of_llama_factory_are_written_out(tmp_path):
    """Where LLaMA-Factory's defaults differ from ZeRO-Pipe's, the converted config keeps LLaMA-Factory's."""
    model = model_dir(tmp_path)
    dataset_dir(tmp_path, {"demo": {"file_name": "demo.json"}}, {"demo.json": ALPACA})
    path = write(tmp_path, f"model_name_or_path: {model}\nstage: sft\ndataset: demo\n")
    got = values(convert_file(path))
    assert got["model.lora.r"] == 8 and got["model.lora.alpha"] == 16.0 and got["model.lora.target_modules"] == "all-linear"
    assert got["data.max_seq_len"] == 2048 and got["train.epochs"] == 3.0
    assert got["train.schedule"] == "linear" and got["deepspeed.precision"] == "fp32"


def test_ppo_is_refused(tmp_path):
    path = write(tmp_path, "model_name_or_path: x\nstage: ppo\nfinetuning_type: lora\n")
    with pytest.raises(ConversionError, match=r"stage: ppo is PPO training, which ZeRO-Pipe does not do"):
        convert_file(path)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ("stage: dpo\npref_beta: 0.2\npref_ftx: 0.5\n", {"method": "dpo", "beta": 0.2, "loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}),
        ("stage: dpo\npref_loss: ipo\n", {"method": "dpo", "beta": 0.1, "loss_type": ["ipo"]}),
        ("stage: dpo\npref_loss: orpo\npref_beta: 0.3\n", {"method": "orpo", "beta": 0.3}),
        ("stage: dpo\npref_loss: simpo\npref_beta: 2.5\nsimpo_gamma: 0.7\n", {"method": "simpo", "beta": 2.5, "simpo_gamma": 0.7, "cpo_alpha": 0.0}),
        ("stage: kto\nkto_chosen_weight: 1.5\nkto_rejected_weight: 0.5\n", {"method": "kto", "beta": 0.1, "desirable_weight": 1.5, "undesirable_weight": 0.5}),
        ("stage: rm\n", {"method": "reward"}),
    ],
    ids=["dpo-ftx", "ipo", "orpo", "simpo", "kto", "rm"],
)
def test_preference_stages_become_the_preference_section_and_ranking_data_is_read(tmp_path, keys, expected):
    data = tmp_path / "data"
    data.mkdir()
    (data / "pairs.json").write_text(json.dumps([{"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}, "rejected": {"from": "gpt", "value": "b"}}]))
    info = {"pairs": {"file_name": "pairs.json", "ranking": True, "formatting": "sharegpt", "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}}}
    (data / "dataset_info.json").write_text(json.dumps(info))
    path = write(tmp_path, f"model_name_or_path: x\n{keys}finetuning_type: lora\ndataset: pairs\ndataset_dir: {data}\nval_size: 0.1\n")
    conversion = convert_file(path)
    entries = {key: entry.value for key, entry in conversion.entries.items()}
    assert {key.split(".", 1)[1]: value for key, value in entries.items() if key.startswith("preference.")} == expected
    assert entries["data.path"] == str(data / "pairs.json") and "data.columns" not in entries
    # check refuses held-out data on a preference run: val_size is listed with the way to measure held-out pairs.
    assert "data.eval_fraction" not in entries and "zeropipe eval RUN --data FILE" in dict(conversion.unmapped)["val_size"]


def test_dataset_info_formatting_columns_and_tags(tmp_path):
    model = model_dir(tmp_path)
    info = {
        "identity": {"file_name": "identity.json", "formatting": "sharegpt"},
        "openai": {"file_name": "openai.json", "formatting": "sharegpt", "columns": {"messages": "messages"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}},
        "renamed": {"file_name": "renamed.json", "columns": {"prompt": "question", "response": "answer"}},
        "with_system": {"file_name": "sys.json", "columns": {"prompt": "instruction", "system": "system"}},
        "odd_tags": {"file_name": "odd.json", "formatting": "sharegpt", "tags": {"user_tag": "customer"}},
        "prefs": {"file_name": "prefs.json", "ranking": True},
        "hub": {"hf_hub_url": "tatsu-lab/alpaca"},
    }
    files = {"identity.json": SHAREGPT, "openai.json": OPENAI, "renamed.json": [{"question": "q", "answer": "a"}], "sys.json": ALPACA,
             "odd.json": SHAREGPT, "prefs.json": [{"instruction": "q", "chosen": "a", "rejected": "b"}]}
    data = dataset_dir(tmp_path, info, files)
    path = write(tmp_path, f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: full\ndataset: identity,openai,renamed,with_system,odd_tags,prefs,hub,missing\n")
    conversion = convert_file(path)
    assert values(conversion)["data.mixture"] == [
        {"path": str(data / "identity.json"), "format": "sharegpt", "weight": 1.0},
        {"path": str(data / "openai.json"), "format": "chat", "weight": 4.0},
        {"path": str(data / "sys.json"), "format": "alpaca", "weight": 1.0},
    ]
    why = unmapped(conversion)
    assert "rename the keys in renamed.json" in why["dataset renamed columns"]
    assert "the system column is not read" in why["dataset with_system columns.system"]
    assert "rename them in odd.json" in why["dataset odd_tags columns/tags"]
    assert "preference dataset" in why["dataset prefs"]
    assert "hf_hub_url: tatsu-lab/alpaca" in why["dataset hub"]
    assert "not described in" in why["dataset missing"]


def test_pretraining_stage_reads_text(tmp_path):
    model = model_dir(tmp_path)
    data = dataset_dir(tmp_path, {"c4_demo": {"file_name": "c4.json", "columns": {"prompt": "text"}}}, {"c4.json": [{"text": "a document"}]})
    path = write(tmp_path, f"model_name_or_path: {model}\nstage: pt\nfinetuning_type: lora\ndataset: c4_demo\n")
    got = values(convert_file(path))
    assert got["data.path"] == str(data / "c4.json") and got["data.format"] == "text"


def test_vision_language_freeze_switches_become_trainable_parts(tmp_path):
    model = model_dir(tmp_path, vision=True)
    dataset_dir(tmp_path, {"mllm_demo": {"file_name": "mllm.json", "formatting": "sharegpt", "columns": {"messages": "messages", "images": "images"},
                                         "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}},
                {"mllm.json": [{"messages": OPENAI[0]["messages"], "images": ["a.jpg"]}]})
    path = write(tmp_path, f"model_name_or_path: {model}\nstage: sft\nfinetuning_type: full\nfreeze_multi_modal_projector: false\ndataset: mllm_demo\nimage_max_pixels: 262144\n")
    conversion = convert_file(path)
    got = values(conversion)
    assert got["model.trainable"] == ["projector", "language_model"]
    assert got["data.format"] == "chat"
    assert "image processor" in unmapped(conversion)["image_max_pixels"]


def test_missing_dataset_info_and_unknown_method_are_clear(tmp_path):
    path = write(tmp_path, "model_name_or_path: x\nstage: sft\ndataset: demo\ndataset_dir: nowhere\n")
    with pytest.raises(ConversionError, match=r"nowhere/dataset_info.json was not found .*set dataset_dir"):
        convert_file(path)
    bad_info = tmp_path / "bad"
    bad_info.mkdir()
    (bad_info / "dataset_info.json").write_text("{\"demo\": {\"file_name\": \"x.json\",}}")
    path = write(tmp_path, f"model_name_or_path: x\nstage: sft\ndataset: demo\ndataset_dir: {bad_info}\n", name="b.yaml")
    with pytest.raises(ConversionError, match=r"dataset_info.json is not valid JSON \(line 1"):
        convert_file(path)
    path = write(tmp_path, "model_name_or_path: x\nstage: sft\nfinetuning_type: oft\n", name="c.yaml")
    with pytest.raises(ConversionError, match=r"finetuning_type: oft is not one ZeRO-Pipe knows"):
        convert_file(path)
