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
from pathlib import Path
from typing import Any, Callable

import torch

from zeropipe.config.pipeline_index import SCHEDULER_CONFIG_FILE, read_pipeline_index
from zeropipe.confine import OutsideRoots, require_usable
from zeropipe.families.diffusion.entries import Architecture, architecture_for_preset, architecture_of, presets
from zeropipe.families.diffusion.tiny.tokenizers import character_tokenizer
from zeropipe.families.diffusion.parts.text import prompt_rows
from zeropipe.errors import ConfigError


def preset_components(config: dict[str, Any]) -> tuple[Architecture, dict[str, dict[str, Any]]]:
    """Architecture and component configs of an inline ``model.config`` (a preset plus overrides)."""
    config = dict(config)
    config.pop("vae_fit_steps", None)  # how the tiny VAE is made, not a component
    name = config.pop("pipeline")
    arch = architecture_for_preset(name)
    if arch is None:
        raise ConfigError([("model.config.pipeline", f"unknown pipeline {name!r}: use one of {', '.join(presets())} (or model.path for a real pipeline)")])
    components = copy.deepcopy(arch.record.preset)
    for key, overrides in config.items():
        if key not in components:
            raise ConfigError([(f"model.config.{key}", f"{name} has no component {key!r}; its components are {', '.join(components)}")])
        if not isinstance(overrides, dict):
            raise ConfigError([(f"model.config.{key}", "must be a mapping of config fields to override")])
        components[key].update(overrides)
    return arch, components


def build_tiny_pipeline(config: dict[str, Any], out: Path, seed: int, progress: Callable[[str, int | None, int | None], None] | None = None) -> Architecture:
    """Write a randomly initialised pipeline directory for an inline config; same config and seed, same weights.

    Args:
        progress: told what is being done (phase, done, total): fitting the VAE takes minutes on a busy CPU.
    """
    import shutil

    import diffusers
    import transformers

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
            parts[name] = getattr(diffusers, arch.record.codec.vae_class)(**fields)
            if config.get("vae_fit_steps"):
                fit_tiny_vae(parts[name], int(config["vae_fit_steps"]), seed, arch, progress=progress)
        elif "class" in fields:  # another component of the pipeline (LTX-2's audio VAE, vocoder and text connectors)
            parts[name] = component_class("diffusers", fields.pop("class"))(**fields)
        else:
            parts[name] = arch.assembly.tiny_component(name, fields)
            if name == arch.record.denoiser:
                arch.assembly.tiny_denoiser(parts[name])
    for tokenizer_name in arch.record.tokenizers:
        parts[tokenizer_name] = arch.prompts.tiny_tokenizer(tokenizer_name)
    cls = arch.pipeline()
    if is_modular(cls):
        # A modular pipeline (no constructor of components): its blocks' components, saved in the modular layout
        # (modular_model_index.json, each component in its subfolder), which ModularPipeline.from_pretrained loads.
        pipeline = cls(**arch.record.pipeline_kwargs)
        pipeline.update_components(**parts)
        pipeline.register_to_config(**dict(arch.record.pipeline_settings))  # minimax-h3-i2v's zeropipe_task, in modular_model_index.json
        for name in parts:  # saved and indexed as a release's are, a component the blocks would create from config (FLUX.3's scheduler) too
            if name in pipeline._component_specs:
                pipeline._component_specs[name].default_creation_method = "from_pretrained"
        pipeline.save_pretrained(str(tmp), safe_serialization=True, overwrite_modular_index=True)
    else:
        expected = set(cls._get_signature_keys(cls)[0]) if hasattr(cls, "_get_signature_keys") else set()
        optional = {name: None for name in expected if name not in parts and name not in ("force_zeros_for_empty_prompt", "add_watermarker", "requires_safety_checker")}
        kwargs = {**optional, **arch.record.pipeline_kwargs, **parts}
        pipeline = cls(**kwargs)
        # The settings that tell this entry's folder from another entry's of the same pipeline class (kandinsky6-i2v's zeropipe_task).
        pipeline.register_to_config(**dict(arch.record.pipeline_settings))
        pipeline.save_pretrained(str(tmp), safe_serialization=True)
    for processor_name in arch.record.text.processors:
        arch.prompts.tiny_prompt_processor(processor_name, parts, tmp / processor_name)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return arch


