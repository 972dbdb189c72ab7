"""Diffusion pipelines: which architecture a diffusers directory holds, tiny ones built from config, and their parts.

A run always trains from a diffusers pipeline directory (``model_index.json`` with ``unet/``
or ``transformer/``, ``vae/``, text encoders, tokenizers, ``scheduler/``). An inline
``model.config: {pipeline: tiny-sdxl}`` is turned into such a directory once, by the
launcher, with seeded random weights: caching, training, sampling and export then have one
code path, and an exported full fine-tune is a pipeline directory like the one it came from.

What differs between architectures (how prompts are encoded, how the denoiser is called) is
left to diffusers' own pipeline classes wherever they expose it (``encode_prompt``), so that
the embeddings we train on are exactly the ones the pipeline uses at inference.
"""

from __future__ import annotations

import copy
import hashlib
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zeropipe.errors import ConfigError, ZeroPipeError


@dataclass(frozen=True)
class Architecture:
    name: str  # sdxl, sd15, sd3, flux
    pipeline_class: str
    denoiser: str  # the trained component: "unet" or "transformer"
    objective: str  # "ddpm" (noise/velocity prediction) or "flow" (rectified flow)
    text_encoders: tuple[str, ...]  # components whose outputs the text cache holds
    tokenizers: tuple[str, ...]

    @property
    def frozen_components(self) -> tuple[str, ...]:
        return ("vae", *self.text_encoders)


ARCHITECTURES = {
    "sdxl": Architecture("sdxl", "StableDiffusionXLPipeline", "unet", "ddpm", ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2")),
    "sd15": Architecture("sd15", "StableDiffusionPipeline", "unet", "ddpm", ("text_encoder",), ("tokenizer",)),
    "sd3": Architecture(
        "sd3", "StableDiffusion3Pipeline", "transformer", "flow", ("text_encoder", "text_encoder_2", "text_encoder_3"), ("tokenizer", "tokenizer_2", "tokenizer_3")
    ),
    "flux": Architecture("flux", "FluxPipeline", "transformer", "flow", ("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2")),
}
PIPELINE_ARCHITECTURES = {arch.pipeline_class: arch for arch in ARCHITECTURES.values()}
# Pipelines saved by training scripts and community tools under related class names.
PIPELINE_ARCHITECTURES.update(
    {
        "StableDiffusionXLImg2ImgPipeline": ARCHITECTURES["sdxl"],
        "StableDiffusionImg2ImgPipeline": ARCHITECTURES["sd15"],
        "StableDiffusion3Img2ImgPipeline": ARCHITECTURES["sd3"],
        "FluxImg2ImgPipeline": ARCHITECTURES["flux"],
    }
)


def architecture_of(pipeline_dir: Path) -> Architecture:
    """The architecture of a diffusers pipeline directory, from its model_index.json."""
    index_file = Path(pipeline_dir) / "model_index.json"
    try:
        index = json.loads(index_file.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError([("model.path", f"{index_file} cannot be read ({err}): point model.path at a diffusers pipeline directory")]) from None
    name = index.get("_class_name")
    if name not in PIPELINE_ARCHITECTURES:
        known = ", ".join(sorted({arch.pipeline_class for arch in ARCHITECTURES.values()}))
        raise ConfigError([("model.path", f"{index_file} holds a {name}, which ZeRO-Pipe does not train yet (it trains {known})")])
    arch = PIPELINE_ARCHITECTURES[name]
    if not (Path(pipeline_dir) / arch.denoiser).is_dir():
        raise ConfigError([("model.path", f"{pipeline_dir} has no {arch.denoiser}/ folder, which a {name} needs")])
    return arch


def pipeline_class(arch: Architecture):
    import diffusers

    return getattr(diffusers, arch.pipeline_class)


def denoiser_class(arch: Architecture):
    import diffusers

    return diffusers.UNet2DConditionModel if arch.denoiser == "unet" else getattr(
        diffusers, "SD3Transformer2DModel" if arch.name == "sd3" else "FluxTransformer2DModel"
    )


# ------------------------------------------------------------------------------ tiny presets
def _clip_text(hidden: int = 32, projection: int = 32, vocab: int = 128) -> dict[str, Any]:
    return {
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": vocab, "projection_dim": projection,
        "max_position_embeddings": 77, "hidden_act": "gelu",
    }


def _vae(latent_channels: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "in_channels": 3, "out_channels": 3, "latent_channels": latent_channels, "block_out_channels": [32, 64],
        "down_block_types": ["DownEncoderBlock2D"] * 2, "up_block_types": ["UpDecoderBlock2D"] * 2,
        "layers_per_block": 1, "norm_num_groups": 32, **extra,
    }


DDPM_SCHEDULE = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000, "steps_offset": 1}

# Tiny pipelines with the layout of the real ones (two text encoders and added time ids for
# SDXL, joint attention for SD3, packed latents and guidance for Flux), small enough to train
# on CPU ranks in minutes. Component configs are diffusers/transformers config dicts.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-sdxl": {
        "architecture": "sdxl",
        "unet": {
            "block_out_channels": [32, 64], "layers_per_block": 1, "in_channels": 4, "out_channels": 4,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
            "attention_head_dim": [2, 4], "use_linear_projection": True, "addition_embed_type": "text_time", "addition_time_embed_dim": 8,
            "transformer_layers_per_block": [1, 1], "projection_class_embeddings_input_dim": 80, "cross_attention_dim": 64,
            "norm_num_groups": 8, "sample_size": 32,
        },
        "vae": _vae(scaling_factor=0.13025),
        "text_encoder": {"class": "CLIPTextModel", **_clip_text()},
        "text_encoder_2": {"class": "CLIPTextModelWithProjection", **_clip_text()},
        "scheduler": {"class": "EulerDiscreteScheduler", **DDPM_SCHEDULE, "timestep_spacing": "leading"},
    },
    "tiny-sd15": {
        "architecture": "sd15",
        "unet": {
            "block_out_channels": [32, 64], "layers_per_block": 1, "in_channels": 4, "out_channels": 4,
            "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"],
            "attention_head_dim": 4, "cross_attention_dim": 32, "norm_num_groups": 8, "sample_size": 32,
        },
        "vae": _vae(scaling_factor=0.18215),
        "text_encoder": {"class": "CLIPTextModel", **_clip_text()},
        "scheduler": {"class": "DDIMScheduler", **DDPM_SCHEDULE, "clip_sample": False, "set_alpha_to_one": False},
    },
    "tiny-sd3": {
        "architecture": "sd3",
        "transformer": {
            "sample_size": 32, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 2, "attention_head_dim": 16,
            "num_attention_heads": 4, "caption_projection_dim": 64, "joint_attention_dim": 64, "pooled_projection_dim": 64, "pos_embed_max_size": 32,
        },
        "vae": _vae(scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False),
        "text_encoder": {"class": "CLIPTextModelWithProjection", **_clip_text()},
        "text_encoder_2": {"class": "CLIPTextModelWithProjection", **_clip_text()},
        "text_encoder_3": {"class": "T5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                           "pad_token_id": 1, "eos_token_id": 1, "decoder_start_token_id": 0},
        "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0},
    },
    "tiny-flux": {
        "architecture": "flux",
        "transformer": {
            "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
            "num_attention_heads": 2, "joint_attention_dim": 64, "pooled_projection_dim": 32, "axes_dims_rope": [4, 4, 8], "guidance_embeds": False,
        },
        "vae": _vae(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False),
        "text_encoder": {"class": "CLIPTextModel", **_clip_text()},
        "text_encoder_2": {"class": "T5EncoderModel", "vocab_size": 128, "d_model": 64, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_heads": 4,
                           "pad_token_id": 1, "eos_token_id": 1, "decoder_start_token_id": 0},
        "scheduler": {"class": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False},
    },
}


