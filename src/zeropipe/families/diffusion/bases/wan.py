"""Wan 2.1 / 2.2: a video transformer (3D patches, UMT5 text) on a causal 3D VAE, trained with flow matching.

Latents are (batch, 16, frames, height, width) with 4x temporal and 8x spatial compression,
so clips are 4k+1 frames (an image is one frame) at 16 fps. The VAE's latents are normalised
per channel (``latents_mean`` / ``latents_std`` in its config), as WanPipeline decodes them.
Wan 2.2 A14B's two experts are two transformers that split the timesteps at a boundary; each
is trained alone by restricting ``model.diffusion.min_t`` / ``max_t`` (see docs/video.md).

The LoRA of a Wan run is also written in the original key layout that ComfyUI and
diffusion-pipe use (``diffusion_model.blocks.0.self_attn.q.lora_A.weight``), checked name by
name against diffusers' own converter of original Wan checkpoints.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import comfy_lora_layout
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import PerChannelVideoLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_umt5
from zeropipe.families.diffusion.tiny.tokenizers import character_t5_tokenizer

# diffusers module names -> the original Wan names (inverse of diffusers' convert_wan_transformer_to_diffusers).
ORIGINAL_NAMES = (
    ("attn1.to_out.0", "self_attn.o"), ("attn2.to_out.0", "cross_attn.o"),
    ("attn1.to_q", "self_attn.q"), ("attn1.to_k", "self_attn.k"), ("attn1.to_v", "self_attn.v"),
    ("attn2.to_q", "cross_attn.q"), ("attn2.to_k", "cross_attn.k"), ("attn2.to_v", "cross_attn.v"),
    ("attn2.add_k_proj", "cross_attn.k_img"), ("attn2.add_v_proj", "cross_attn.v_img"),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"), ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"), ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"), ("proj_out", "head.head"),
)


def original_module_name(module: str) -> str:
    """A diffusers WanTransformer3DModel module name in the original Wan layout, e.g. blocks.0.attn1.to_q -> blocks.0.self_attn.q."""
    for diffusers_name, original in ORIGINAL_NAMES:
        if module == diffusers_name or module.endswith("." + diffusers_name):
            return module[: len(module) - len(diffusers_name)] + original
    raise ValueError(f"{module} has no name in the original Wan layout")


class WanPrompts(PromptEncoding):
    """UMT5 prompts through the pipeline's own ``encode_prompt``, at Wan's 512 tokens; a tiny preset's T5-style character tokenizer."""

    def encode_prompts(self, pipeline, prompts, device):
        # Wan trains and samples with 512 tokens (zeros after the prompt's own); a tiny tokenizer says fewer.
        max_length = min(pipeline.tokenizer.model_max_length, 512)
        embeds, _ = pipeline.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, max_sequence_length=max_length, device=device)
        return {"prompt_embeds": embeds}

    def tiny_tokenizer(self, tokenizer):
        return character_t5_tokenizer(self.record.tokenizer_length(tokenizer))


class WanCall(DenoiserCall):
    """The Wan transformer called as ``WanPipeline`` calls it: one timestep per clip, the prompt's UMT5 embeddings
    (and Wan 2.1 I2V's CLIP embeddings of the first frame, None for the others)."""

    def inputs(self, model_input, timesteps, condition, context):
        # Timesteps stay float32 as WanPipeline passes them: bf16 cannot tell 998 from 1000.
        return {
            "hidden_states": model_input, "timestep": timesteps.float(), "encoder_hidden_states": condition["prompt_embeds"],
            "encoder_hidden_states_image": condition.get("image_embeds"),
        }

    def predict(self, model, model_input, timesteps, condition, context):
        # As the pipelines call it: its output as a tuple (the planner's trace takes the inputs alone).
        return self.output(model(**self.inputs(model_input, timesteps, condition, context), return_dict=False))

    def trace_batch(self, config, latent_side, latent_frames, text_tokens, dtype):
        latents = torch.randn(1, config.in_channels, latent_frames, latent_side, latent_side, dtype=dtype)
        return latents, torch.tensor([500.0]), {"prompt_embeds": torch.randn(1, text_tokens, config.text_dim, dtype=dtype)}


class WanSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {"prompt_embeds": condition["prompt_embeds"], "negative_prompt_embeds": negative["prompt_embeds"], "guidance_scale": guidance_scale}


class WanLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.<original module>.lora_A.weight`` / ``lora_B.weight`` / ``.alpha``: what ComfyUI loads for Wan.

        Each name is checked against diffusers' converter of original Wan checkpoints
        (``convert_wan_transformer_to_diffusers``): the original name must convert back to the
        module the adapter was trained on, or the export stops rather than write a LoRA that
        ComfyUI would load onto the wrong layers (or silently skip).
        """
        from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

        modules = sorted({key.partition(".lora_")[0] for key in layers})
        originals = {module: original_module_name(module) for module in modules}
        converted = convert_wan_transformer_to_diffusers({f"{original}.weight": torch.empty(0) for original in originals.values()})
        wrong = [module for module, original in originals.items() if f"{module}.weight" not in converted]
        if wrong:
            raise ValueError(f"the original Wan names of {', '.join(wrong[:3])} do not convert back to them with diffusers' converter")
        return comfy_lora_layout(layers, alpha, rename=originals.__getitem__)


# Wan's own sampler (the diffusers Wan2.1 pipelines ship it): UniPC on flow sigmas with a shift of 3 (480p).
WAN_SCHEDULER = {
    "class": "UniPCMultistepScheduler", "num_train_timesteps": 1000, "prediction_type": "flow_prediction", "use_flow_sigmas": True,
    "flow_shift": 3.0, "solver_order": 2, "solver_type": "bh2", "predict_x0": True, "lower_order_final": True, "final_sigmas_type": "zero",
    "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear", "timestep_spacing": "linspace", "steps_offset": 0,
}


ARCHITECTURE = Architecture(
    record=Record(
        name="wan",
        trace_frames=81,  # WanPipeline's default clip: 5 s at 16 fps
        pipeline_class="WanPipeline",
        related_pipelines=("WanVideoToVideoPipeline",),
        denoiser="transformer",
        denoiser_class="WanTransformer3DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=PerChannelVideoLatents(vae_class="AutoencoderKLWan", frame_multiple=4, frame_rate=16.0),
        preset_name="tiny-wan",
        preset={
            "transformer": {
                "patch_size": [1, 2, 2], "num_attention_heads": 2, "attention_head_dim": 16, "in_channels": 16, "out_channels": 16,
                "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2, "rope_max_seq_len": 32,
            },
            "vae": {
                "base_dim": 16, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True],
                "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16, "scale_factor_spatial": 8, "scale_factor_temporal": 4,
            },
            "text_encoder": tiny_umt5(),
            "scheduler": WAN_SCHEDULER,
        },
        # Every linear layer of the blocks, as diffusion-pipe trains Wan LoRAs (attention and feed-forward).
        lora_targets=("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"),
        # A pipeline built here holds one transformer, the one trained (an A14B expert too): with
        # model_index.json's boundary_ratio it would hand the low noise levels to a transformer_2
        # it does not have. Samples of an expert run use that expert at every noise level.
        pipeline_kwargs={"boundary_ratio": None},
        tokenizer_lengths={"tokenizer": 64},
        trace_tokens=512,  # Wan trains and samples with 512 tokens (see WanPrompts); a tiny tokenizer says fewer
    ),
    call=WanCall(),
    prompts=WanPrompts(),
    sampling=WanSampling(),
    layouts=WanLayouts(),
)
