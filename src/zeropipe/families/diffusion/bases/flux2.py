"""FLUX.2 [dev]: a 32B rectified-flow MMDiT on 2x2-patched latents, conditioned on three stacked hidden layers of Mistral Small 3.

What ``Flux2Pipeline`` does, and so what training does here:

- Latents: the VAE (``AutoencoderKLFlux2``, 32 channels at 1/8 of the pixels) is followed by a
  2x2 patching into 128 channels (``_patchify_latents``), and *those* are normalised per channel
  by the running mean and variance of a batch-norm layer the VAE holds as weights (``vae.bn``,
  not config). So ``latents_from_vae`` patches the drawn latents before the shared
  normalisation, its ``normalization`` reads the statistics from the VAE's safetensors, and
  ``decode`` unpatches before decoding. The transformer sees one token per patched
  latent pixel (``_pack_latents``: no further patching), with 4-axis position ids (t, h, w, l).
- Prompts: wrapped in the pipeline's chat template with its system message, padded to 512
  tokens, and the hidden states of layers 10, 20 and 30 of Mistral Small 3 (40 layers) are
  stacked along the features (3 x 5120 = 15360, the transformer's ``joint_attention_dim``).
  The transformer gets no text mask; text ids are the token positions (axis l).
  ``text_encoder_layers`` gives those layers as the quarters of the encoder's depth, which is
  what both FLUX.2 pipelines pass (dev: 10/20/30 of 40; klein: 9/18/27 of Qwen3's 36), and
  what a tiny encoder of 4 layers can have.
- Guidance: [dev] is guidance-distilled: the guidance value goes into the transformer
  (``model.diffusion.guidance`` when training, ``generate.guidance_scale`` for samples, as the
  pipeline's ``guidance_scale``), no negative prompt.

The LoRA's original layout is Black Forest Labs' module names under ``diffusion_model.`` with
``lora_A`` / ``lora_B`` (what ai-toolkit writes and ComfyUI loads): the inverse of the key map of
diffusers' converter of such LoRAs (``_convert_non_diffusers_flux2_lora_to_diffusers``), which
reads it back. There q, k and v of each stream are one fused layer (``img_attn.qkv``): their
adapters are stacked into one adapter of their summed rank (block diagonal), which changes the
fused weight exactly as the parts change theirs. That format has no alpha (ComfyUI and diffusers
apply it at scale 1), so the strength ``alpha / r`` is folded into ``lora_B``.

Reference images (FLUX.2's multi-reference editing) are the entry's optional condition
(``parts/reference_images.py``): where ``data.control_paths`` or ``data.control_path`` names them,
each target's references are taken at its bucket, their latents patched and normalised as the
target's and appended to its tokens in order, with the position ids ``Flux2Pipeline``
gives them (``_prepare_image_ids``: time coordinate 10 for the first, 20 for the second, ...);
only the target's tokens of the output are the prediction. The prompt is encoded alone, as the
pipeline does (Mistral does not see the references), so the text cache stays per caption.
Samples call the pipeline with the item's references as its ``image`` list. Without those
settings the entry trains text-to-image, its caches keyed as before.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, Record, original_layout_name
from zeropipe.families.diffusion.parts import ReferenceImages
from zeropipe.families.diffusion.parts.latents import Flux2Latents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import tiny_flux2_transformer, tiny_flux2_vae, tiny_mistral3
from zeropipe.families.diffusion.tiny.tokenizers import character_mistral_tokenizer


# diffusers Flux2Transformer2DModel module (within a block) -> (original module, its part of a fused q/k/v layer or None).
DOUBLE_BLOCK_NAMES = {
    "attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1), "attn.to_v": ("img_attn.qkv", 2), "attn.to_out.0": ("img_attn.proj", None),
    "attn.add_q_proj": ("txt_attn.qkv", 0), "attn.add_k_proj": ("txt_attn.qkv", 1), "attn.add_v_proj": ("txt_attn.qkv", 2), "attn.to_add_out": ("txt_attn.proj", None),
    "ff.linear_in": ("img_mlp.0", None), "ff.linear_out": ("img_mlp.2", None), "ff_context.linear_in": ("txt_mlp.0", None), "ff_context.linear_out": ("txt_mlp.2", None),
}
# Single blocks are fused in diffusers too (q, k, v and the MLP's input are one layer).
SINGLE_BLOCK_NAMES = {"attn.to_qkv_mlp_proj": ("linear1", None), "attn.to_out": ("linear2", None)}
TOP_LEVEL_NAMES = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer", "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer", "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin", "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
}


def text_encoder_layers(text_encoder) -> tuple[int, int, int]:
    """The hidden states FLUX.2 stacks: the encoder's quarters (dev: 10, 20, 30 of Mistral's 40 layers; klein: 9, 18, 27 of Qwen3's 36)."""
    config = text_encoder.config
    depth = int(getattr(config, "text_config", config).num_hidden_layers)
    return depth // 4, depth // 2, 3 * depth // 4


