"""Peers' keys for continuing from an adapter (LLaMA-Factory's adapter_name_or_path, axolotl's lora_model_dir) and their optimizers -> ZeRO-Pipe's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from zeropipe.config.load import validate_config
from zeropipe.convert import convert_file


def llama(root: Path) -> Path:
    folder = root / "Llama-tiny"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return folder


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def llama_factory_file(tmp_path: Path, extra: str, method: str = "lora") -> Path:
    model = llama(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"demo": {"file_name": "demo.json"}}))
    (data / "demo.json").write_text(json.dumps([{"instruction": "q", "input": "", "output": "a"}]))
    path = tmp_path / "llama3_lora_sft.yaml"
    path.write_text(
        f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: {method}\nlora_rank: 8\ndataset: demo\ndataset_dir: {data}\n"
        f"output_dir: saves/llama3/lora/sft\n{extra}"
    )
    return path


def test_llama_factorys_adapter_becomes_init_from_and_validates(tmp_path):
    adapter = tmp_path / "saves" / "sft-adapter"
    adapter.mkdir(parents=True)
    conversion = convert_file(llama_factory_file(tmp_path, f"adapter_name_or_path: {adapter}\noptim: adamw_bnb_8bit\n"))
    got = values(conversion)
    assert got["model.lora.init_from"] == str(adapter) and "adapter_name_or_path" in conversion.entries["model.lora.init_from"].comment
    assert got["train.optimizer"] == "adamw8bit"
    assert "adapter_name_or_path" not in dict(conversion.unmapped)
    config = validate_config(yaml.safe_load(yaml.safe_dump(conversion.raw())))
    assert config.model.lora.init_from == str(adapter) and config.train.optimizer == "adamw8bit"


def test_several_adapters_or_a_full_fine_tune_are_listed_with_the_fix(tmp_path):
    conversion = convert_file(llama_factory_file(tmp_path, "adapter_name_or_path: saves/a,saves/b\n"))
    assert "model.lora.init_from" not in conversion.entries and "merge the others" in dict(conversion.unmapped)["adapter_name_or_path"]
    full = tmp_path / "full"
    full.mkdir()
    conversion = convert_file(llama_factory_file(full, "adapter_name_or_path: saves/a\n", method="full"))
    assert "model.lora.init_from" not in conversion.entries and "merge the adapter" in dict(conversion.unmapped)["adapter_name_or_path"]


def test_axolotls_lora_model_dir_and_optimizers(tmp_path):
    model = llama(tmp_path)
    (tmp_path / "alpaca.jsonl").write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
    path = tmp_path / "lora.yml"
    path.write_text(
        f"base_model: {model}\ndatasets:\n  - path: alpaca.jsonl\n    type: alpaca\nadapter: lora\nlora_model_dir: ./outputs/previous\nlora_r: 16\n"
        "micro_batch_size: 1\nnum_epochs: 1\nlearning_rate: 0.0002\noptimizer: muon\n"
    )
    conversion = convert_file(path)
    got = values(conversion)
    assert got["model.lora.init_from"] == "./outputs/previous" and "not on this machine" in conversion.entries["model.lora.init_from"].comment
    assert got["train.optimizer"] == "muon"


@pytest.mark.parametrize(("kind", "expected"), [("AdamW8bit", "adamw8bit"), ("Prodigy", "prodigy")])
def test_diffusion_pipes_optimizer_types_become_train_optimizer(tmp_path, kind, expected):
    from tests.unit.convert.test_convert_diffusion_pipe import image_dir, pipeline_dir, write

    flux = pipeline_dir(tmp_path)
    images = image_dir(tmp_path, "photos")
    path = write(
        tmp_path,
        f"dataset = 'dataset.toml'\n[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\n[optimizer]\ntype = '{kind}'\nlr = 1\nbetas = [0.9, 0.99]\nd_coef = 2\n",
        f"[[directory]]\npath = '{images}'\n",
    )
    conversion = convert_file(path)
    got = values(conversion)
    assert got["train.optimizer"] == expected and got["train.lr"] == 1.0 and got["train.adam_beta2"] == 0.99
