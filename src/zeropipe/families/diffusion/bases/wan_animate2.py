"""Wan Animate 2 (``wan-animate-2``; diffusers 0.42 ships it only as ``WanAnimate2ModularPipeline`` with ``WanAnimate2Blocks``,
and the few-step ``WanAnimate2DistilledModularPipeline``): a character image animated with a driving clip's motion.

Read from diffusers' blocks and ``WanAnimate2Transformer3DModel`` (not Wan's transformer: its own module names, the
original Wan layout's, and an in-context reference mechanism):

- *Two passes per denoiser call.* ``WanAnimate2RefExtractStep`` runs the transformer once over the driving clip
  (``kv_cache_mode="extract"``: its latents, under an all-ones mask and its own latents as the condition, the fixed
  reference prompt ``人物动作的参考视频`` and the CLIP features of its first frame, at a fixed timestep) and keeps every
  layer's keys and values; ``WanAnimate2SegmentDenoiseInner`` then calls it on the noisy latents
  (``kv_cache_mode="cached"``): one latent frame more than the clip (the reference image's slot, first), its condition
  the reference image's latents under a ones mask then a black clip's under a zero mask (the first segment), the prompt
  and the reference image's CLIP features; each generation frame attends to every generation token and to the driving
  frame before it (the reference tokens at its own frame index). ``WanAnimate2Call.predict`` is those two calls, held
  to the blocks by ``tests/unit/diffusion/test_wan_animate2.py``.
- *The attention of the generation pass.* diffusers runs it as FlexAttention over a ``BlockMask``, which has no backward
  on the CPU (torch 2.13: "FlexAttention does not support backward on CPU") and needs ``torch.compile`` to fit at video
  sizes. Training calls the same attention frame by frame (``FrameAlignedAttention``: per generation frame, its queries
  against all generation keys and that frame's reference keys, through diffusers' attention dispatch): the same
  arithmetic as the mask, differentiable on any device, never materialising a mask; the unit test holds it to the flex
  processor's output.
- *Training.* The clip's latents are the target of the frames after the reference slot; the slot is given the reference
  image's latents noised at the batch's noise level (the pipeline draws it with the rest and drops it after decoding) and
  is left out of the loss. A clip from its video's first frame trains as a first segment (a black previous segment); one
  starting later as a continuation segment, its own first frame carried clean under a ones mask where the pipeline
  carries the previous segment's decoded last frame (``parts/animate_reference.py``; held to
  ``WanAnimate2SegmentPrevFramesStep`` at k=1 by the unit test).
- *Prompts.* The pipeline's text block (``WanAnimate2TextEncoderStep``), one prompt per call as it takes them; its
  ``prompt_embeds`` and the reference prompt's ``prompt_ref_embeds`` are cached per caption.
- *Samples.* The modular pipeline's run is not called (``sampler.pipeline_call`` refuses a modular pipeline): its segment
  loop (``WanAnimate2DenoiseStep``) through the shared loop (``sampler.denoise``) with the entry's call and classifier-free
  guidance against the empty prompt (the pipeline's guider; its unconditional branch skips layer 9 of the transformer,
  ``is_uncondtion``), the first data item's reference image and driving clip as the conditions. Segments are as long as
  the longest training clip: a sample as long (``data.video.sample_frames`` unset) is one segment; a longer one is drawn
  segment by segment, each decoded and its last frame carried into the next, the driving clip zigzag-padded to whole
  segments and the result trimmed to its length, as the pipeline draws a long clip.
- *The distilled variant* (``wan-animate-2-distilled``) is the same transformer and call; its blocks differ only in the
  guider's default scale (1.0: no classifier-free guidance) and few steps, so its samples take no guidance.
"""

from __future__ import annotations

import dataclasses

import torch

from zeropipe.families.diffusion.bases.wan import WAN_SCHEDULER
from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.modular import TextEncoderBlock
from zeropipe.families.diffusion.parts import PerChannelVideoLatents
from zeropipe.families.diffusion.parts.animate_reference import AnimateClipFeatures, AnimateReference
from zeropipe.families.diffusion.roles import Assembly, DenoiserCall, ExportLayouts, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_umt5
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