def preset_components(config: dict[str, Any]) -> tuple[Architecture, dict[str, dict[str, Any]]]:
    """Architecture and component configs of an inline ``model.config`` (a preset plus overrides)."""
    config = dict(config)
    config.pop("vae_fit_steps", None)  # how the tiny VAE is made, not a component
    name = config.pop("pipeline")
    if name not in PRESETS:
        raise ConfigError([("model.config.pipeline", f"unknown pipeline {name!r}: use one of {', '.join(PRESETS)} (or model.path for a real pipeline)")])
    components = copy.deepcopy(PRESETS[name])
    arch = ARCHITECTURES[components.pop("architecture")]
    for key, overrides in config.items():
        if key not in components:
            raise ConfigError([(f"model.config.{key}", f"{name} has no component {key!r}; its components are {', '.join(components)}")])
        if not isinstance(overrides, dict):
            raise ConfigError([(f"model.config.{key}", "must be a mapping of config fields to override")])
        components[key].update(overrides)
    return arch, components


def character_tokenizer(max_length: int = 77):
    """A CLIP tokenizer whose tokens are single characters: enough for captions of a tiny model, built without a download."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    chars = sorted(set(string.ascii_lowercase + string.digits + ",.-'"))
    for suffix in ("", "</w>"):
        for char in chars:
            vocab[char + suffix] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = max_length
    return tokenizer


def build_tiny_pipeline(config: dict[str, Any], out: Path, seed: int) -> Architecture:
    """Write a randomly initialised pipeline directory for an inline config; same config and seed, same weights."""
    import diffusers
    import transformers

    import shutil

    arch, components = preset_components(config)
    tmp = out.with_name(out.name + ".partial")
    transformers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.disable_progress_bar()

    shutil.rmtree(tmp, ignore_errors=True)
    parts: dict[str, Any] = {}
    for index, (name, fields) in enumerate(components.items()):
        fields = dict(fields)
        torch.manual_seed(seed * 1000 + index)
        if name == "scheduler":
            parts[name] = getattr(diffusers, fields.pop("class")).from_config(fields)
        elif name.startswith("text_encoder"):
            cls = getattr(transformers, fields.pop("class"))
            parts[name] = cls(cls.config_class(**fields))
        elif name == "vae":
            parts[name] = diffusers.AutoencoderKL(**fields)
            if config.get("vae_fit_steps"):
                fit_tiny_vae(parts[name], int(config["vae_fit_steps"]), seed, shifted=arch.name in ("sd3", "flux"))
        else:
            parts[name] = denoiser_class(arch)(**fields)
    for tokenizer_name in arch.tokenizers:
        parts[tokenizer_name] = character_tokenizer(77 if tokenizer_name != "tokenizer_3" or arch.name != "sd3" else 32)
    cls = pipeline_class(arch)
    expected = set(cls._get_signature_keys(cls)[0]) if hasattr(cls, "_get_signature_keys") else set()
    optional = {name: None for name in expected if name not in parts and name not in ("force_zeros_for_empty_prompt", "add_watermarker", "requires_safety_checker")}
    kwargs = {**optional, **parts}
    if arch.name == "sd15":
        kwargs.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipeline = cls(**kwargs)
    pipeline.save_pretrained(str(tmp), safe_serialization=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return arch


def fit_tiny_vae(vae, steps: int, seed: int, shifted: bool, batch: int = 16) -> None:
    """Teach a random tiny VAE to reconstruct generated shape images, so that samples show shapes.

    A randomly initialised decoder turns any latent into noise, so the sample images of a
    tiny demo pipeline would say nothing about whether the denoiser learned. A few hundred
    steps of reconstruction on the same kind of images the demo trains on fix that (about
    a minute on 2 CPU cores). The scaling (and for SD3/Flux the shift) factor is then set
    from the latents, as it was for the real VAEs, so that the denoiser sees unit variance.
    """
    import tempfile

    from zeropipe.diffusion.images import generate_shapes_dataset, load_image_for_bucket, scan_image_folder

    size = int(vae.config.sample_size)
    with tempfile.TemporaryDirectory() as folder:
        generate_shapes_dataset(Path(folder), 256, seed=seed + 7, resolution=size)
        items = scan_image_folder(Path(folder)).items
        pixels = torch.stack([load_image_for_bucket(Path(item.path), (size, size), crop="center", flip=False).pixels for item in items])
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(vae.parameters(), lr=2e-3)
    vae.train()
    for _ in range(steps):
        images = pixels[torch.randint(0, len(pixels), (batch,), generator=generator)]
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = torch.nn.functional.mse_loss(reconstruction, images) + 1e-6 * posterior.kl().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    vae.eval()
    with torch.no_grad():
        latents = vae.encode(pixels).latent_dist.mean
    shift = float(latents.mean()) if shifted else 0.0
    vae.register_to_config(scaling_factor=round(1.0 / float((latents - shift).std()), 5))
    if shifted:
        vae.register_to_config(shift_factor=round(shift, 5))


# ------------------------------------------------------------------------------ fingerprints
def fingerprint_files(folder: Path, cache_file: Path | None = None) -> str:
    """A hash of a component folder's files (content, so that a copy elsewhere hashes the same).

    Hashing a multi-GB text encoder takes seconds, so the hash is remembered per
    (path, size, mtime) in ``cache_file``.
    """
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    stat_key = hashlib.sha256(json.dumps([(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]).encode()).hexdigest()
    remembered: dict[str, str] = {}
    if cache_file is not None and cache_file.is_file():
        try:
            remembered = json.loads(cache_file.read_text())
        except json.JSONDecodeError:
            remembered = {}
    if stat_key in remembered:
        return remembered[stat_key]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    result = digest.hexdigest()[:20]
    if cache_file is not None:
        remembered[stat_key] = result
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(remembered))
        tmp.replace(cache_file)
    return result


# ------------------------------------------------------------------------------ loading parts
def load_component(pipeline_dir: Path, name: str, dtype: torch.dtype, device: torch.device):
    """One frozen component (VAE or text encoder) of a pipeline directory, in eval mode without gradients."""
    import diffusers
    import transformers

    index = json.loads((Path(pipeline_dir) / "model_index.json").read_text())
    library, class_name = index[name]
    cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
    model = cls.from_pretrained(str(Path(pipeline_dir) / name), dtype=dtype) if library == "transformers" else cls.from_pretrained(
        str(Path(pipeline_dir) / name), torch_dtype=dtype
    )
    model.requires_grad_(False)
    return model.to(device).eval()


def load_tokenizer(pipeline_dir: Path, name: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(pipeline_dir) / name))


def vae_config(pipeline_dir: Path) -> dict[str, Any]:
    return json.loads((Path(pipeline_dir) / "vae" / "config.json").read_text())


def vae_scale_factor(pipeline_dir: Path) -> int:
    return 2 ** (len(vae_config(pipeline_dir)["block_out_channels"]) - 1)


def latent_scaling(pipeline_dir: Path) -> tuple[float, float]:
    """(shift, scale): latents the denoiser sees are (VAE mean or sample - shift) * scale."""
    config = vae_config(pipeline_dir)
    return float(config.get("shift_factor") or 0.0), float(config.get("scaling_factor") or 1.0)


def text_pipeline(pipeline_dir: Path, arch: Architecture, dtype: torch.dtype, device: torch.device):
    """The architecture's pipeline holding only its text encoders and tokenizers: its encode_prompt is the reference."""
    cls = pipeline_class(arch)
    parts: dict[str, Any] = {name: load_component(pipeline_dir, name, dtype, device) for name in arch.text_encoders}
    parts.update({name: load_tokenizer(pipeline_dir, name) for name in arch.tokenizers})
    from diffusers import SchedulerMixin  # noqa: F401 - the scheduler is loaded for the pipeline's constructor

    return _assemble(cls, arch, pipeline_dir, parts)


