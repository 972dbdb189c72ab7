"""Kandinsky 6 in the planner's catalog: Pro and Lite counted from their released transformer configs on the meta device, and the
trace's inputs (one clip, its soundtrack's audio latents as the pipeline sizes them, the padded prompt) run by the transformer."""

from __future__ import annotations

import json

import pytest
import torch

from tests.unit.plan.test_plan_kandinsky_krea_ernie_catalog import meta_count
from zeropipe.plan.model_spec import CATALOG_DIR, catalog_names


@pytest.mark.parametrize(("name", "published", "counted"), [("kandinsky6-pro", 29e9, 30_136_326_248), ("kandinsky6-lite", 3e9, 3_176_632_424)])
def test_the_catalog_entries_count_the_released_transformers(name, published, counted):
    assert name in catalog_names()
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    assert entry["architecture"] == "kandinsky6" and entry["source"].startswith("kandinskylab/Kandinsky-6.0-")
    assert meta_count(entry["trained"]) == counted and counted == pytest.approx(published, rel=0.06)
    config = entry["trained"]["config"]
    # The sft heads (the distilled ones predict 10 grids); the text widths are the frozen encoders' (Qwen2.5-VL-7B, CLIP-L).
    assert (config["out_visual_dim"], config["out_audio_dim"]) == (config["in_visual_dim"], config["in_audio_dim"]) == (16, 40)
    text = next(component for component in entry["frozen"] if component["class"] == "Qwen2_5_VLForConditionalGeneration")["config"]
    audio = next(component for component in entry["frozen"] if component["class"] == "MMAudioVAE")["config"]
    assert config["in_text_dim"] == text.get("hidden_size", text.get("text_config", {}).get("hidden_size")) and audio["latent_channels"] == config["in_audio_dim"]


def test_the_trace_is_one_clip_with_its_sound_and_the_padded_prompt():
    """121 frames (31 latent frames) at 24 fps carry 218 audio latents at 44.1 kHz, as the pipeline (and ComfyUI's empty latent) sizes them."""
    from diffusers import Kandinsky6Transformer3DModel

    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named("kandinsky6")
    with torch.device("meta"):
        model = Kandinsky6Transformer3DModel(**arch.record.preset["transformer"])
        inputs = arch.call.trace_inputs(model.config, 4, 31, 16, torch.bfloat16)
        video, audio = model(**inputs, return_dict=False)
    assert inputs["hidden_states"].shape == (1, 31, 4, 4, 33) and inputs["audio_hidden_states"].shape == (1, 218, 8)
    assert video.shape == (1, 31, 4, 4, 16) and audio.shape == (1, 218, 8)
