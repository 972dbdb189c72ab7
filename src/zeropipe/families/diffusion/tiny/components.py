"""The tiny presets' components: text encoders, VAEs and denoisers at a few layers of a few channels, as config fields.

An entry's tiny preset (``Architecture.preset``) takes its pieces from here; a tiny pipeline is built
from them without a download (``pipelines.build_tiny_pipeline``).
"""

from __future__ import annotations

from typing import Any

from zeropipe.families.diffusion.tiny.tokenizers import TOKENIZER_CHARACTERS

def clip_text(hidden: int = 32, projection: int = 32, vocab: int = 128) -> dict[str, Any]:
    return {
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": vocab, "projection_dim": projection,
        "max_position_embeddings": 77, "hidden_act": "gelu",
    }


def tiny_t5() -> dict[str, Any]:
    return {"class": "T5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
            "pad_token_id": 1, "eos_token_id": 1, "decoder_start_token_id": 0}


def tiny_vae(latent_channels: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": latent_channels, "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "layers_per_block": 1, "norm_num_groups": 32, **extra,
    }


def tiny_qwen2_5_vl() -> dict:
    """Qwen2.5-VL at 2 layers of 32: the text model encodes prompts; a one-block vision tower, which text-to-image never calls."""
    return {
        "class": "Qwen2_5_VLForConditionalGeneration",
        "text_config": {
            "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
        },
        "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 32, "fullatt_block_indexes": [0]},
    }


def tiny_mistral3() -> dict:
    """Mistral Small 3 at 4 layers of 16 (so that FLUX.2's quarter layers 1, 2, 3 exist); a one-layer Pixtral tower, which text-to-image never calls."""
    return {
        "class": "Mistral3ForConditionalGeneration",
        "text_config": {
            "model_type": "mistral", "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
        },
        "vision_config": {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 64, "patch_size": 16},
        "image_token_index": 8,
    }


def tiny_flux2_vae() -> dict:
    """AutoencoderKLFlux2 at 2 blocks (2x compression, FLUX.2's has 8x) of 32 channels, 4 latent channels (16 after 2x2 patching)."""
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": [32, 32],
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2, "layers_per_block": 1, "norm_num_groups": 32,
        "sample_size": 32, "mid_block_add_attention": False,
    }


def tiny_flux2_transformer(joint_attention_dim: int, guidance_embeds: bool) -> dict:
    return {
        "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
        "joint_attention_dim": joint_attention_dim, "timestep_guidance_channels": 32, "axes_dims_rope": [4, 4, 4, 4], "guidance_embeds": guidance_embeds,
    }


def tiny_qwen3_vl() -> dict:
    """Qwen3-VL at 36 layers of 16 (the pipeline taps layers 2, 5, ... 35); a one-block vision tower, which text-to-image never calls."""
    return {
        "class": "Qwen3VLModel",
        "text_config": {
            "vocab_size": 128, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 36, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 8, "max_position_embeddings": 2048, "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
        },
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16, "deepstack_visual_indexes": []},
    }