def _assemble(cls, arch: Architecture, pipeline_dir: Path, parts: dict[str, Any]):
    import diffusers

    scheduler_config = json.loads((Path(pipeline_dir) / "scheduler" / "scheduler_config.json").read_text())
    scheduler = getattr(diffusers, scheduler_config["_class_name"]).from_config(scheduler_config)
    expected = cls._get_signature_keys(cls)[0]
    kwargs = {name: None for name in expected if name not in ("force_zeros_for_empty_prompt", "add_watermarker", "requires_safety_checker")}
    kwargs.update(parts)
    kwargs["scheduler"] = scheduler
    if arch.name == "sd15":
        kwargs["requires_safety_checker"] = False
    if arch.name == "sdxl":
        kwargs["add_watermarker"] = False
    pipeline = cls(**kwargs)
    # The VAE is not loaded: the pipeline's default factor (8) would size latents wrongly.
    pipeline.vae_scale_factor = vae_scale_factor(pipeline_dir)
    if hasattr(pipeline, "image_processor"):
        from diffusers.image_processor import VaeImageProcessor

        pipeline.image_processor = VaeImageProcessor(vae_scale_factor=pipeline.vae_scale_factor * (2 if arch.name == "flux" else 1))
    return pipeline


def denoising_pipeline(pipeline_dir: Path, arch: Architecture, denoiser):
    """The architecture's pipeline around a (possibly ZeRO-3 partitioned) denoiser, without VAE or text encoders."""
    return _assemble(pipeline_class(arch), arch, pipeline_dir, {arch.denoiser: denoiser})


