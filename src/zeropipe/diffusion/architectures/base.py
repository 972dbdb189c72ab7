"""What a diffusion architecture is: the interface every architecture module fills in."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# LoRA's default targets in diffusers models: the attention projections.
DIFFUSERS_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")


@dataclass(frozen=True)
class PredictContext:
    """What a denoiser call needs besides its inputs: the rank's device and dtype, and the run's settings."""

    device: torch.device
    dtype: torch.dtype
    vae_factor: int  # pixels per latent along each side
    guidance: float  # model.diffusion.guidance, for guidance-distilled models


@dataclass(frozen=True)
class Architecture:
    """One diffusion architecture. Subclasses override the methods whose behaviour differs.

    Attributes:
        name: the short name used in configs, caches and exports (``sdxl``).
        pipeline_class: the diffusers pipeline class that loads and samples it.
        denoiser: the trained component of the pipeline directory (``unet`` or ``transformer``).
        denoiser_class: its diffusers model class.
        objective: ``ddpm`` (noise/velocity prediction) or ``flow`` (rectified flow).
        text_encoders, tokenizers: the components whose outputs the text cache holds.
        related_pipelines: other pipeline class names saved with the same components (img2img...).
        patch_factor: latent pixels per denoiser token along a side (buckets must be multiples of it).
        shifted_latents: the VAE has a shift factor (latents are (z - shift) * scale).
        preset_name, preset: a tiny pipeline of this layout, built from config for tests and demos.
        lora_targets: module names LoRA adapts by default (suffixes, as peft matches a list), or one regular
            expression that peft matches against whole module names (where a suffix would also hit a layer outside the blocks).
        video: the latents have a time axis, (batch, channels, frames, height, width); clips and images
            (one-frame clips) train together, and samples are videos.
        frame_multiple: the clip lengths the VAE accepts are ``frame_multiple * k + 1`` frames (its temporal
            compression: 4 for Wan and HunyuanVideo, 8 for LTX-Video); 1 for image models.
        frame_rate: frames per second the model was trained at; clips are resampled to it.
        vae_class: the diffusers class of the VAE (what the tiny preset builds).
        frame_conditioned: image-to-video: the denoiser also sees the clip's first frame, encoded by
            the VAE with the other frames black (``conditioning_pixels``), which ``predict`` receives
            as ``condition["first_frame_latents"]`` (cached with the clip's latents).
        image_encoders: (image encoder, its processor): the component names of an image-to-video
            pipeline that also embeds the first frame (Wan 2.1 I2V's CLIP), used when the pipeline
            directory has them; ``encode_first_frames`` computes the embeddings as the pipeline
            does, cached with the clip's latents, and ``predict`` receives them as
            ``condition["image_embeds"]``.
        samples_with_vae: the pipeline uses its VAE even when asked for latents (FLUX.2 [klein] returns them
            denormalised and unpatched): every rank holds the VAE while drawing samples, and ``unpack_latents``
            turns what the pipeline returned back into the denoiser's normalised layout.
        control_images: edit training (Qwen-Image-Edit): every target image has a control image
            (``data.control_path``), taken at the target's bucket and crop, whose VAE latents (the
            distribution's mean, as the pipeline encodes its ``image``) are cached with the target's
            and reach ``predict`` as ``condition["control_latents"]``; samples pass a data control
            image to the pipeline as ``image``.
        control_in_prompt: the text conditioning depends on the control image too (Qwen-Image-Edit
            gives it to Qwen2.5-VL with the prompt): ``encode_prompts`` receives the images, and the
            text cache holds one entry per (caption, control image).
        prompt_processors: components besides the tokenizers that encoding a prompt needs
            (Qwen-Image-Edit's ``processor``), given to the text pipeline as ``load_prompt_processor``
            makes them from the pipeline folder; a tiny preset writes their files with
            ``tiny_prompt_processor``.
    """

    name: str
    pipeline_class: str
    denoiser: str
    denoiser_class: str
    objective: str
    text_encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    related_pipelines: tuple[str, ...] = ()
    patch_factor: int = 1
    shifted_latents: bool = False
    preset_name: str | None = None
    preset: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    lora_targets: tuple[str, ...] | str = DIFFUSERS_LORA_TARGETS
    video: bool = False
    frame_multiple: int = 1
    frame_rate: float | None = None
    vae_class: str = "AutoencoderKL"
    frame_conditioned: bool = False
    image_encoders: tuple[str, ...] = ()
    samples_with_vae: bool = False
    control_images: bool = False
    control_in_prompt: bool = False
    prompt_processors: tuple[str, ...] = ()

    @property
    def frozen_components(self) -> tuple[str, ...]:
        return ("vae", *self.text_encoders)

    # -------------------------------------------------------------- classes
    def pipeline(self):
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def model_class(self):
        import diffusers

        return getattr(diffusers, self.denoiser_class)

    def pipeline_kwargs(self) -> dict[str, Any]:
        """Constructor arguments the pipeline needs besides its components (safety checkers off...)."""
        return {}

    def tokenizer_length(self, tokenizer: str) -> int:
        """model_max_length of a tiny preset's tokenizer."""
        return 77

    def image_processor_factor(self, vae_factor: int) -> int:
        """The factor the pipeline's image processor rounds sizes to."""
        return vae_factor

    def tiny_tokenizer(self, tokenizer: str):
        """A tokenizer for a tiny preset, built without a download (single characters are enough for captions)."""
        return character_tokenizer(self.tokenizer_length(tokenizer))

    def tiny_prompt_processor(self, processor: str, parts: dict[str, Any], folder: Path) -> None:
        """Write the files of a prompt processor (``prompt_processors``) of a tiny preset into its folder, built without a download."""
        raise NotImplementedError(f"the {self.name} entry names prompt processors {self.prompt_processors} but cannot build a tiny one")

    def load_prompt_processor(self, pipeline_dir: Path, processor: str, parts: dict[str, Any]):
        """The prompt processor the text pipeline is given, from its folder and the other loaded parts (the tokenizers)."""
        raise NotImplementedError(f"the {self.name} entry names prompt processors {self.prompt_processors} but cannot load one")

    def vae_factors(self, vae_config: dict[str, Any]) -> tuple[int, int]:
        """(pixels per latent along a side, frames per latent frame after the first) of the VAE, from its config.

        Video VAEs say both (Wan: ``scale_factor_spatial``/``_temporal``, HunyuanVideo:
        ``spatial_compression_ratio``/``temporal_compression_ratio``); an image VAE halves per block.
        """
        if not vae_config.get("scale_factor_spatial") and "block_out_channels" not in vae_config and "temperal_downsample" in vae_config:
            # Qwen-Image's VAE: Wan's layout without the field, one spatial halving per temperal_downsample entry.
            return 2 ** len(vae_config["temperal_downsample"]), 1
        spatial = vae_config.get("scale_factor_spatial") or vae_config.get("spatial_compression_ratio") or 2 ** (len(vae_config["block_out_channels"]) - 1)
        temporal = vae_config.get("scale_factor_temporal") or vae_config.get("temporal_compression_ratio") or 1
        return int(spatial), int(temporal)

    def accepts_frames(self, frames: int) -> bool:
        """Whether the VAE encodes a clip of this many frames (an image is one frame)."""
        return frames == 1 or (self.video and frames > 1 and (frames - 1) % self.frame_multiple == 0)

    def vae_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes for a batch of pixels: as they are, or with a time axis for a video VAE used on images (Qwen-Image)."""
        return pixels

    def vae_images(self, decoded: torch.Tensor) -> torch.Tensor:
        """The VAE's decoded output as a batch of images (B, 3, H, W) or clips (B, 3, T, H, W): the inverse of ``vae_pixels``."""
        return decoded

    def conditioning_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """What the VAE encodes as an image-to-video condition: the first frame kept, the others black (0 in [-1, 1] is grey; Wan uses 0)."""
        condition = torch.zeros_like(pixels)
        condition[:, :, :1] = pixels[:, :, :1]
        return condition

    # -------------------------------------------------------------- latents
    def latents_from_vae(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's latents (drawn from its distribution) laid out as the architecture normalises them and its denoiser sees them.

        As they are by default; FLUX.2 folds 2x2 latent patches into channels first (its
        normalisation is per patched channel). ``decode_latents`` undoes it before decoding.
        """
        return latents

    def store_latent_statistics(self, vae, latents: torch.Tensor) -> None:
        """Make a fitted tiny VAE normalise these latents (``latents_from_vae``'s layout) to zero mean and unit variance.

        Into its config by default (``latent_statistics_config``); FLUX.2's VAE keeps them as batch-norm buffers.
        """
        vae.register_to_config(**self.latent_statistics_config(latents))

    def latent_normalization(self, vae_config: dict[str, Any], vae_dir: Path | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(shift, scale): the denoiser sees (VAE latents - shift) * scale; scalars, or one value per latent channel.

        ``vae_dir`` is the VAE's folder, for VAEs that keep their statistics as weights (LTX-Video) rather than config.
        """
        return torch.tensor(float(vae_config.get("shift_factor") or 0.0)), torch.tensor(float(vae_config.get("scaling_factor") or 1.0))

    def decode_latents(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """Pixels in [-1, 1] of (denormalised) latents, decoded as the architecture's pipeline decodes them."""
        return vae.decode(latents).sample

    def latent_statistics_config(self, latents: torch.Tensor) -> dict[str, Any]:
        """The VAE config fields that normalise these latents (of a fitted tiny VAE) to zero mean and unit variance."""
        shift = float(latents.mean()) if self.shifted_latents else 0.0
        fields: dict[str, Any] = {"scaling_factor": round(1.0 / float((latents - shift).std()), 5)}
        if self.shifted_latents:
            fields["shift_factor"] = round(shift, 5)
        return fields

    # -------------------------------------------------------------- planner
    def trace_inputs(self, config: Any, latent_side: int, latent_frames: int, text_tokens: int, dtype: torch.dtype) -> dict[str, Any] | None:
        """The denoiser's keyword arguments for one example (batch 1) of this size, made on the current (meta) device.

        The planner runs the denoiser on them to count the activations it saves; None: the planner does not trace it.
        """
        return None

    # -------------------------------------------------------------- export
    def original_lora_layout(self, layers: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor] | None:
        """The LoRA in the original (ComfyUI) key layout, from its diffusers layout; None when the architecture has none."""
        return None

    # -------------------------------------------------------------- conditioning
    def encode_first_frames(self, pipeline, images: list, device: torch.device) -> torch.Tensor:
        """Image embeddings of first frames (PIL images), by the pipeline's own image encoding (``image_encoders``)."""
        raise NotImplementedError(f"the {self.name} entry names image encoders {self.image_encoders} but does not say how its pipeline embeds first frames (encode_first_frames)")

    def encode_prompts(self, pipeline, prompts: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        """The conditioning tensors of a batch of prompts, from the pipeline's own encode_prompt."""
        raise NotImplementedError

    def encode_prompts_with_images(self, pipeline, prompts: list[str], images: list, device: torch.device) -> dict[str, torch.Tensor]:
        """With ``control_in_prompt``: the conditioning of prompts each given with its control image (a PIL image), by the pipeline's encode_prompt."""
        raise NotImplementedError(f"the {self.name} entry says control_in_prompt but not how its pipeline encodes a prompt with an image")

    def predict(self, model, model_input: torch.Tensor, timesteps: torch.Tensor, condition: dict[str, torch.Tensor], context: PredictContext) -> torch.Tensor:
        """The denoiser's output for a batch of latents, called as the pipeline calls it."""
        raise NotImplementedError

    # -------------------------------------------------------------- sampling
    def sample_kwargs(self, condition: dict[str, torch.Tensor], negative: dict[str, torch.Tensor], guidance_scale: float, guidance: float) -> dict[str, Any]:
        """The pipeline call's conditioning and guidance arguments (classifier-free guidance by default)."""
        kwargs: dict[str, Any] = {"prompt_embeds": condition["prompt_embeds"], "guidance_scale": guidance_scale, "negative_prompt_embeds": negative["prompt_embeds"]}
        if "pooled_prompt_embeds" in condition:
            kwargs["pooled_prompt_embeds"] = condition["pooled_prompt_embeds"]
        if "pooled_prompt_embeds" in negative:
            kwargs["negative_pooled_prompt_embeds"] = negative["pooled_prompt_embeds"]
        return kwargs

    def sample_with_control(self, pipeline, kwargs: dict[str, Any], image) -> torch.Tensor:
        """Latents of one sample (one prompt's ``kwargs``) that edits a control image (a PIL image at the sample size): by the pipeline's own call."""
        return pipeline(**kwargs, image=image)[0]

    def unpack_latents(self, pipeline, latents: torch.Tensor, size: int, vae_factor: int) -> torch.Tensor:
        """Latents as the VAE decodes them, from what the pipeline returned with output_type="latent"."""
        return latents


# ------------------------------------------------------------------ tiny preset parts
TOKENIZER_CHARACTERS = sorted(set(string.ascii_lowercase + string.digits + ",.-'"))


def original_layout_name(
    module: str, blocks: tuple[tuple[str, str, dict[str, tuple[str, int | None]]], ...], top_level: dict[str, str], model: str
) -> tuple[str, int | None]:
    """A diffusers module's name in an original (Black Forest Labs style) layout, and its part of a fused layer.

    ``blocks``: (diffusers prefix, original prefix, {name in the block: (original name, part)}) per kind of
    block; ``top_level``: names outside the blocks. transformer_blocks.0.attn.to_k -> (double_blocks.0.img_attn.qkv, 1).

    Raises:
        ValueError: the module has no name in that layout.
    """
    for prefix, original_prefix, names in blocks:
        if module.startswith(prefix):
            index, _, rest = module[len(prefix):].partition(".")
            if rest in names:
                original, part = names[rest]
                return f"{original_prefix}{index}.{original}", part
    if module in top_level:
        return top_level[module], None
    raise ValueError(f"{module} has no name in {model}'s original layout")


def character_tokenizer(max_length: int = 77):
    """A CLIP tokenizer whose tokens are single characters: enough for captions of a tiny model, built without a download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for char in TOKENIZER_CHARACTERS:
            vocab[char + suffix] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


def character_t5_tokenizer(max_length: int = 64):
    """A T5 (sentencepiece unigram) tokenizer of single characters, the kind UMT5 and T5 encoders use, built without a download."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    word_start = "\u2581"  # sentencepiece's marker of a word's first piece
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (word_start, -1.0)]
    vocab += [(char, -2.0) for char in TOKENIZER_CHARACTERS] + [(word_start + char, -2.5) for char in TOKENIZER_CHARACTERS]
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=2))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])
    cls = getattr(transformers, "T5TokenizerFast", None) or transformers.T5Tokenizer
    return cls(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0, model_max_length=max_length)


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


DDPM_SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "steps_offset": 1}
