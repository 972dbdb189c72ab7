"""Cosmos 3 Omni (``Cosmos3OmniModularPipeline``, diffusers 0.42.1): the denoiser call of its text-to-vision path (not an entry yet).

``Cosmos3OmniTransformer`` is one Mixture-of-Transformers model over a packed sequence of a single item: the prompt's
token ids (embedded by the transformer itself: there is no separate text encoder), which run the "understanding"
pathway, followed by the noisy VAE latents (Wan 2.2's ``AutoencoderKLWan``, 48 channels, patched 2x2) on the
"generation" pathway, with 3-D mRoPE positions over both and the flow timestep per noisy patch (scaled by
``timestep_scale``). Its output per item is the velocity ``noise - x0`` that the UniPC flow scheduler steps on.

The segments are built by the pipeline's own helpers (``Cosmos3OmniPipeline._prepare_text_segment`` and
``_prepare_vision_segment``, which the modular blocks ``Cosmos3PrepareTextSegmentsStep`` and
``Cosmos3VisionPackSequenceStep`` call) on the transformer's config, so this call is ``Cosmos3LoopDenoiser``'s
conditional pass (held to it in ``tests/unit/diffusion/test_cosmos3.py``). The model takes one item per call: a batch
is called one example at a time, each prompt cut to its own tokens by the cache's mask.

What is not built here (docs/video.md, "Not done yet"): the entry itself (the prompt's tokenization with the
pipeline's system prompt and resolution/duration templates as a prompt part, the Wan 2.2 latents codec with Cosmos 3's
normalisation, a tiny preset, sampling, catalog and example), image-conditioned frames, and the sound and action
streams (``Cosmos3AVAEAudioTokenizer``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zeropipe.families.diffusion.roles import DenoiserCall

TEMPORAL_FACTOR = 4  # Wan 2.2's VAE: 4 frames per latent frame (the pipeline's vae_scale_factor_temporal)


def segments(config, input_ids: list[int], latents: torch.Tensor, fps: float, device) -> tuple[dict, dict]:
    """The text and vision segments of one item, by the pipeline's own helpers (``latents``: (1, C, T, H, W), no condition frame)."""
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    owner = SimpleNamespace(transformer=SimpleNamespace(config=config), vae_scale_factor_temporal=TEMPORAL_FACTOR)
    text = Cosmos3OmniPipeline._prepare_text_segment(owner, input_ids, device)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        owner, input_vision_tokens=latents, has_image_condition=False, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=fps, curr=text["und_len"], device=device, condition_frame_indexes=[],
    )
    return text, vision


class Cosmos3Call(DenoiserCall):
    """``Cosmos3LoopDenoiser``'s conditional pass on vision latents (B, C, T, H, W): one call per example.

    ``condition``: ``input_ids`` (the prompt's token ids, padded) with ``input_ids_mask``, and ``fps`` (one per example;
    24 where absent, the pipeline's default).
    """

    def call_one(self, model, latents: torch.Tensor, timestep: torch.Tensor, input_ids: list[int], fps: float, context) -> torch.Tensor:
        config = getattr(model, "module", model).config
        text, vision = segments(config, input_ids, latents, fps, latents.device)
        out = model(
            input_ids=text["input_ids"], text_indexes=text["text_indexes"],
            position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
            und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
            vision_tokens=[latents.to(context.dtype)], vision_token_shapes=vision["vision_token_shapes"],
            vision_sequence_indexes=vision["vision_sequence_indexes"], vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
            vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), float(timestep), device=latents.device),
            vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False,
        )
        return out[0][0]  # the item's (1, C, T, H, W) velocity: every frame noisy, nothing masked

    def predict(self, model, model_input, timesteps, condition, context):
        ids, mask = condition["input_ids"], condition["input_ids_mask"].bool()
        fps = condition.get("fps")
        return torch.cat([
            self.call_one(model, model_input[index : index + 1], timesteps[index], ids[index][mask[index]].tolist(),
                          24.0 if fps is None else float(fps[index]), context)
            for index in range(model_input.shape[0])
        ])


__all__ = ["Cosmos3Call", "segments"]
