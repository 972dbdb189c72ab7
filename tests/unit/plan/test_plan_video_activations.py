"""The planner's video activation term against the bytes autograd really saves, on the tiny Wan transformer.

A video transformer attends over tokens = latent frames x latent height x latent width /
patch volume (Wan: 4x temporal and 8x spatial VAE compression, 1x2x2 patches), so its
activations grow with the clip length as with the resolution. The planner traces the
transformer on the meta device at the run's resolution and longest frame bucket; here the
same transformer runs for real on the CPU in bf16 inside ``saved_tensors_hooks`` and every
tensor packed for backward is added up, once per storage, leaving out the parameters.
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.families import model_spec as spec_from_config
from zeropipe.plan.activations import saved_activation_bytes
from zeropipe.plan.memory import Choice
from zeropipe.plan.model_spec import video_tokens

TOLERANCE = 0.15
RESOLUTION = 64
WAN = architecture_named("wan")


def run_config(frames: int, checkpointing: bool = False) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"config": {"pipeline": "tiny-wan"}, "gradient_checkpointing": checkpointing},
            "data": {"synthetic": {"task": "shapes"}, "images": {"resolution": RESOLUTION, "bucket_step": 16}, "video": {"frame_buckets": [1, frames]}},
        }
    )


def measured_saved_bytes(frames: int, checkpointing: bool) -> int:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    # torch's Module.to, as the planner casts: DeepSpeed's bf16 engine casts every parameter too.
    model = torch.nn.Module.to(WanTransformer3DModel(**WAN.record.preset["transformer"]), torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    latent = RESOLUTION // 8
    latents = torch.randn(1, 16, (frames - 1) // 4 + 1, latent, latent, dtype=torch.bfloat16)
    text = torch.randn(1, WAN.record.tokenizer_length("tokenizer"), 32, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text, return_dict=False)[0]
    assert out.requires_grad
    return sum(saved.values())


@pytest.mark.parametrize("frames", [9, 33])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_video_activation_term_matches_saved_tensors(frames, checkpointing):
    spec = spec_from_config(run_config(frames, checkpointing))
    assert spec.activation_trace is not None and spec.activation_trace.frames == frames
    planned = saved_activation_bytes(spec, Choice(precision="bf16", gradient_checkpointing=checkpointing, micro_batch_size=1))
    real = measured_saved_bytes(frames, checkpointing)
    assert abs(planned - real) <= TOLERANCE * real, f"planned {planned:,} bytes, autograd saved {real:,} ({planned / real - 1:+.1%})"


def test_video_tokens_are_frames_times_area_over_patch_volume():
    from types import SimpleNamespace

    wan_14b = SimpleNamespace(patch_size=(1, 2, 2))
    # Wan's 480p clip: 81 frames -> 21 latent frames; 832x480 -> 104x60 latents -> 52x30 patches.
    assert video_tokens(wan_14b, 81, 640) == 21 * 40 * 40
    assert video_tokens(wan_14b, 1, 640) == 40 * 40  # an image is one latent frame
    # Four times the frames: about four times the activations (the text tokens stay).
    short, long = (spec_from_config(run_config(frames)).activation_trace.saved_bytes for frames in (9, 33))
    tokens_short, tokens_long = (video_tokens(wan_14b, frames, RESOLUTION) for frames in (9, 33))
    assert tokens_long / tokens_short == 3.0  # 3 -> 9 latent frames
    assert 2.0 < long / short <= 3.0