def fit_tiny_vae(vae, steps: int, seed: int, arch: Architecture, batch: int = 16, progress: Callable[[str, int | None, int | None], None] | None = None) -> None:
    """Teach a random tiny VAE to reconstruct generated shape images (clips, for video VAEs), so that samples show shapes.

    A randomly initialised decoder turns any latent into noise, so the sample images of a
    tiny demo pipeline would say nothing about whether the denoiser learned. A few hundred
    steps of reconstruction on the same kind of images the demo trains on fix that (about
    a minute on 2 CPU cores). The latent normalization (scaling and shift factors, or Wan's
    per-channel means and deviations) is then set from the latents, as it was for the real
    VAEs, so that the denoiser sees unit variance.
    """
    pixels = arch.record.codec.vae_pixels(arch.record.codec.fitting_pixels(vae, seed))
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(vae.parameters(), lr=2e-3)
    vae.train()
    batch = arch.record.codec.fitting_batch(batch)
    for step in range(steps):
        if progress is not None and step % 10 == 0:
            progress("fitting the tiny VAE: step", step, steps)
        images = pixels[torch.randint(0, len(pixels), (batch,), generator=generator)]
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample(generator)).sample
        loss = torch.nn.functional.mse_loss(reconstruction, images) + 1e-6 * posterior.kl().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    vae.eval()
    with torch.no_grad():
        latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in pixels.split(32)])
    arch.record.codec.store_statistics(vae, arch.record.codec.from_vae(latents))


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


# ------------------------------------------------------------------------------ single-file checkpoints
def single_file_renamer(denoiser_class: str, checkpoint: Path) -> Callable[[str], str]:
    """Checkpoint name -> model key for a single-file checkpoint in the original (or ComfyUI) layout.

    The names are converted by diffusers' own single-file converter of the class (the one
    ``from_single_file`` uses), applied to the names alone: no tensor is read here, so that
    under ZeRO-3 each rank still reads only its partitions. Converters that compute tensors
    (split or fused weights) cannot be applied this way and are refused with the fix.

    Raises:
        ConfigError: no converter for the class, one that changes tensors, or an unreadable file.
    """
    from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
    from safetensors import safe_open

    where = "model.diffusion.denoiser_file"
    entry = SINGLE_FILE_LOADABLE_CLASSES.get(denoiser_class)
    if entry is None:
        raise ConfigError([(where, f"diffusers has no single-file converter for {denoiser_class}: give model.path a diffusers directory with its weights instead")])
    try:
        require_usable(checkpoint, where)  # a UI run's single file: never through a symlink out of its folders
    except OutsideRoots as err:
        raise ConfigError([(where, str(err))]) from None
    try:
        with safe_open(str(checkpoint), framework="pt") as handle:
            names = list(handle.keys())
    except Exception as err:  # missing file, not safetensors, damaged header: the same fix
        raise ConfigError([(where, f"{checkpoint} cannot be read as a .safetensors checkpoint ({err})")]) from None
    try:
        converted = entry["checkpoint_mapping_fn"]({name: name for name in names}, config=None)
    except Exception as err:
        raise ConfigError(
            [(where, f"diffusers converts {denoiser_class} single files by computing tensors ({type(err).__name__}: {err}), which cannot be streamed into ZeRO partitions: "
                     f"convert it once with {denoiser_class}.from_single_file(...).save_pretrained(DIR) and point model.path at a pipeline holding DIR")]
        ) from None
    renames = {source: key for key, source in converted.items() if isinstance(source, str)}
    if len(renames) != len(converted):
        raise ConfigError([(where, f"diffusers' converter for {denoiser_class} changes tensors, not only names: convert it once with from_single_file and save_pretrained")])
    return lambda name: renames.get(name, name)


# ------------------------------------------------------------------------------ loading parts
def component_bytes(folder: Path, dtype: torch.dtype) -> int:
    """What a component's weights take loaded in ``dtype``, from its safetensors headers (nothing is read but them)."""
    from safetensors import safe_open

    elements = 0
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                elements += _numel(handle.get_slice(key).get_shape())
    return elements * torch.tensor([], dtype=dtype).element_size()


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def spread_placement(needed: int, free_per_gpu: list[int], host_free: int) -> dict[Any, int] | None:
    """accelerate's max_memory for a component that does not fit on the first GPU, or None where it does.

    The node's setup process has the node's GPUs to itself (no rank is resident): a text encoder
    larger than one GPU (FLUX.2 [dev]'s 24B Mistral, 44.7 GiB in bf16) is spread over all of them,
    and what does not fit there streams from host RAM. 10% of each is kept for activations.
    """
    if not free_per_gpu or needed <= free_per_gpu[0] * 0.9:
        return None
    placement: dict[Any, int] = {index: int(free * 0.9) for index, free in enumerate(free_per_gpu)}
    placement["cpu"] = int(host_free * 0.8)
    return placement