@torch.no_grad()
def encode_prompts(pipeline, arch: Architecture, prompts: list[str], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Per prompt, the tensors the denoiser is conditioned on, computed by the pipeline's own encode_prompt."""
    if arch.name == "sdxl":
        embeds, _, pooled, _ = pipeline.encode_prompt(prompt=prompts, device=device, num_images_per_prompt=1, do_classifier_free_guidance=False)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    elif arch.name == "sd15":
        embeds, _ = pipeline.encode_prompt(prompts, device, 1, False)
        out = {"prompt_embeds": embeds}
    elif arch.name == "sd3":
        max_length = pipeline.tokenizer_3.model_max_length if pipeline.tokenizer_3 is not None else 77
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=device, do_classifier_free_guidance=False, max_sequence_length=min(max_length, 256)
        )
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    elif arch.name == "flux":
        max_length = min(pipeline.tokenizer_2.model_max_length, 512)
        embeds, pooled, _ = pipeline.encode_prompt(prompt=prompts, prompt_2=None, device=device, max_sequence_length=max_length)
        out = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    else:  # pragma: no cover - ARCHITECTURES is closed
        raise ZeroPipeError(f"no prompt encoder for {arch.name}")
    return [{key: value[i].detach().float().cpu().contiguous() for key, value in out.items()} for i in range(len(prompts))]
