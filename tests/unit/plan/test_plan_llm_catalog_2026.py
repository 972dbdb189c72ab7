"""The dense LLMs and VLMs of 2025-26 in the catalog: each counted from its published config.json, checked against its published size.

A figure published exactly (the Hub's safetensors count) is matched within 0.5%; one published
rounded (a model card's "0.6B", or the Hub's "73.4B") within half a unit of its last digit. A tied
model's Hub count includes the stored copy of the tied output head, so its card figure is used.
"""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR

# (catalog name, published size, tolerance as a fraction or an absolute count, where the figure is published)
PUBLISHED = [
    ("qwen3-0.6b", 0.6e9, 0.05e9, "Qwen/Qwen3-0.6B model card: 0.6B"),
    ("qwen3-1.7b", 1.7e9, 0.05e9, "Qwen/Qwen3-1.7B model card: 1.7B"),
    ("qwen3-4b", 4_022_468_096, 0.005, "Qwen/Qwen3-4B safetensors"),
    ("qwen3-8b", 8_190_735_360, 0.005, "Qwen/Qwen3-8B safetensors"),
    ("qwen3-14b", 14_768_307_200, 0.005, "Qwen/Qwen3-14B safetensors"),
    ("qwen3-32b", 32_762_123_264, 0.005, "Qwen/Qwen3-32B safetensors"),
    ("gemma-3-1b", 999_885_952, 0.005, "google/gemma-3-1b-pt safetensors"),
    ("gemma-3-4b", 4_300_079_472, 0.005, "google/gemma-3-4b-pt safetensors"),
    ("gemma-3-12b", 12_187_325_040, 0.005, "google/gemma-3-12b-pt safetensors"),
    ("gemma-3-27b", 27_432_406_640, 0.005, "google/gemma-3-27b-pt safetensors"),
    ("mistral-small-3-24b", 23_572_403_200, 0.005, "mistralai/Mistral-Small-24B-Base-2501 safetensors"),
    ("phi-4", 14_659_507_200, 0.005, "microsoft/phi-4 safetensors"),
    ("llama-3.3-70b", 70_553_706_496, 0.005, "meta-llama/Llama-3.3-70B-Instruct safetensors"),
    ("qwen2.5-vl-3b", 3_754_622_976, 0.005, "Qwen/Qwen2.5-VL-3B-Instruct safetensors"),
    ("qwen2.5-vl-7b", 8_292_166_656, 0.005, "Qwen/Qwen2.5-VL-7B-Instruct safetensors"),
    ("qwen2.5-vl-72b", 73.4e9, 0.05e9, "Qwen/Qwen2.5-VL-72B-Instruct: 73.4B"),
    ("qwen3-vl-2b", 2_127_532_032, 0.005, "Qwen/Qwen3-VL-2B-Instruct safetensors"),
    ("qwen3-vl-4b", 4_437_815_808, 0.005, "Qwen/Qwen3-VL-4B-Instruct safetensors"),
    ("qwen3-vl-8b", 8_767_123_696, 0.005, "Qwen/Qwen3-VL-8B-Instruct safetensors"),
    ("qwen3-vl-32b", 33.4e9, 0.05e9, "Qwen/Qwen3-VL-32B-Instruct: 33.4B"),
]


@pytest.mark.parametrize("name,published,tolerance,where", PUBLISHED, ids=[p[0] for p in PUBLISHED])
def test_counted_from_the_published_config_matches_the_published_size(spec_of, name, published, tolerance, where):
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    assert entry["source"].endswith("config.json") or "config.json (" in entry["source"], entry["source"]
    assert entry["published_params"] == pytest.approx(published, rel=1e-3), f"the file's published_params is not {where}"
    spec = spec_of(name)
    if tolerance < 1:
        assert spec.total_params == pytest.approx(published, rel=tolerance), where
    else:
        assert abs(spec.total_params - published) <= tolerance, (spec.total_params, where)
    assert spec.trainable_params == spec.total_params and spec.layers and spec.block is not None


def test_vision_language_entries_have_the_parts_the_vlm_family_trains():
    """Qwen2.5-VL and Qwen3-VL: every weight belongs to a part the VLM family knows (an unknown one is an error there)."""
    from zeropipe.config.schema import ModelSection
    from zeropipe.families.vlm.model import trainable_counts
    from zeropipe.plan.model_spec import _build_causal_lm, _hf_config

    for name in ("qwen2.5-vl-3b", "qwen3-vl-2b"):
        model = _build_causal_lm(_hf_config(json.loads((CATALOG_DIR / f"{name}.json").read_text())["config"]))
        everything, _, _ = trainable_counts(model, ModelSection(path="/models/x", trainable=["vision_tower", "projector", "language_model"]))
        default, _, _ = trainable_counts(model, ModelSection(path="/models/x"))
        assert everything == sum(p.numel() for p in model.parameters())
        assert 0 < everything - default < 0.2 * everything  # the frozen vision tower by default


def test_zeropipe_plan_model_qwen3_8b_answers(capsys):
    from zeropipe.cli.main import main

    code = main(["plan", "--model", "qwen3-8b", "--gpus", "1x24GB", "--ram", "64GB", "--lora-r", "16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "Qwen3-8B" in out and "Qwen/Qwen3-8B config.json" in out