def component_class(library: str, class_name: str):
    """The class of a component as model_index.json names it: diffusers', transformers', or one of a diffusers pipeline's own
    module (``["ltx2", "LTX2TextConnectors"]``; ``"ltx2.LTX2Vocoder"`` in a tiny preset), where diffusers' from_pretrained finds it."""
    import importlib

    import diffusers
    import transformers

    if "." in class_name:
        library, class_name = class_name.rsplit(".", 1)
    if library == "transformers":
        return getattr(transformers, class_name)
    if library == "diffusers" or hasattr(diffusers, class_name):
        return getattr(diffusers, class_name)
    return getattr(importlib.import_module(f"diffusers.pipelines.{library}"), class_name)


def load_component(pipeline_dir: Path, name: str, dtype: torch.dtype, device: torch.device, spread: bool = False):
    """One frozen component (VAE or text encoder) of a pipeline directory, in eval mode without gradients.

    ``spread``: the caller has every GPU of the node to itself (the node's setup process): a
    transformers component that does not fit on ``device`` is spread over the GPUs (and host
    RAM) by accelerate's device map instead of failing with an out-of-memory error.
    """
    import diffusers
    import transformers

    index = read_pipeline_index(pipeline_dir)
    library, class_name = index.required_component(name)
    cls = component_class(library, class_name)
    folder = index.component_folder(name)  # the component's subfolder (a modular index names it)
    if spread and library == "transformers" and device.type == "cuda" and torch.cuda.device_count() > 1:
        import psutil

        free = [torch.cuda.mem_get_info(index)[0] for index in range(torch.cuda.device_count())]
        placement = spread_placement(component_bytes(folder, dtype), free, psutil.virtual_memory().available)
        if placement is not None:
            model = cls.from_pretrained(str(folder), dtype=dtype, device_map="auto", max_memory=placement)
            model.requires_grad_(False)
            return model.eval()
    model = cls.from_pretrained(str(folder), dtype=dtype) if library == "transformers" else cls.from_pretrained(str(folder), torch_dtype=dtype)
    model.requires_grad_(False)
    return model.to(device).eval()


def load_tokenizer(pipeline_dir: Path, name: str):
    """A pipeline's tokenizer, or its processor where model_index.json names one (FLUX.2 [dev]'s PixtralProcessor).

    The pipeline formats its prompts with the processor's ``apply_chat_template`` (typed message
    parts), as diffusers' ``from_pretrained`` loads it; a bare tokenizer read from that folder may
    carry another chat template, or none.

    Raises:
        ConfigError: the processor needs a package that is not installed (Pixtral's: torchvision).
    """
    from transformers import AutoProcessor, AutoTokenizer

    index = read_pipeline_index(pipeline_dir)
    folder = index.component_folder(name)
    class_name = index.component(name)[1]
    if not (class_name or "").endswith("Processor"):
        return AutoTokenizer.from_pretrained(str(folder))
    try:
        return AutoProcessor.from_pretrained(str(folder))
    except ImportError as err:
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        fix = "which transformers loads only with torchvision installed: pip install torchvision" if "torchvision" in str(err).lower() else f"which transformers cannot load here ({why})"
        raise ConfigError([("model.path", f"{folder} holds the pipeline's {class_name} (its prompts are formatted with it), {fix}")]) from None


def vae_config(pipeline_dir: Path) -> dict[str, Any]:
    return read_pipeline_index(pipeline_dir).component_config("vae")


def vae_scale_factor(pipeline_dir: Path) -> int:
    """Pixels per latent along each side, as the pipeline's architecture reads its VAE config (its codec's vae_factors)."""
    return architecture_of(pipeline_dir).record.codec.vae_factors(vae_config(pipeline_dir))[0]


def vae_temporal_factor(pipeline_dir: Path) -> int:
    """Frames per latent frame (after the first): 1 for image VAEs."""
    return architecture_of(pipeline_dir).record.codec.vae_factors(vae_config(pipeline_dir))[1]


