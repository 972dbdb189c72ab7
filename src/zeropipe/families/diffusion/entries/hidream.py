"""HiDream-I1: a 17B sparse (mixture-of-experts) DiT on the Flux VAE's latents, conditioned on two CLIPs, T5-XXL and Llama 3.1 8B.

``HiDreamImagePipeline`` encodes every prompt four times: the two CLIPs' pooled projections
(concatenated: the timestep's conditioning), T5-XXL's last hidden states and *every* hidden
layer of Llama-3.1-8B-Instruct (32 x 128 tokens x 4096), each padded to 128 tokens without a
mask. The transformer gives each of its 48 blocks one Llama layer (``llama_layers``) beside the
T5 tokens. The cache keeps all four per caption; Llama's layers are stored batch first
(``(layers, batch, ...)`` as the pipeline holds them is transposed back in ``predict``): 64 MiB
per caption in fp32 at the real sizes, which is why diffusion-pipe computes them each step
instead (see docs/diffusion.md).

Latents are (batch, 16, h, w): the transformer patchifies 2x2 itself. Its time input is the
pipeline's timestep (sigma x 1000) and it predicts the flow with the opposite sign, which
``predict`` undoes. In training mode the transformer returns its output patch-major
(``(batch, channels, tokens, 4)``, its original training layout) and routes experts without
the inference kernel: ``predict`` puts the patches back into the image. The pipeline draws
every image at its default area (``default_sample_size``) whatever size it is asked for:
``HiDreamSampling.draw`` sets that area to the sample's.

The LoRA's original layout (ComfyUI's, diffusion-pipe's) is diffusers' module names under
``diffusion_model.`` with the strength folded into ``lora_B``, which diffusers' converter of
such HiDream LoRAs reads back.
"""

from __future__ import annotations

import torch

from zeropipe.families.diffusion.comfy import COMFY_PREFIX
from zeropipe.families.diffusion.core import Architecture, Record
from zeropipe.families.diffusion.parts import ImageLatents
from zeropipe.families.diffusion.roles import DenoiserCall, ExportLayouts, PromptEncoding, Sampling
from zeropipe.families.diffusion.tiny.components import clip_text, tiny_llama_causal_lm as tiny_llama, tiny_vae
from zeropipe.families.diffusion.tiny.tokenizers import character_qwen_tokenizer, character_t5_tokenizer, character_tokenizer

TEXT_TOKENS = 128  # the pipeline's max_sequence_length, for T5, Llama and the CLIPs


def fold_strength(layers: dict[str, torch.Tensor], alpha: float, prefix: str = COMFY_PREFIX) -> dict[str, torch.Tensor]:
    """Diffusers module names under ``prefix``, ``alpha / r`` folded into ``lora_B`` and no ``.alpha`` keys (what ComfyUI applies at strength 1)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in layers.items():
        module, _, part = key.partition(".lora_")
        if part.startswith("B"):
            tensor = tensor * (alpha / layers[f"{module}.lora_A.weight"].shape[0])
        out[f"{prefix}{module}.lora_{part}"] = tensor.contiguous()
    return out


def image_from_patches(out: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(batch, channels, tokens, p x p), the transformer's training layout (tokens padded to its maximum for non-square images), as (batch, channels, height, width)."""
    batch, channels, _, patch_area = out.shape
    patch = int(round(patch_area**0.5))
    rows, columns = height // patch, width // patch
    grid = out[:, :, : rows * columns].reshape(batch, channels, rows, columns, patch, patch)
    return grid.permute(0, 1, 2, 4, 3, 5).reshape(batch, channels, height, width)


class HiDreamPrompts(PromptEncoding):
    def tiny_tokenizer(self, tokenizer):
        if tokenizer == "tokenizer_3":
            return character_t5_tokenizer(TEXT_TOKENS)
        if tokenizer == "tokenizer_4":
            return character_qwen_tokenizer(TEXT_TOKENS)  # a PreTrainedTokenizerFast, as Llama's is; the pipeline pads with its eos
        return character_tokenizer(TEXT_TOKENS)

    def encode_prompts(self, pipeline, prompts, device):
        t5, _, llama, _, pooled, _ = pipeline.encode_prompt(
            prompt=list(prompts), device=device, do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS
        )
        # Llama's layers come layer first, (layers, batch, tokens, width): the cache is per caption, so batch first.
        return {"prompt_embeds_t5": t5, "prompt_embeds_llama3": llama.transpose(0, 1), "pooled_prompt_embeds": pooled}


