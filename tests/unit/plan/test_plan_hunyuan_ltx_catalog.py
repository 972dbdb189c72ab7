"""HunyuanVideo and LTX-Video in the planner's catalog: counted from their real configs on the meta device, with a video trace."""

from __future__ import annotations

import pytest

from zeropipe.plan.model_spec import catalog_names, spec_from_catalog


def test_hunyuan_video_counts_its_13b_transformer_llama_clip_and_vae(spec_of):
    assert "hunyuan-video" in catalog_names()
    spec = spec_of("hunyuan-video")
    # The released transformer: 25.6 GB in bf16 (hunyuan_video_720_cfgdistill_bf16.safetensors).
    assert spec.total_params == pytest.approx(12.82e9, rel=0.005) and spec.family == "diffusion_transformer"
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(7.5e9, rel=0.01)  # llava-llama-3-8b without its LM head
    assert frozen["text_encoder_2"] == pytest.approx(123.1e6, rel=0.01)  # CLIP ViT-L/14's text tower
    assert frozen["vae"] == pytest.approx(246.5e6, rel=0.01)
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 33 and trace.resolution == 512
    assert trace.checkpointed_bytes < trace.saved_bytes / 10


def test_ltx_video_counts_its_2b_transformer_and_t5_and_traces_its_token_sequence(spec_of):
    spec = spec_of("ltx-video-2b")
    # ltx-video-2b-v0.9.safetensors holds 1.92B transformer weights besides its VAE.
    assert spec.total_params == pytest.approx(1.92e9, rel=0.01)
    frozen = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert frozen["text_encoder"] == pytest.approx(4.76e9, rel=0.01)  # T5-v1.1-XXL's encoder
    trace = spec.activation_trace
    assert trace is not None and trace.frames == 121
    # 4,096 video tokens (16 latent frames x 16 x 16) against Wan-14B's 33,600: far fewer bytes per block.
    wan = spec_of("wan2.1-t2v-14b").activation_trace
    assert trace.saved_bytes < wan.saved_bytes / 4