def latent_scaling(pipeline_dir: Path, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor]:
    """(shift, scale): latents the denoiser sees are (VAE mean or sample - shift) * scale; scalars or per channel."""
    return arch.record.codec.normalization(vae_config(pipeline_dir), Path(pipeline_dir) / "vae")


def normalize_latents(latents: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(latents - shift) * scale, a per-channel shift and scale broadcast over (batch, channels, [frames,] height, width)."""
    return (latents - _per_channel(shift, latents)) * _per_channel(scale, latents)


def denormalize_latents(latents: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What the VAE decodes: the inverse of normalize_latents."""
    return latents / _per_channel(scale, latents) + _per_channel(shift, latents)


def _per_channel(value: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    value = torch.as_tensor(value, dtype=latents.dtype, device=latents.device)
    return value.view(1, -1, *([1] * (latents.dim() - 2))) if value.dim() == 1 else value


def text_pipeline(pipeline_dir: Path, arch: Architecture, dtype: torch.dtype, device: torch.device, spread: bool = False):
    """The architecture's pipeline holding only its text encoders and tokenizers: its encode_prompt is the reference.

    ``spread``: see :func:`load_component` (the node's setup process only; a rank shares the node's GPUs).
    """
    cls = arch.pipeline()
    parts: dict[str, Any] = {name: load_component(pipeline_dir, name, dtype, device, spread) for name in arch.record.text_encoders}
    parts.update(prompt_processors(pipeline_dir, arch))
    from diffusers import SchedulerMixin

    return _assemble(cls, arch, pipeline_dir, parts)


def prompt_processors(pipeline_dir: Path, arch: Architecture) -> dict[str, Any]:
    """The entry's tokenizers and prompt processors (the prompt part's ``processors``) as its text pipeline is given them, by component name."""
    parts: dict[str, Any] = {name: load_tokenizer(pipeline_dir, name) for name in arch.record.tokenizers}
    parts.update({name: arch.prompts.load_prompt_processor(Path(pipeline_dir), name, parts) for name in arch.record.text.processors})
    return parts


def is_modular(cls) -> bool:
    """Whether a pipeline class is a diffusers ``ModularPipeline`` (blocks and components, no ``__call__`` of its own arguments)."""
    from diffusers.modular_pipelines import ModularPipeline

    return isinstance(cls, type) and issubclass(cls, ModularPipeline)


def _assemble(cls, arch: Architecture, pipeline_dir: Path, parts: dict[str, Any]):
    import diffusers

    folder = read_pipeline_index(pipeline_dir)
    scheduler_config = folder.scheduler_config()
    scheduler = getattr(diffusers, scheduler_config["_class_name"]).from_config(scheduler_config)
    if is_modular(cls):
        return _assemble_modular(cls, arch, folder, parts, scheduler)
    expected, settings = cls._get_signature_keys(cls)
    kwargs = {name: None for name in expected if name not in ("force_zeros_for_empty_prompt", "add_watermarker", "requires_safety_checker")}
    # The pipeline's own settings saved in model_index.json (Flux2KleinPipeline's is_distilled), as from_pretrained passes them.
    kwargs.update(folder.settings(settings))
    kwargs.update(parts)
    kwargs["scheduler"] = scheduler
    kwargs.update(arch.record.pipeline_kwargs)
    pipeline = arch.assembly.construct_pipeline(cls, kwargs, folder)
    # The VAE is not loaded: the pipeline's default factor (8) would size latents wrongly.
    pipeline.vae_scale_factor = vae_scale_factor(pipeline_dir)
    if hasattr(pipeline, "vae_scale_factor_spatial"):  # video pipelines keep a spatial and a temporal factor
        from diffusers.video_processor import VideoProcessor

        pipeline.vae_scale_factor_spatial = pipeline.vae_scale_factor
        pipeline.vae_scale_factor_temporal = vae_temporal_factor(pipeline_dir)
        pipeline.video_processor = VideoProcessor(vae_scale_factor=arch.record.image_processor_factor(pipeline.vae_scale_factor))
    if hasattr(pipeline, "vae_spatial_compression_ratio"):  # LTX-Video's pipelines name the factors so
        pipeline.vae_spatial_compression_ratio = pipeline.vae_scale_factor
        pipeline.vae_temporal_compression_ratio = vae_temporal_factor(pipeline_dir)
    if hasattr(pipeline, "image_processor") and not hasattr(pipeline, "video_processor"):
        from diffusers.image_processor import VaeImageProcessor

        # The pipeline's own processor class where it has one (Flux2ImageProcessor checks the reference images Flux2Pipeline takes), at the right factor.
        processor = pipeline.image_processor
        cls = type(processor) if isinstance(processor, VaeImageProcessor) else VaeImageProcessor
        config = processor.config if isinstance(processor, VaeImageProcessor) else {}
        pipeline.image_processor = cls.from_config(config, vae_scale_factor=arch.record.image_processor_factor(pipeline.vae_scale_factor))
    return pipeline


def _assemble_modular(cls, arch: Architecture, folder, parts: dict[str, Any], scheduler):
    """A modular pipeline holding these components: its blocks and config from the folder's modular_model_index.json
    (as ``ModularPipeline.from_pretrained`` reads them, nothing else loaded), the components given, and every scheduler
    the index names (MiniMax-H3 steps its video and audio rows with two)."""
    import diffusers

    pipeline = cls(pretrained_model_name_or_path=str(folder.path), **arch.record.pipeline_kwargs)
    schedulers = {"scheduler": scheduler}
    for name, (_, class_name) in folder.components().items():
        if name != "scheduler" and class_name is not None and class_name.endswith("Scheduler"):
            config = folder.component_config(name, SCHEDULER_CONFIG_FILE)
            schedulers[name] = getattr(diffusers, config["_class_name"]).from_config(config)
    pipeline.update_components(**{name: part for name, part in {**schedulers, **parts}.items() if part is not None})
    # The VAE is not loaded: the sampler sizes latents by the folder's factor (a modular pipeline's own property would assume the released VAE's).
    pipeline.zeropipe_vae_factor = vae_scale_factor(folder.path)
    return pipeline


class PipelineFolder:
    """A pipeline directory, as the parts of its architecture entry read it: which components it has, loaded one by one."""

    def __init__(self, path: Path, arch: Architecture, fingerprints: Path | None = None):
        self.path, self.arch, self.fingerprints = Path(path), arch, fingerprints
        self.files = read_pipeline_index(self.path)  # model_index.json and the components' configs, read and checked once
        self.index = self.files.index

    def has(self, name: str) -> bool:
        """Whether model_index.json names this component (Wan 2.2 I2V's lists image_encoder as null)."""
        return self.files.has_component(name)

    def component(self, name: str, dtype: torch.dtype, device: torch.device):
        return load_component(self.path, name, dtype, device)

    def processor(self, name: str):
        """A transformers processor component (an image processor), by the class model_index.json names."""
        import transformers

        return getattr(transformers, self.files.required_component(name)[1]).from_pretrained(str(self.path / name))

    def pipeline(self, parts: dict[str, Any]):
        """The architecture's pipeline holding only these components (its encode_image, encode_prompt... are the reference)."""
        return _assemble(self.arch.pipeline(), self.arch, self.path, parts)

    def fingerprint(self, name: str) -> str:
        return fingerprint_files(self.path / name, self.fingerprints)


def denoising_pipeline(pipeline_dir: Path, arch: Architecture, denoiser, **frozen):
    """The architecture's pipeline around a (possibly ZeRO-3 partitioned) denoiser, without text encoders.

    ``frozen`` adds the components a pipeline needs besides the denoiser to start sampling
    (image-to-video: the VAE, which encodes the first frame); without, it has no VAE.
    """
    return _assemble(arch.pipeline(), arch, pipeline_dir, {arch.record.denoiser: denoiser, **frozen})


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """A batch of one conditioning tensor per caption; text of different lengths padded with zeros at the end.

    Architectures whose prompts have a length of their own (Qwen-Image, Z-Image: as long as
    the prompt, with a mask) are cached unpadded or padded to their encoding batch; zeros
    after the text are what their pipelines pad a batch with, and their masks' zeros say
    that those tokens are not attended to.
    """
    if all(row.shape == rows[0].shape for row in rows):
        return torch.stack(rows)
    length = max(row.shape[0] for row in rows)
    return torch.stack([torch.nn.functional.pad(row, [0, 0] * (row.dim() - 1) + [0, length - row.shape[0]]) for row in rows])


@torch.no_grad()
def encode_prompts(pipeline, arch: Architecture, prompts: list[str], device: torch.device) -> list[dict[str, torch.Tensor]]:
    """Per prompt, the tensors the denoiser is conditioned on, computed by the pipeline's own encode_prompt."""
    return prompt_rows(arch.prompts.encode_prompts(pipeline, prompts, device), len(prompts))
