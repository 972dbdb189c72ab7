"""Lumina 2, HiDream-I1, AuraFlow, Qwen-Image 2.1 and HunyuanImage 2.1 in the planner's catalog: counted from the real configs
on the meta device and checked against the published sizes. Tracing a transformer takes 7 s (Lumina 2) to a minute
(HiDream's 17B): the smallest is traced here, the others' verdicts are in docs/diffusion.md (`zeropipe plan`)."""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR, _build_component, catalog_names

# name -> (the published transformer size, {frozen component: its published size}), each with where it is published.
PUBLISHED = {
    # Lumina-Image 2.0 paper (arXiv 2503.21758): a 2.6B unified DiT; Gemma-2-2B: 2.61B (google/gemma-2-2b, 2,614,341,888).
    "lumina-image-2.0": (2.6e9, {"text_encoder": 2.614e9}),
    # HiDream-I1 model card (HiDream-ai/HiDream-I1-Full): 17B; Llama-3.1-8B-Instruct 8.03B (its model card); T5-XXL's encoder 4.76B.
    "hidream-i1-full": (17.0e9, {"text_encoder_4": 8.03e9, "text_encoder_3": 4.76e9}),
    # AuraFlow v0.3 model card and fal's announcement: 6.8B; its VAE is SDXL's (83.65M, as the sdxl catalog entry counts it).
    "auraflow-v0.3": (6.8e9, {"vae": 83.65e6}),
    # HunyuanImage-2.1's README: "a 17B text-to-image model", rounded down (its config counts 17.43B: within 3%, see ROUNDED);
    # Qwen2.5-VL-7B with its vision tower 8.29B (as the qwen-image entry counts it).
    "hunyuanimage-2.1": (17.0e9, {"text_encoder": 8.29e9}),
}


# Entries whose published size is rounded to the billion: the tolerance that rounding allows.
ROUNDED = {"hunyuanimage-2.1": 0.03}


def params(component: dict) -> int:
    return sum(p.numel() for p in _build_component(component).parameters())


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_2026_image_entries_count_their_transformer_and_encoders_as_published(name):
    assert name in catalog_names()
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    transformer, encoders = PUBLISHED[name]
    assert entry["family"] == "diffusion_transformer" and entry["architecture"] and entry["source"]
    assert params(entry["trained"]) == pytest.approx(transformer, rel=ROUNDED.get(name, 0.01))
    frozen = {component["name"].split(" ")[0]: params(component) for component in entry["frozen"]}
    for component, published in encoders.items():
        assert frozen[component] == pytest.approx(published, rel=0.01), component


def test_lumina_2_is_traced_through_its_entry_with_the_caption_mask(spec_of):
    """The transformer reads the mask's sum as Python integers: the entry makes the mask on the CPU, the rest on meta."""
    spec = spec_of("lumina-image-2.0")
    trace = spec.activation_trace
    assert trace is not None and trace.resolution == 1024 and trace.forward_flops > 0
    assert trace.checkpointed_bytes < trace.saved_bytes / 5
