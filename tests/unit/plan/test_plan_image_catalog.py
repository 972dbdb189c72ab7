"""Chroma, Qwen-Image and Z-Image in the planner's catalog: counted from the real configs on the meta device, with their encoders and a traced transformer."""

from __future__ import annotations

import json

import pytest
import torch

from zeropipe.plan.model_spec import catalog_names, spec_from_catalog


@pytest.mark.parametrize(
    "name,params,text_encoder",
    # Published sizes: Chroma1-HD 8.9B; Qwen-Image 20.43B (with Qwen2.5-VL-7B, 8.29B with its vision tower); Z-Image-Turbo 6.15B (Qwen3-4B).
    [("chroma1-hd", 8.90e9, 4.76e9), ("qwen-image", 20.43e9, 8.29e9), ("z-image-turbo", 6.15e9, 4.02e9)],
)
def test_image_dit_entries_count_their_transformer_text_encoder_and_trace_it(name, params, text_encoder, spec_of):
    assert name in catalog_names()
    spec = spec_of(name)
    assert spec.total_params == pytest.approx(params, rel=0.005) and spec.family == "diffusion_transformer"
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(text_encoder, rel=0.01)
    # The transformer's forward traced at 1024 px through the architecture entry's trace_inputs.
    trace = spec.activation_trace
    assert trace is not None and trace.resolution == 1024 and trace.forward_flops > 0
    assert trace.checkpointed_bytes < trace.saved_bytes / 10


def test_flux2_dev_counts_a_32b_transformer_and_mistral_small_3_1_24b_and_traces_it_at_1024_px(spec_of):
    """FLUX.2 [dev]'s model card says 32B (the config counts 32.22B); Mistral-Small-3.1-24B with its Pixtral tower is 24.01B."""
    assert "flux.2-dev" in catalog_names()
    spec = spec_of("flux.2-dev")
    assert spec.total_params == pytest.approx(32.22e9, rel=0.001) and spec.total_params == pytest.approx(spec.published_params, rel=0.01)
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(24.01e9, rel=0.001)
    assert frozen["vae"] == pytest.approx(84.0e6, rel=0.01)
    # 4096 image tokens (1024 px / 8 / 2 per side) and 512 text tokens, through the entry's trace_inputs.
    trace = spec.activation_trace
    assert trace is not None and trace.resolution == 1024 and trace.forward_flops > 0
    assert trace.checkpointed_bytes < trace.saved_bytes / 10


def test_qwen_image_edit_is_traced_with_the_control_images_tokens_appended():
    """Qwen-Image-Edit shares Qwen-Image's transformer class: its catalog entry names its architecture, whose trace inputs
    double the image tokens (about twice Qwen-Image's activations; spec_from_catalog traces it in about 40 s, so the inputs are checked here)."""
    from types import SimpleNamespace

    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.plan.model_spec import CATALOG_DIR

    assert "qwen-image-edit" in catalog_names() and json.loads((CATALOG_DIR / "qwen-image-edit.json").read_text())["architecture"] == "qwen-image-edit"
    inputs = architecture_named("qwen-image-edit").call.trace_inputs(SimpleNamespace(in_channels=64, joint_attention_dim=3584), 128, 1, 20, torch.float32)
    assert inputs["hidden_states"].shape == (1, 2 * 64 * 64, 64) and inputs["img_shapes"] == [[(1, 64, 64), (1, 64, 64)]]
