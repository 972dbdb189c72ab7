"""The peers' mixture-of-experts keys: LLaMA-Factory's moe_aux_loss_coef, axolotl's lora_target_parameters, experts_implementation, expert_parallel_size."""

from __future__ import annotations

import json

from zeropipe.convert import convert_file


def moe_model(tmp_path):
    folder = tmp_path / "Qwen3-30B-A3B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return folder


def test_llama_factory_moe_aux_loss_coef(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dataset_info.json").write_text(json.dumps({"demo": {"file_name": "demo.json"}}))
    (data / "demo.json").write_text(json.dumps([{"instruction": "q", "input": "", "output": "a"}]))
    path = tmp_path / "qwen3moe_lora_sft.yaml"
    path.write_text(
        f"model_name_or_path: {moe_model(tmp_path)}\nstage: sft\nfinetuning_type: lora\nlora_target: all\nmoe_aux_loss_coef: 0.001\n"
        f"dataset: demo\ndataset_dir: {data}\nlearning_rate: 1.0e-4\n"
    )
    conversion = convert_file(path, "llama-factory")
    assert conversion.entries["model.router_aux_loss_coef"].value == 0.001
    assert "moe_aux_loss_coef" not in dict(conversion.unmapped)


def test_axolotl_moe_keys(tmp_path):
    (tmp_path / "train.jsonl").write_text(json.dumps({"instruction": "a", "input": "", "output": "b"}) + "\n")
    path = tmp_path / "gpt-oss-lora.yml"
    path.write_text(
        f"base_model: {moe_model(tmp_path)}\ndatasets:\n  - path: train.jsonl\n    type: alpaca\nadapter: lora\nlora_r: 8\nlora_alpha: 16\n"
        "lora_dropout: 0.05\nlora_target_modules: [q_proj, v_proj]\nlora_target_parameters:\n  - mlp.experts.gate_up_proj\n  - mlp.experts.down_proj\n"
        "experts_implementation: scattermoe\nexpert_parallel_size: 4\nlearning_rate: 0.0002\nmicro_batch_size: 1\nnum_epochs: 1\n"
    )
    conversion = convert_file(path, "axolotl")
    values = {key: entry.value for key, entry in conversion.entries.items()}
    assert values["model.lora.target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert values["model.lora.dropout"] == 0.0, "peft's LoRA on parameters takes no dropout"
    unmapped = dict(conversion.unmapped)
    assert "grouped_mm" in unmapped["experts_implementation"] and "AutoEP" in unmapped["expert_parallel_size"]