MASK_CHANNELS = 4  # the i2v mask's channels: the VAE's temporal factor (get_i2v_mask)
CLIP_HIDDEN = 1280  # MLPProj(1280, dim): the transformer reads CLIP ViT-H's width
CLIP_TOKENS = 257  # CLIP ViT-H/14 at 224 px: 16 x 16 patches and the class token


def frame_aligned_attention_processor():
    """A ``WanAnimate2AttnProcessor`` whose generation pass attends frame by frame (see the module); the reference pass is the processor's own."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2AttnProcessor, _get_qkv_projections, rope_apply

    class FrameAlignedAttention(WanAnimate2AttnProcessor):
        def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1, reference_rotary_emb=None,
                     reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None, origin_latent_frames=None, origin_latent_hw=None):
            if kv_cache_mode != "cached":
                return super().__call__(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=rope_stride)
            query, key, value = _get_qkv_projections(attn, hidden_states, None)
            query, key = attn.norm_q(query), attn.norm_k(key)
            query, key, value = (tensor.unflatten(2, (attn.heads, -1)) for tensor in (query, key, value))
            query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
            key_ref, value_ref = kv_cache.get()
            key_ref = rope_apply(key_ref, reference_grid_sizes, reference_rotary_emb, reference_rope_stride).type_as(value)
            frames, height, width = grid_sizes[0].tolist()
            ref_frames, ref_height, ref_width = reference_grid_sizes[0].tolist()
            hw = height * width
            # The block mask is built for the full segment: this equals it where the generation grid is the segment's
            # (one frame more than the reference's, the same frame size), as every training call and sample is.
            if frames != origin_latent_frames + 1 or hw != origin_latent_hw or ref_height * ref_width != hw or ref_frames != origin_latent_frames:
                raise ValueError(f"frame-aligned attention needs the segment's grid: {frames}x{hw} generation tokens for {ref_frames}x{ref_height * ref_width} reference tokens "
                                 f"(segment: {origin_latent_frames} latent frames of {origin_latent_hw} tokens)")
            valid = frames * hw
            keys, values = key[:, :valid], value[:, :valid]
            out = []
            for frame in range(frames):
                frame_keys, frame_values = keys, values
                if frame >= 1:  # the driving frame before it: generation frame 0 is the reference image's slot
                    rows = slice((frame - 1) * hw, frame * hw)
                    frame_keys = torch.cat([keys, key_ref[:, rows]], dim=1)
                    frame_values = torch.cat([values, value_ref[:, rows].type_as(value)], dim=1)
                out.append(dispatch_attention_fn(query[:, frame * hw : (frame + 1) * hw], frame_keys, frame_values, attn_mask=None))
            hidden = torch.cat([*out, query[:, valid:]], dim=1).flatten(2, 3).type_as(query)
            return attn.to_out[1](attn.to_out[0](hidden))

    return FrameAlignedAttention()


def use_frame_aligned_attention(module) -> None:
    """Give every self-attention of the transformer the frame-aligned processor (once; a no-op after)."""
    blocks = getattr(module, "blocks", ())
    if blocks and type(blocks[0].self_attn.processor).__name__ != "FrameAlignedAttention":
        for block in blocks:
            block.self_attn.processor = frame_aligned_attention_processor()


def i2v_mask(frames: int, height: int, width: int, ones: bool, like: torch.Tensor) -> torch.Tensor:
    """The blocks' 4-channel mask (``get_i2v_mask``) over whole latent frames: all ones or all zeros, (batch, 4, frames, h, w)."""
    fill = torch.ones if ones else torch.zeros
    return fill(like.shape[0], MASK_CHANNELS, frames, height, width, device=like.device, dtype=like.dtype)


