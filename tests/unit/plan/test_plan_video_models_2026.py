"""The 2026 video models in the planner's catalog: counted from their real configs on the meta device, against the published sizes."""

from __future__ import annotations

import json

import pytest

from zeropipe.plan.model_spec import CATALOG_DIR, _build_component, catalog_names


def counted(name: str) -> tuple[int, dict[str, int]]:
    """(the trained component's parameters, each frozen component's), built on the meta device as the planner builds them (no trace: seconds)."""
    entry = json.loads((CATALOG_DIR / f"{name}.json").read_text())
    frozen = {component["name"].split(" ")[0]: sum(p.numel() for p in _build_component(component).parameters()) for component in entry["frozen"]}
    return sum(p.numel() for p in _build_component(entry["trained"]).parameters()), frozen


@pytest.mark.parametrize(
    "name,published,frozen",
    [
        # Wan2.2-TI2V-5B: "5B" (its name and model card); UMT5-XXL's encoder 5.68B as for every Wan; the Wan 2.2 VAE.
        ("wan2.2-ti2v-5b", 5.0e9, {"text_encoder": 5.68e9, "vae": 704.7e6}),
        # HunyuanVideo 1.5: "8.3B parameters" (its model card and report); Qwen2.5-VL-7B's language model 7.07B; ByT5-small's encoder.
        ("hunyuan-video-1.5", 8.3e9, {"text_encoder": 7.07e9, "text_encoder_2": 217.7e6, "vae": 1.26e9}),
        # Its image-to-video release: the same transformer, and SigLIP so400m's vision tower ("400M", 27 x 27 = 729 image tokens).
        ("hunyuan-video-1.5-i2v", 8.3e9, {"text_encoder": 7.07e9, "text_encoder_2": 217.7e6, "image_encoder": 428.2e6, "vae": 1.26e9}),
        # SkyReels-V2 T2V 14B: Wan 2.1 T2V-14B's configuration (diffusers' converter), whose released bf16 transformer is 28.6 GB.
        ("skyreels-v2-t2v-14b", 14.29e9, {"text_encoder": 5.68e9, "vae": 126.9e6}),
        # SkyReels-V2 I2V 14B: Wan 2.1 I2V-14B's configuration, whose released bf16 transformer is 32.8 GB; CLIP ViT-H/14's vision tower 632M.
        ("skyreels-v2-i2v-14b", 16.4e9, {"text_encoder": 5.68e9, "image_encoder": 632.1e6, "vae": 126.9e6}),
        # Kandinsky 5.0 Video Lite: "2B" (kandinskylab's model cards, musubi-tuner's docs; the config counts 2.01B) and Pro "19B"
        # (19.31B, the same transformer for image-to-video); Qwen2.5-VL-7B with its vision tower and CLIP-L's text model as for
        # Kandinsky 5 T2I; HunyuanVideo's VAE.
        ("kandinsky5-t2v-lite", 2.0e9, {"text_encoder": 8.29e9, "text_encoder_2": 123.1e6, "vae": 246.5e6}),
        ("kandinsky5-t2v-pro", 19.0e9, {"text_encoder": 8.29e9, "text_encoder_2": 123.1e6, "vae": 246.5e6}),
        ("kandinsky5-i2v-pro", 19.0e9, {"text_encoder": 8.29e9, "text_encoder_2": 123.1e6, "vae": 246.5e6}),
    ],
)
def test_video_entries_count_their_transformer_and_frozen_models(name, published, frozen):
    assert name in catalog_names()
    trained, frozen_counts = counted(name)
    assert trained == pytest.approx(published, rel=0.02 if name.startswith("kandinsky5") else 0.01)
    assert frozen_counts == pytest.approx(frozen, rel=0.01)


def test_the_ti2v_entry_traces_its_video_activations_and_hunyuan_video_15_says_it_cannot(spec_of):
    """One trace of the new kind of input (a timestep per token); HunyuanVideo 1.5's forward cannot run on the meta device."""
    trace = spec_of("wan2.2-ti2v-5b").activation_trace
    assert trace is not None and (trace.frames, trace.resolution) == (49, 704) and trace.checkpointed_bytes < trace.saved_bytes / 10
    assert spec_of("hunyuan-video-1.5").activation_trace is None


@pytest.mark.parametrize(
    "name,published",
    [("cosmos-predict2-2b-t2i", 2e9), ("cosmos-predict2-14b-t2i", 14e9), ("cosmos-predict2-2b-video2world", 2e9), ("cosmos-predict2-14b-video2world", 14e9)],
)
def test_cosmos_predict2_counts_its_transformer_against_the_published_size_and_t5_11bs_encoder(name, published):
    """NVIDIA publishes the sizes as names only ("2B", "14B"): diffusers' converter configs count 1.96B and 14.27B, within 2.5%
    (Video2World's condition-mask channel adds a few thousand weights).
    The prompts are google-t5/t5-11b's encoder (4.86B; the original T5 "XXL"), the VAE Wan 2.1's."""
    assert name in catalog_names()
    trained, frozen = counted(name)
    assert trained == pytest.approx(published, rel=0.025)
    assert frozen == pytest.approx({"text_encoder": 4.865e9, "vae": 126.9e6}, rel=0.01)
