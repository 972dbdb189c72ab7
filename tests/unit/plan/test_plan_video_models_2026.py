"""The 2026 video models in the planner's catalog: counted from their real configs on the meta device, against the published sizes, with a video trace."""

from __future__ import annotations

import pytest

from zeropipe.plan.model_spec import catalog_names


@pytest.mark.parametrize(
    "name,published,frozen,frames,resolution",
    [
        # Wan2.2-TI2V-5B: "5B" (its name and model card); UMT5-XXL's encoder 5.68B as for every Wan; the Wan 2.2 VAE.
        ("wan2.2-ti2v-5b", 5.0e9, {"text_encoder": 5.68e9, "vae": 704.7e6}, 49, 704),
        # HunyuanVideo 1.5: "8.3B parameters" (its model card and report); Qwen2.5-VL-7B's language model 7.07B; ByT5-small's encoder.
        ("hunyuan-video-1.5", 8.3e9, {"text_encoder": 7.07e9, "text_encoder_2": 217.7e6, "vae": 1.26e9}, None, None),
        # Its image-to-video release: the same transformer, and SigLIP so400m's vision tower ("400M", 27 x 27 = 729 image tokens).
        ("hunyuan-video-1.5-i2v", 8.3e9, {"text_encoder": 7.07e9, "text_encoder_2": 217.7e6, "image_encoder": 428.2e6, "vae": 1.26e9}, None, None),
        # SkyReels-V2 T2V 14B: Wan 2.1 T2V-14B's configuration (diffusers' converter), whose released bf16 transformer is 28.6 GB.
        ("skyreels-v2-t2v-14b", 14.29e9, {"text_encoder": 5.68e9, "vae": 126.9e6}, 49, 544),
        # SkyReels-V2 I2V 14B: Wan 2.1 I2V-14B's configuration, whose released bf16 transformer is 32.8 GB; CLIP ViT-H/14's vision tower 632M.
        ("skyreels-v2-i2v-14b", 16.4e9, {"text_encoder": 5.68e9, "image_encoder": 632.1e6, "vae": 126.9e6}, 49, 544),
    ],
)
def test_video_entries_count_their_transformer_and_frozen_models(name, published, frozen, frames, resolution, spec_of):
    assert name in catalog_names()
    spec = spec_of(name)
    assert spec.total_params == pytest.approx(published, rel=0.01) and spec.family == "diffusion_transformer"
    counted = {model.name.split(" ")[0]: model.params for model in spec.frozen_models}
    assert counted == pytest.approx(frozen, rel=0.01)
    trace = spec.activation_trace
    if frames is None:  # not traceable on the meta device (HunyuanVideo 1.5's forward branches on its inputs' values)
        assert trace is None
        return
    assert trace is not None and (trace.frames, trace.resolution) == (frames, resolution)
    assert trace.checkpointed_bytes < trace.saved_bytes / 10