def tiny_hunyuan_llama() -> dict:
    return {"class": "LlamaModel", "vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1}


def tiny_llama_causal_lm() -> dict:
    return {
        "class": "LlamaForCausalLM", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
    }


def tiny_umt5() -> dict:
    return {"class": "UMT5EncoderModel", "vocab_size": 128, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
            "relative_attention_num_buckets": 8, "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


def tiny_qwen_encoder() -> dict:
    config = tiny_qwen2_5_vl()
    config["text_config"] = {**config["text_config"], "max_position_embeddings": 2048, "num_hidden_layers": 3}  # 1034 tokens; the third-to-last layer
    return config


def tiny_qwen_text() -> dict:
    # Three layers: the pipeline reads the third-last hidden states.
    return {
        "class": "Qwen2_5_VLTextModel", "vocab_size": 2 + 2 * len(TOKENIZER_CHARACTERS), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1,
    }


def tiny_byt5() -> dict:
    # ByT5's vocabulary: 3 special tokens, 256 bytes and 125 extra ids.
    return {"class": "T5EncoderModel", "vocab_size": 384, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
            "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0}


def tiny_gemma2() -> dict:
    return {
        "class": "Gemma2Model", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 512, "sliding_window": 256, "pad_token_id": 0, "eos_token_id": 1,
        "bos_token_id": 2,
    }


def tiny_gemma3(prompt_tokens: int) -> dict[str, Any]:
    """A two-layer Gemma 3 (with the smallest vision tower its class builds), the text encoder class LTX-2 ships."""
    return {
        "class": "Gemma3ForConditionalGeneration",
        "text_config": {
            "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": 2 * prompt_tokens, "sliding_window": 64, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2,
        },
        "vision_config": {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        "mm_tokens_per_image": 4,
    }


def tiny_mistral3_model() -> dict:
    """Ministral 3 as the pipeline loads it (``Mistral3Model``, no language-model head), at 4 layers of 16."""
    return {**tiny_mistral3(), "class": "Mistral3Model"}


def tiny_ideogram4_transformer() -> dict:
    """Ideogram4Transformer2DModel at 2 blocks of 32 (2 heads of 16); its text features are the tiny Qwen3-VL's 13 tapped layers of 16."""
    return {
        "in_channels": 16, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "intermediate_size": 64, "adaln_dim": 32,
        "llm_features_dim": 13 * 16, "rope_theta": 10000, "mrope_section": [2, 1, 1],
    }


def tiny_qwen3_vl_generation() -> dict:
    """Qwen3-VL at 2 layers of 32, as the pipeline loads it (``Qwen3VLForConditionalGeneration``); a one-block vision tower text-to-image never calls."""
    return {
        "class": "Qwen3VLForConditionalGeneration",
        "text_config": {
            "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": 2048, "rope_scaling": {"rope_type": "default", "mrope_section": [4, 2, 2], "mrope_interleaved": True},
            "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
        },
        "vision_config": {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32, "deepstack_visual_indexes": []},
    }


def tiny_hunyuan_video_vae() -> dict:
    """HunyuanVideo's causal 3D VAE (AutoencoderKLHunyuanVideo) at 4 blocks of 16 channels: 8x spatial, 4x temporal compression."""
    return {
        "latent_channels": 16, "block_out_channels": [16, 16, 16, 16], "layers_per_block": 1, "norm_num_groups": 4,
        "spatial_compression_ratio": 8, "temporal_compression_ratio": 4, "mid_block_add_attention": False,
    }


def tiny_minimax_h3_vae() -> dict:
    """MiniMax-H3's video VAE (AutoencoderKLMiniMaxH3) at 8 channels a block and a one-layer ViT decoder, its geometry kept:
    16x space, 17-frame chunks (``17k+5`` frames to ``5k+2`` latent frames), 24 latent channels, per-channel statistics."""
    return {
        "block_out_channels": [8, 8, 8, 8, 8, 8], "layers_per_block": 1, "norm_num_groups": 4, "decoder_num_layers": 1,
        "decoder_num_attention_heads": 2, "decoder_attention_head_dim": 8, "decoder_num_register_tokens": 1,
        "latents_mean": [0.0] * 24, "latents_std": [1.0] * 24,
    }


def tiny_minimax_h3_audio_vae() -> dict:
    """MiniMax-H3's waveform audio VAE (AutoencoderKLMiniMaxH3Audio) at 32 kHz and its 800-sample hop (40 latents a second), 32
    latent channels, a 64-wide trunk and a three-stage BigVGAN decoder (8 x 10 x 10 = 800), per-channel statistics."""
    return {
        "class": "AutoencoderKLMiniMaxH3Audio", "encoder_dim": 4, "latent_dim": 64, "latent_channels": 32, "num_attention_heads": 2,
        "decoder_dim": 32, "decoder_rates": [8, 10, 10], "decoder_kernel_sizes": [16, 20, 20], "resblock_kernel_sizes": [3],
        "resblock_dilation_sizes": [[1]], "latents_mean": [0.0] * 32, "latents_std": [1.0] * 32,
    }