def original_module_name(module: str) -> tuple[str, int | None]:
    """A diffusers FLUX.2 module in Black Forest Labs' layout, and its part of a fused layer: transformer_blocks.0.attn.add_k_proj -> (double_blocks.0.txt_attn.qkv, 1)."""
    return original_layout_name(
        module, (("transformer_blocks.", "double_blocks.", DOUBLE_BLOCK_NAMES), ("single_transformer_blocks.", "single_blocks.", SINGLE_BLOCK_NAMES)),
        TOP_LEVEL_NAMES, "FLUX.2",
    )


def fuse_lora(layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """A diffusers-layout LoRA in BFL's names under ``diffusion_model.``, q/k/v fused, the strength folded into ``lora_B``.

    A fused q/k/v layer's parts (rank r each) become one adapter of rank 3r: ``lora_A`` stacks
    their A matrices, ``lora_B`` holds each B (times alpha / r) in its part's rows and its own
    columns, zeros elsewhere (a part that was not trained keeps zero rows).
    """
    groups: dict[str, dict[int | None, str]] = {}
    for module in sorted({key.partition(".lora_")[0] for key in layers}):
        original, part = original_module_name(module)
        groups.setdefault(original, {})[part] = module
    out: dict[str, torch.Tensor] = {}
    for original, parts in groups.items():
        if None in parts:
            down, up = layers[f"{parts[None]}.lora_A.weight"], layers[f"{parts[None]}.lora_B.weight"]
            up = up * (alpha / down.shape[0])
        else:
            order = sorted(parts)
            downs = [layers[f"{parts[part]}.lora_A.weight"] for part in order]
            ups = [layers[f"{parts[part]}.lora_B.weight"] * (alpha / down.shape[0]) for part, down in zip(order, downs)]
            inner = ups[0].shape[0]  # q, k and v have the same width
            down = torch.cat(downs)
            up = down.new_zeros(3 * inner, down.shape[0])
            column = 0
            for part, part_up in zip(order, ups):
                up[part * inner : (part + 1) * inner, column : column + part_up.shape[1]] = part_up
                column += part_up.shape[1]
        out[f"{COMFY_PREFIX}{original}.lora_A.weight"] = down.contiguous()
        out[f"{COMFY_PREFIX}{original}.lora_B.weight"] = up.contiguous()
    return out


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) patched latents -> (B, H x W, C) tokens, as Flux2Pipeline._pack_latents."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._pack_latents(latents)


def unpack(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, H x W, C) tokens in the row-major order of the pipeline's latent ids -> (B, C, H, W)."""
    return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], height, width)


class Flux2Prompts(PromptEncoding):
    def encode_prompts(self, pipeline, prompts, device):
        # The pipelines pad every prompt to 512 tokens (a tiny preset's tokenizer says fewer).
        tokenizer = getattr(pipeline.tokenizer, "tokenizer", pipeline.tokenizer)  # [dev]'s is a processor holding the tokenizer
        max_length = min(int(getattr(tokenizer, "model_max_length", 512)), self.record.tokenizer_length("tokenizer"))
        embeds, _ = pipeline.encode_prompt(
            prompt=list(prompts), device=device, max_sequence_length=max_length, text_encoder_out_layers=text_encoder_layers(pipeline.text_encoder)
        )
        return {"prompt_embeds": embeds}

    def tiny_tokenizer(self, tokenizer):
        # 256 tokens hold the system message and a caption of single characters; a real tokenizer pads to 512 (encode_prompts).
        return character_mistral_tokenizer(256)