class HiDreamCall(DenoiserCall):
    """The transformer on the latents as they are (it patchifies 2x2 itself), its output read back as the flow.

    Its output's layout depends on the model's mode (patch-major in training), so ``predict`` is written whole.
    Not traced: the experts pick their tokens by value (boolean indexing in training, bincount in inference), which the
    meta device cannot run; assuming every token reaches every expert would count the expert activations twice over.
    """

    def inputs(self, model_input, timesteps, condition, context):
        return {
            "hidden_states": model_input, "timesteps": timesteps.to(context.dtype), "encoder_hidden_states_t5": condition["prompt_embeds_t5"],
            "encoder_hidden_states_llama3": condition["prompt_embeds_llama3"].transpose(0, 1), "pooled_embeds": condition["pooled_prompt_embeds"],
        }

    def predict(self, model, model_input, timesteps, condition, context):
        module = getattr(model, "module", model)  # the DeepSpeed engine wraps the transformer
        out = model(**self.inputs(model_input, timesteps, condition, context), return_dict=False)[0]
        if module.training and not module.config.force_inference_output:
            out = image_from_patches(out, *model_input.shape[-2:])
        return -out


class HiDreamSampling(Sampling):
    def sample_kwargs(self, condition, negative, guidance_scale, guidance):
        return {
            "prompt_embeds_t5": condition["prompt_embeds_t5"], "prompt_embeds_llama3": condition["prompt_embeds_llama3"].transpose(0, 1),
            "pooled_prompt_embeds": condition["pooled_prompt_embeds"], "negative_prompt_embeds_t5": negative["prompt_embeds_t5"],
            "negative_prompt_embeds_llama3": negative["prompt_embeds_llama3"].transpose(0, 1),
            "negative_pooled_prompt_embeds": negative["pooled_prompt_embeds"], "guidance_scale": guidance_scale,
        }

    def draw(self, pipeline, kwargs):
        # HiDreamImagePipeline rescales height and width to the area of default_sample_size (1024 px for the real model): ask for the sample's own.
        side = (kwargs.get("height") or 1024) * (kwargs.get("width") or 1024)
        pipeline.default_sample_size = int(round(side**0.5)) // pipeline.vae_scale_factor
        return pipeline(**kwargs)[0]


class HiDreamLayouts(ExportLayouts):
    def original_lora_layout(self, layers, alpha):
        """``diffusion_model.double_stream_blocks.0.block.attn1.to_q.lora_A.weight`` ...: the HiDream LoRA layout ComfyUI loads."""
        return fold_strength(layers, alpha)


ARCHITECTURE = Architecture(
    record=Record(
        name="hidream",
        pipeline_class="HiDreamImagePipeline",
        denoiser="transformer",
        denoiser_class="HiDreamImageTransformer2DModel",
        objective="flow",
        text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3", "text_encoder_4"),
        tokenizers=("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4"),
        patch_factor=2,
        codec=ImageLatents(shifted=True),
        preset_name="tiny-hidream",
        preset={
            # caption_channels: T5's width, then Llama's; Llama's 2 layers feed the 2 blocks; 2 routed experts, 1 active per token (HiDream-I1: 4 and 2).
            "transformer": {
                "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                "num_attention_heads": 2, "caption_channels": [64, 32], "text_emb_dim": 64, "num_routed_experts": 2, "num_activated_experts": 1,
                "axes_dims_rope": [8, 4, 4], "max_resolution": [32, 32], "llama_layers": [0, 1],
            },
            "vae": tiny_vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
            # HiDream's CLIPs take 128 tokens (their position tables are 248 long).
            "text_encoder": {"class": "CLIPTextModelWithProjection", **clip_text(), "max_position_embeddings": 248},
            "text_encoder_2": {"class": "CLIPTextModelWithProjection", **clip_text(), "max_position_embeddings": 248},
            "text_encoder_3": {"class": "T5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                               "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
            "text_encoder_4": tiny_llama(),
            "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
        },
        # The attention projections of both streams (image, and the double blocks' text stream: the _t layers), as diffusion-pipe's HiDream LoRAs train.
        lora_targets=("to_q", "to_k", "to_v", "to_out", "to_q_t", "to_k_t", "to_v_t", "to_out_t"),
        tokenizer_lengths={name: TEXT_TOKENS for name in ("tokenizer", "tokenizer_2", "tokenizer_3", "tokenizer_4")},
        trace_tokens=TEXT_TOKENS,
        image_processor_patch=2,  # the transformer patchifies 2x2
    ),
    call=HiDreamCall(),
    prompts=HiDreamPrompts(),
    sampling=HiDreamSampling(),
    layouts=HiDreamLayouts(),
)