class WanAnimate2Call(DenoiserCall):
    """The driving clip's reference pass, then the generation pass over the reference image's slot and the clip (see the module)."""

    def reference_pass(self, model, module, condition, timesteps, dtype):
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        driving = condition["driving_latents"].to(dtype)
        batch, _, frames, height, width = driving.shape
        patch = module.config.patch_size
        # One row per sample: the transformer applies the reference's rotary embedding to as many samples as this grid has rows.
        grid = torch.tensor([[frames // patch[0], height // patch[1], width // patch[2]]]).repeat(batch, 1)
        cache = WanAnimate2KVCache(module.config.num_layers)
        driving_condition = torch.cat([i2v_mask(frames, height, width, True, driving), driving], dim=1)
        model(
            hidden_states=list(driving), timestep=timesteps.float(), encoder_hidden_states=list(condition["prompt_ref_embeds"].to(dtype)),
            encoder_hidden_states_image=condition["driving_clip"].to(dtype), condition_latents=list(driving_condition), kv_cache=cache,
            kv_cache_mode="extract", seq_len=int(grid[0].prod()), offset_grid_sizes=grid,
        )
        return cache, grid

    def generation_inputs(self, model_input, timesteps, condition, cache, grid, context, unconditional=False):
        """The generation pass's keyword arguments (``WanAnimate2SegmentDenoiseInner``'s call) for latents with the reference slot first."""
        dtype = model_input.dtype
        batch, _, frames, height, width = model_input.shape
        reference = condition["reference_latents"].to(dtype)
        segment = condition["segment_latents"].to(dtype)
        # The previous segment's mask: ones over its carried frames for a later segment; all zeros (a first segment) without one.
        segment_mask = condition["segment_mask"].to(dtype) if condition.get("segment_mask") is not None else i2v_mask(segment.shape[2], height, width, False, segment)
        conditioning = torch.cat([
            torch.cat([i2v_mask(1, height, width, True, reference), reference], dim=1),
            torch.cat([segment_mask, segment], dim=1),
        ], dim=2)
        pixel_frames = (frames - 2) * self.record.codec.frame_multiple + 1  # the segment: frames after the slot, in pixels
        factor = context.vae_factor
        return {
            "hidden_states": list(model_input), "timestep": timesteps.float(), "encoder_hidden_states": list(condition["prompt_embeds"].to(dtype)),
            "encoder_hidden_states_image": condition["reference_clip"].to(dtype), "condition_latents": list(conditioning), "kv_cache": cache,
            "kv_cache_mode": "cached", "seq_len": frames * height * width // 4, "reference_grid_sizes": grid, "origin_len": pixel_frames,
            "origin_area": [height * factor, width * factor], "is_uncondtion": unconditional,
        }

    def velocity(self, model, latents, timesteps, condition, context, unconditional=False):
        """The velocity of latents (batch, 16, 1 + clip frames, h, w) whose first frame is the reference image's slot, for every frame."""
        module = getattr(model, "module", model)
        use_frame_aligned_attention(module)
        # The reference pass reads the reference prompt and the driving frame's CLIP features, also for the unconditional branch.
        cache, grid = self.reference_pass(model, module, condition, timesteps, latents.dtype)
        inputs = self.generation_inputs(latents, timesteps, condition, cache, grid, context, unconditional)
        # The frame-aligned attention reads no block mask: the transformer is told it has this segment's, so that it does not
        # compile one (torch.compile of create_block_mask, seconds per segment size) for nothing.
        module.block_masks.setdefault((inputs["origin_len"] // 4 + 1, inputs["origin_area"][0] * inputs["origin_area"][1] // 256), None)
        out = model(**inputs, return_dict=False)[0]
        return torch.stack(out).to(latents.dtype)

    def predict(self, model, model_input, timesteps, condition, context):
        """The velocity of the clip's frames: the reference image's slot put before them, noised at each clip's noise level
        (flow: (1 - s) x0 + s noise; the pipeline draws it with the rest and drops it after decoding), and left out of the output."""
        import hashlib

        sigma = (timesteps.float() / 1000).view(-1, 1, 1, 1, 1).to(model_input.dtype)
        reference = condition["reference_latents"].to(model_input.dtype)
        # The slot's noise is a function of the batch's noise levels: the same batch gets the same prediction (the fixed-batch
        # loss, a resumed run, an export compared with the run), different batches different noise.
        seed = int.from_bytes(hashlib.sha256(timesteps.detach().float().cpu().numpy().tobytes()).digest()[:8], "little")
        noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed)).to(reference.device, reference.dtype)
        slot = (1 - sigma) * reference + sigma * noise
        return self.velocity(model, torch.cat([slot, model_input], dim=2), timesteps, condition, context)[:, :, 1:]

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        """The planner's trace: one reference-pass call over the tokens of both passes (the driving clip's frames, the slot and the
        clip's frames: 2 x frames + 1 latent frames). Training keeps both passes' activations for the backward, the same per-token
        layers over the same token count; the trace cannot run the generation pass itself, whose attention reads a key/value
        cache and a block mask that a model on the meta device cannot build."""
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        frames = 2 * latent_frames + 1
        channels = config.out_dim
        grid = torch.tensor([[frames, latent_side // 2, latent_side // 2]], device="cpu")
        return {
            "hidden_states": [torch.randn(channels, frames, latent_side, latent_side, dtype=dtype)], "timestep": torch.tensor([500.0]),
            "encoder_hidden_states": [torch.randn(text_tokens, config.text_dim, dtype=dtype)],
            "encoder_hidden_states_image": torch.randn(1, CLIP_TOKENS, CLIP_HIDDEN, dtype=dtype) if config.use_img_emb else None,
            "condition_latents": [torch.randn(config.in_dim - channels, frames, latent_side, latent_side, dtype=dtype)],
            "kv_cache": WanAnimate2KVCache(config.num_layers), "kv_cache_mode": "extract", "seq_len": int(grid.prod()), "offset_grid_sizes": grid,
        }


class WanAnimate2Prompts(TextEncoderBlock):
    """The pipeline's text block, one prompt per call; the prompt's and the reference prompt's embeddings, at Wan's 512 tokens (a tiny tokenizer's fewer)."""

    def encode_prompts(self, pipeline, prompts, device):
        from zeropipe.families.diffusion.modular import run_block

        length = min(int(pipeline.tokenizer.model_max_length), 512)
        block = pipeline.blocks.sub_blocks[self.block]
        runs = [run_block(pipeline, block, ("prompt_embeds", "prompt_ref_embeds"), prompt=prompt, max_sequence_length=length) for prompt in prompts]
        return {name: torch.cat([run[name] for run in runs]) for name in ("prompt_embeds", "prompt_ref_embeds")}

    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(self.record.tokenizer_length(tokenizer))


class WanAnimate2Sampling(Sampling):
    """The sample drawn segment by segment through the shared loop, as the pipeline's segment loop (see the module)."""

    guided = True  # the distilled variant samples without classifier-free guidance

    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"condition": condition, "negative": negative, "guidance_scale": guidance_scale if self.guided else 1.0}

    def draw(self, pipeline, kwargs):
        """The latents of every segment after its reference slot, on the frame axis (``WanAnimate2DenoiseStep``): per segment the
        driving clip's slice encoded alone, the previous segment's decoded last ``carried_frames`` frames (none for the first)
        followed by black as its previous-segment frames, fresh noise and a reset scheduler; ``decoded`` joins their pixels."""
        from diffusers.modular_pipelines.wan_animate_2.encoders import get_i2v_mask

        from zeropipe.families.diffusion.parts.animate_reference import segment_geometry, vae_latents, vae_pixels, zigzag_padded

        animate = kwargs["animate"]
        frames = int(kwargs.get("num_frames") or self.record.codec.clip_length(1))
        segment, carried = int(animate["segment_frames"]), int(animate["carried_frames"])
        padding, segments = segment_geometry(frames, segment, carried)
        driving = zigzag_padded(animate["driving_pixels"], padding)
        fixed = {name: value for name, value in animate.items() if name in ("reference_latents", "reference_clip", "driving_clip")}
        batch = kwargs["condition"]["prompt_embeds"].shape[0]
        drawn, previous = [], None
        for index in range(segments):
            start = index * (segment - carried)
            driving_latents = vae_latents(pipeline.vae, driving[:, :, start : start + segment])
            count = carried if index else 0
            previous_pixels = torch.zeros(batch, *driving.shape[1:2], segment, *driving.shape[3:])
            if count:
                previous_pixels[:, :, :count] = previous[:, :, -count:].cpu()
            previous_latents = vae_latents(pipeline.vae, previous_pixels)
            latent_count, height, width = previous_latents.shape[2:]
            mask = get_i2v_mask(latent_count, height, width, count, device="cpu")[None].expand(batch, -1, -1, -1, -1)
            inputs = {**fixed, "driving_latents": driving_latents, "segment_latents": previous_latents, "segment_mask": mask}
            latents = self.draw_segment(pipeline, kwargs, inputs, segment)[:, :, 1:]  # the reference image's slot is not video
            drawn.append(latents)
            if index + 1 < segments:
                previous = vae_pixels(pipeline.vae, latents)
        return torch.cat(drawn, dim=2)

    def decoded(self, pipeline, latents, kwargs, decode):
        """The segments decoded one by one (the VAE is causal in time), a later one without its carried frames, trimmed to the sample's length."""
        animate = kwargs["animate"]
        frames = int(kwargs.get("num_frames") or self.record.codec.clip_length(1))
        segment, carried = int(animate["segment_frames"]), int(animate["carried_frames"])
        latent_frames = (segment - 1) // self.record.codec.frame_multiple + 1
        pieces = [decode(piece)[:, :, carried if index else 0 :] for index, piece in enumerate(latents.split(latent_frames, dim=2))]
        return torch.cat(pieces, dim=2)[:, :, :frames]

    def draw_segment(self, pipeline, kwargs, inputs, frames):
        """One segment of ``frames`` frames through the shared loop, with the reference image's slot first (its latents, all of them)."""
        from zeropipe.families.diffusion.core import PredictContext
        from zeropipe.families.diffusion.sampler import denoise

        model = pipeline.transformer
        module = getattr(model, "module", model)
        parameter = next(module.parameters())
        device, dtype = parameter.device, parameter.dtype
        factor = pipeline.zeropipe_vae_factor
        condition, negative = kwargs["condition"], kwargs["negative"]
        batch = condition["prompt_embeds"].shape[0]
        animate = {name: value.to(device).expand(batch, *value.shape[1:]) for name, value in inputs.items()}
        latent_frames = (frames - 1) // self.record.codec.frame_multiple + 1
        shape = (batch, module.config.out_dim, latent_frames + 1, kwargs["height"] // factor, kwargs["width"] // factor)
        latents = torch.randn(shape, generator=kwargs["generator"]).to(device)
        context = PredictContext(device, dtype, factor, 1.0)
        scale = float(kwargs["guidance_scale"])
        pipeline.scheduler.set_timesteps(int(kwargs["num_inference_steps"]), device=device)
        conditional = {**condition, **animate}
        unconditional = {**condition, **{name: value.expand(batch, *value.shape[1:]) for name, value in negative.items()}, **animate}
        # The reference pass always reads the reference prompt (the guider splits only the prompt and is_uncondtion).
        unconditional["prompt_ref_embeds"] = condition["prompt_ref_embeds"]

        def model_output(index, t, current):
            times = t.expand(batch).to(device)
            velocity = self.entry.call.velocity(model, current.to(dtype), times, conditional, context).float()
            if scale > 1:
                other = self.entry.call.velocity(model, current.to(dtype), times, unconditional, context, unconditional=True).float()
                velocity = other + scale * (velocity - other)
            return velocity

        return denoise(pipeline.scheduler, latents, pipeline.scheduler.timesteps, model_output)


# diffusers attention names -> the official checkpoint's (the inverse of convert_wan_animate_2_transformer_to_diffusers).
ORIGINAL_ATTENTION = (("to_out.0", "o"), ("to_q", "q"), ("to_k", "k"), ("to_v", "v"), ("add_k_proj", "k_img"), ("add_v_proj", "v_img"))


def original_module_name(module: str) -> str:
    """A WanAnimate2Transformer3DModel module name in the official checkpoint's layout: each block is wrapped in an in-context
    module (``blocks.0.self_attn.to_q`` -> ``blocks.0.block.self_attn.q``); names outside the blocks are the same."""
    if not module.startswith("blocks."):
        return module
    index, _, rest = module[len("blocks."):].partition(".")
    for diffusers_name, original in ORIGINAL_ATTENTION:
        if rest.endswith("." + diffusers_name) and rest.split(".")[0] in ("self_attn", "cross_attn"):
            rest = rest[: -len(diffusers_name)] + original
            break
    return f"blocks.{index}.block.{rest}"


class WanAnimate2Layouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<official module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha`` (``diffusion_model.blocks.0.block.self_attn.q``),
        each name checked against diffusers' converter of the official checkpoint: it must convert back to the module trained."""
        from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers

        modules = sorted({key.partition(".lora_")[0] for key in layers})
        originals = {module: original_module_name(module) for module in modules}
        converted = convert_wan_animate_2_transformer_to_diffusers({f"{original}.weight": torch.empty(0) for original in originals.values()})
        wrong = [module for module, original in originals.items() if f"{module}.weight" not in converted]
        if wrong:
            raise ValueError(f"the official Wan Animate 2 names of {', '.join(wrong[:3])} do not convert back to them with diffusers' converter")
        return comfy_lora_layout(layers, alpha, rename=originals.__getitem__)


class WanAnimate2Assembly(Assembly):
    def tiny_component(self, name, fields):
        if name == "image_encoder":  # CLIP ViT-H's width (the transformer's MLPProj reads 1280), two thin layers
            from transformers import CLIPVisionConfig, CLIPVisionModel

            return CLIPVisionModel(CLIPVisionConfig(**fields))
        return super().tiny_component(name, fields)


ARCHITECTURE = Architecture(
    record=Record(
        name="wan-animate-2",
        trace_frames=81,  # the blocks' segment_frame_length
        pipeline_class="WanAnimate2ModularPipeline",
        denoiser="transformer",
        denoiser_class="WanAnimate2Transformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        # The blocks' fps default: the model generates at 24 frames per second.
        codec=PerChannelVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=24.0),
        conditions=(AnimateReference(), AnimateClipFeatures()),
        preset_name="tiny-wan-animate-2",
        preset={
            "transformer": {
                "patch_size": [1, 2, 2], "text_len": 64, "in_dim": 16 + MASK_CHANNELS + 16, "dim": 32, "ffn_dim": 64, "freq_dim": 32, "text_dim": 32,
                "out_dim": 16, "num_heads": 2, "num_layers": 2,
            },
            "vae": {
                "base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4,
            },
            "text_encoder": tiny_umt5(),
            "image_encoder": {"hidden_size": CLIP_HIDDEN, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 224, "patch_size": 32,
                              "projection_dim": 32},
            "scheduler": WAN_SCHEDULER,
        },
        # Every linear layer of the blocks' attention (the generation and reference passes share them) and feed-forward.
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.0", "ffn.2"),
        tokenizer_lengths={"tokenizer": 64},
        trace_tokens=512,
    ),
    call=WanAnimate2Call(),
    prompts=WanAnimate2Prompts(),
    sampling=WanAnimate2Sampling(),
    layouts=WanAnimate2Layouts(),
    assembly=WanAnimate2Assembly(),
)



class WanAnimate2DistilledSampling(WanAnimate2Sampling):
    guided = False  # WanAnimate2DistilledSegmentDenoiseInner's guider: guidance_scale 1.0, the conditional branch only


DISTILLED = Architecture(
    record=dataclasses.replace(ARCHITECTURE.record, name="wan-animate-2-distilled", pipeline_class="WanAnimate2DistilledModularPipeline",
                               preset_name="tiny-wan-animate-2-distilled"),
    call=ARCHITECTURE.call,
    prompts=ARCHITECTURE.prompts,
    sampling=WanAnimate2DistilledSampling(),
    layouts=ARCHITECTURE.layouts,
    assembly=ARCHITECTURE.assembly,
)

__all__ = ["ARCHITECTURE", "DISTILLED", "WanAnimate2Call", "frame_aligned_attention_processor", "use_frame_aligned_attention"]