class Flux2Call(DenoiserCall):
    """FLUX.2's transformer on patched latent tokens; its ``predict`` reads the model's config (guidance-distilled or not), so it is written whole."""

    def predict(self, model, model_input, timesteps, condition, context):
        from diffusers import Flux2Pipeline

        batch, _, height, width = model_input.shape  # patched latents: one token per position
        embeds = condition["prompt_embeds"]
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        guidance = torch.full((batch,), context.guidance, device=context.device, dtype=torch.float32) if module.config.guidance_embeds else None
        tokens, ids = pack(model_input), Flux2Pipeline._prepare_latent_ids(model_input)
        references = condition.get("reference_latents")  # (B, N, C, H, W): the reference images condition, where the run has it
        if references is not None:
            # As Flux2Pipeline appends its prepare_image_latents: each reference packed in order, ids with time 10, 20, ...
            listed = [references[:1, number] for number in range(references.shape[1])]
            tokens = torch.cat([tokens, *(pack(references[:, number].to(model_input.dtype)) for number in range(references.shape[1]))], dim=1)
            ids = torch.cat([ids, Flux2Pipeline._prepare_image_ids(listed).to(ids.device).expand(batch, -1, -1)], dim=1)
        out = model(
            hidden_states=tokens, timestep=(timesteps / 1000).to(context.dtype), guidance=guidance, encoder_hidden_states=embeds,
            txt_ids=Flux2Pipeline._prepare_text_ids(embeds).to(context.device), img_ids=ids.to(context.device),
            return_dict=False,
        )[0]
        return unpack(out[:, : height * width], height, width)

    def trace_inputs(self, config, latent_side, latent_frames, text_tokens, dtype):
        tokens = (latent_side // 2) ** 2  # 2x2 patches of the VAE's latents
        return {
            "hidden_states": torch.randn(1, tokens, config.in_channels, dtype=dtype), "timestep": torch.tensor([0.5], dtype=dtype),
            "encoder_hidden_states": torch.randn(1, text_tokens, config.joint_attention_dim, dtype=dtype),
            "img_ids": torch.zeros(1, tokens, 4, dtype=torch.long), "txt_ids": torch.zeros(1, text_tokens, 4, dtype=torch.long),
            "guidance": torch.tensor([4.0], dtype=dtype) if config.guidance_embeds else None,
        }


class Flux2Sampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        # [dev] is guidance-distilled: the pipeline's guidance_scale is the value embedded in the transformer; no negative prompt.
        return {"prompt_embeds": condition["prompt_embeds"], "guidance_scale": guidance_scale}

    def unpack_latents(self, pipeline, latents, size, vae_factor):
        side = size // (vae_factor * 2)
        return unpack(latents, side, side)


class Flux2Layouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight`` ...: BFL's names, as ai-toolkit writes FLUX.2 LoRAs and ComfyUI loads them."""
        return fuse_lora(layers, alpha)


# The attention of both streams in the double blocks and the fused layers of the single blocks, as diffusers' FLUX.2 LoRA script trains.
# A regular expression: a suffix "to_out" would also hit the double blocks' to_out (a ModuleList).
FLUX2_LORA_TARGETS = (
    r".*\.attn\.(to_q|to_k|to_v|to_out\.0|add_q_proj|add_k_proj|add_v_proj|to_add_out)$"
    r"|.*single_transformer_blocks\.\d+\.attn\.(to_qkv_mlp_proj|to_out)$"
)

ARCHITECTURE = Architecture(
    record=Record(
        name="flux2",
        pipeline_class="Flux2Pipeline",
        denoiser="transformer",
        denoiser_class="Flux2Transformer2DModel",
        objective="flow",
        text_encoders=("text_encoder",),
        tokenizers=("tokenizer",),
        patch_factor=2,
        codec=Flux2Latents(vae_class="AutoencoderKLFlux2"),
        preset_name="tiny-flux2",
        preset={
            "transformer": tiny_flux2_transformer(joint_attention_dim=3 * 16, guidance_embeds=True),
            "vae": tiny_flux2_vae(),
            "text_encoder": tiny_mistral3(),
            # FLUX.2's sampler shifts with the resolution (the pipeline computes mu); the tiny one samples with a fixed shift.
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        lora_targets=FLUX2_LORA_TARGETS,
        # Reference images where the settings name them (data.control_paths / data.control_path); text-to-image otherwise.
        conditions=(ReferenceImages(required=False, min_size=64),),  # Flux2ImageProcessor.check_image_input: 64 px or more
        tokenizer_lengths={"tokenizer": 512},  # the pipelines' max_sequence_length: every prompt is padded to it
        image_processor_patch=2,  # latents are patched 2x2
    ),
    call=Flux2Call(),
    prompts=Flux2Prompts(),
    sampling=Flux2Sampling(),
    layouts=Flux2Layouts(),
)
