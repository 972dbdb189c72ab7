"""The planner's activation term for HunyuanVideo and LTX-Video against the bytes autograd really saves, on their tiny transformers.

The planner traces the denoiser on the meta device with the inputs its architecture entry
gives (``Architecture.trace_inputs``); here the same transformer runs for real on the CPU in
bf16 on the same inputs inside ``saved_tensors_hooks``, and every tensor packed for backward
is added up once per storage, leaving out the parameters (as for Wan in test_plan_video_activations).

One kind of tensor is left out of the measurement: attention probabilities (batch, heads, S, S).
On the CPU, attention with a mask (HunyuanVideo's token refiner masks its 256 text tokens)
runs PyTorch's math kernel, which saves them; the planner counts fused attention (GPU kernels
with masks save no S x S term), as it says in its output ("fused attention (no s² term)").
"""

from __future__ import annotations

import pytest
import torch

from zeropipe.config.schema import RunConfig
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.families import model_spec as spec_from_config
from zeropipe.plan.activations import saved_activation_bytes
from zeropipe.plan.memory import Choice

TOLERANCE = 0.15
RESOLUTION = 64


def run_config(preset: str, frames: int, checkpointing: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"config": {"pipeline": preset}, "gradient_checkpointing": checkpointing},
            "data": {"synthetic": {"task": "shapes"}, "images": {"resolution": RESOLUTION, "bucket_step": 16}, "video": {"frame_buckets": [1, frames]}},
        }
    )


def measured_saved_bytes(name: str, frames: int, checkpointing: bool) -> int:
    arch = architecture_named(name)
    torch.manual_seed(0)
    model = torch.nn.Module.to(arch.model_class()(**arch.record.preset["transformer"]), torch.bfloat16)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        probabilities = tensor.dim() == 4 and tensor.shape[-1] == tensor.shape[-2]
        if storage.data_ptr() not in parameters and not probabilities:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    latent_frames = (frames - 1) // arch.record.frame_multiple + 1
    inputs = arch.call.trace_inputs(model.config, RESOLUTION // 8, latent_frames, arch.record.tokenizer_length(arch.record.tokenizers[0]), torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs, return_dict=False)[0]
    assert out.requires_grad
    return sum(saved.values())


@pytest.mark.parametrize("name,preset,frames", [("hunyuan-video", "tiny-hunyuan-video", 9), ("ltx-video", "tiny-ltx-video", 17)])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_video_activation_term_matches_saved_tensors(name, preset, frames, checkpointing):
    spec = spec_from_config(run_config(preset, frames, checkpointing))
    assert spec.activation_trace is not None and spec.activation_trace.frames == frames
    planned = saved_activation_bytes(spec, Choice(precision="bf16", gradient_checkpointing=checkpointing, micro_batch_size=1))
    real = measured_saved_bytes(name, frames, checkpointing)
    assert abs(planned - real) <= TOLERANCE * real, f"planned {planned:,} bytes, autograd saved {real:,} ({planned / real - 1:+.1%})"
