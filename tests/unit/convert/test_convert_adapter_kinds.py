"""The peers' adapter kinds beyond LoRA map to model.lora.kind: diffusion-pipe's LoKr, LLaMA-Factory's use_dora, axolotl's peft_use_dora."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.convert.test_convert_diffusion_pipe import image_dir, pipeline_dir
from zeropipe.config.schema import LoraSection
from zeropipe.convert import convert_file


def values(conversion) -> dict:
    return {key: entry.value for key, entry in conversion.entries.items()}


def diffusion_pipe_toml(tmp_path: Path, adapter: str) -> Path:
    flux, images = pipeline_dir(tmp_path), image_dir(tmp_path, "photos")
    (tmp_path / "dataset.toml").write_text(f"resolutions = [512]\n[[directory]]\npath = '{images}'\n")
    path = tmp_path / "main.toml"
    path.write_text(
        f"output_dir = '{tmp_path / 'runs'}'\ndataset = 'dataset.toml'\nepochs = 1\nmicro_batch_size_per_gpu = 1\n"
        f"[model]\ntype = 'flux'\ndiffusers_path = '{flux}'\ndtype = 'bfloat16'\n[adapter]\n{adapter}\n[optimizer]\ntype = 'adamw_optimi'\nlr = 1e-4\n"
    )
    return path


def test_diffusion_pipes_lokr_keeps_its_rank_factor_and_full_matrices(tmp_path):
    # diffusion-pipe's example: "very high rank makes it do full-matrix LoKr".
    conversion = convert_file(diffusion_pipe_toml(tmp_path, "type = 'lokr'\nrank = 1e6\ndecompose_factor = 4\ndropout = 0.1\ndtype = 'bfloat16'"))
    got = values(conversion)
    assert (got["model.lora.kind"], got["model.lora.r"], got["model.lora.factor"], got["model.lora.dropout"]) == ("lokr", 1000000, 4, 0.0)
    assert "no dropout" in dict(conversion.unmapped)["adapter.dropout"]
    lora = LoraSection(kind="lokr", r=got["model.lora.r"], alpha=got["model.lora.alpha"], factor=4)
    # peft builds full Kronecker factors at such a rank (no low-rank w1_a/w1_b): one 4 x 4 and one 768 x 768 for a 3072 x 3072 layer.
    from zeropipe.models.adapters import adapter_parameter_sizes

    assert sorted(adapter_parameter_sizes(lora, 3072, 3072)) == [16, 768 * 768]


def test_another_diffusion_pipe_adapter_type_is_listed_and_trained_as_lora(tmp_path):
    conversion = convert_file(diffusion_pipe_toml(tmp_path, "type = 'boft'\nrank = 8"))
    assert values(conversion).get("model.lora.kind") is None and "lora, dora, lokr and loha" in dict(conversion.unmapped)["adapter.type"]


def model_dir(root: Path) -> Path:
    folder = root / "Llama-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


@pytest.mark.parametrize("flag", [True, False])
def test_llama_factory_use_dora_picks_the_kind(tmp_path, flag):
    model = model_dir(tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"demo": {"file_name": "demo.json"}}))
    (data / "demo.json").write_text(json.dumps([{"instruction": "q", "input": "", "output": "a"}]))
    path = tmp_path / "llama3_lora_sft.yaml"
    path.write_text(
        f"model_name_or_path: {model}\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_rank: 8\nuse_dora: {str(flag).lower()}\n"
        f"dataset: demo\ndataset_dir: {data}\noutput_dir: saves/x\nper_device_train_batch_size: 1\nlearning_rate: 1.0e-4\nnum_train_epochs: 1.0\n"
    )
    conversion = convert_file(path)
    assert values(conversion).get("model.lora.kind") == ("dora" if flag else None)
    assert "use_dora" not in dict(conversion.unmapped)
    if not flag:
        assert any(line.startswith("use_dora: false") for line in conversion.already)


def test_axolotl_peft_use_dora_picks_the_kind(tmp_path):
    model = model_dir(tmp_path)
    (tmp_path / "alpaca.jsonl").write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
    path = tmp_path / "axolotl.yml"
    path.write_text(
        f"base_model: {model}\ndatasets:\n  - path: alpaca.jsonl\n    type: alpaca\nadapter: lora\nlora_r: 16\nlora_alpha: 32\n"
        "peft_use_dora: true\nlora_target_linear: true\nmicro_batch_size: 1\nnum_epochs: 1\nlearning_rate: 0.0002\n"
    )
    conversion = convert_file(path)
    assert values(conversion)["model.lora.kind"] == "dora" and "peft_use_dora" not in dict(conversion.unmapped)
