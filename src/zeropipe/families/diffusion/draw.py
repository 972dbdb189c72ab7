"""Drawing with a diffusion run's weights outside training: the UI's Draw page.

The weights come from a run's checkpoint (consolidated in memory; a LoRA fused into the
denoiser, as ``export --merge`` would write it), from a full or merged export (a diffusers
pipeline folder) or from a LoRA export (its base pipeline, named in ``zeropipe_export.json``,
with the LoRA loaded). The pipeline is the architecture's own diffusers class, called with the
prompt as its users call it, through the shared sampler (``sampler.pipeline_call``); images are written as PNG, clips as mp4 with an animated WebP beside.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.errors import ZeroPipeError
from zeropipe.export.generate import LoadedModel, ModelSource, read_run_config

EXPORT_INFO = "zeropipe_export.json"


def is_lora_export(path: Path) -> bool:
    """A diffusion LoRA written by ``zeropipe export`` (the LoRA file and its base named beside it, no pipeline)."""
    return (path / EXPORT_INFO).is_file() and not is_pipeline_folder(path)


def export_info(path: Path) -> dict[str, Any]:
    try:
        value = json.loads((path / EXPORT_INFO).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def pipeline_class(architecture: str | None):
    from zeropipe.families.diffusion.entries import architecture_named

    if architecture:
        try:
            return architecture_named(architecture).pipeline()
        except Exception:  # noqa: BLE001, S110 - an unknown name: diffusers reads the class from model_index.json
            pass
    from diffusers import DiffusionPipeline

    return DiffusionPipeline


def _pipeline_loader_reads(pipeline, arch) -> bool:
    """Whether the pipeline's own ``load_lora_weights`` can load into its denoiser. diffusers 0.42's Wan loader
    (``WanLoraLoaderMixin``, which ``WanAnimate2ModularPipeline`` inherits) reads ``transformer.config.image_dim``, a field
    ``WanAnimate2Transformer3DModel`` does not have: it raises AttributeError on every LoRA, and the denoiser's own loader reads it."""
    from diffusers.loaders import WanLoraLoaderMixin

    denoiser = getattr(pipeline, arch.record.denoiser, None)
    return not (isinstance(pipeline, WanLoraLoaderMixin) and denoiser is not None and not hasattr(denoiser.config, "image_dim"))


def load_adapter_export(pipeline, folder: Path, info: dict[str, Any]) -> None:
    """An adapter export into its base pipeline, by diffusers' loader of that file.

    The pipeline's ``load_lora_weights`` reads LoRA and DoRA files (and LoKr for Z-Image and FLUX.2);
    the denoiser's own ``load_lora_adapter`` reads LoKr files for every model, and is the only loader
    of a pipeline that has none (diffusers 0.42: HunyuanVideo 1.5, Cosmos 2, HunyuanImage).
    """
    from zeropipe.families.diffusion.entries import architecture_named

    arch = architecture_named(info["architecture"])
    if info.get("kind", "lora") in ("lora", "dora") and hasattr(pipeline, "load_lora_weights") and _pipeline_loader_reads(pipeline, arch):
        pipeline.load_lora_weights(str(folder))
    else:  # the file's keys are under the architecture's denoiser name; a Wan 2.2 expert's go into its own transformer_2
        getattr(pipeline, info.get("denoiser") or arch.record.denoiser).load_lora_adapter(str(folder), weight_name="pytorch_lora_weights.safetensors", prefix=arch.record.denoiser)


def load_for_drawing(source: ModelSource, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """The pipeline of a run's checkpoint, a pipeline export or a LoRA export, on ``device``.

    Raises:
        ZeroPipeError: the run's pipeline folder or an export's base is gone, the checkpoint does not match, or the pipeline's
            own constructor needs a package that is missing (Cosmos-Predict2's builds NVIDIA's guardrail, ``cosmos_guardrail``).
    """
    try:
        return _load_for_drawing(source, device, dtype)
    except ImportError as err:
        # The pipeline class's own requirement, said by its constructor: the Draw page shows it with the fix it names.
        raise ZeroPipeError(f"the pipeline of {source.path} cannot be built here: {err}") from None


def refuse_modular(architecture: str | None) -> None:
    """A modular pipeline's entry (MiniMax-H3, LTX-2.5...) is refused before its weights load: the pipeline has no ``__call__``
    that takes a prompt, and Draw drives only those; the run's samples draw through the entry's own sampling."""
    if not architecture:
        return
    from diffusers.modular_pipelines import ModularPipeline

    from zeropipe.families.diffusion.entries import architecture_named

    try:
        cls = architecture_named(architecture).pipeline()
    except Exception:  # noqa: BLE001 - an unknown name: the folder's model_index.json decides, as pipeline_class says
        return
    if isinstance(cls, type) and issubclass(cls, ModularPipeline):
        raise ZeroPipeError(
            f"{architecture} runs through diffusers' modular pipeline {cls.__name__}, which Draw does not drive yet: its samples are drawn during "
            "training through the entry's own sampler; list prompts in generate.prompts (drawn every generate.sample_every steps) "
            "or press Sample now on the running run's page"
        )


def _load_for_drawing(source: ModelSource, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if source.kind == "run":
        from zeropipe.checkpoint.consolidate import consolidated_state_dict
        from zeropipe.families.diffusion.export import trained_denoiser
        from zeropipe.families.diffusion.prepare import read_plan
        from zeropipe.rundir import RunDir

        with contextlib.suppress(OSError, ValueError, TypeError):  # an unreadable plan: trained_denoiser says what is wrong below
            refuse_modular(read_plan(RunDir(source.path)).architecture)  # before the checkpoint is consolidated
        config = read_run_config(source.path)
        # zero_to_fp32 reports its progress on stdout.
        with contextlib.redirect_stdout(sys.stderr):
            state = consolidated_state_dict(source.checkpoint)
        arch, plan, pipeline_dir, denoiser = trained_denoiser(RunDir(source.path), config, source.checkpoint, state)
        del state
        if config.model.lora is not None:
            denoiser.fuse_lora(lora_scale=1.0)
            denoiser.unload_lora()
        pipeline = arch.pipeline().from_pretrained(str(pipeline_dir), **{plan.denoiser: denoiser}, torch_dtype=torch.float32)
    elif source.kind == "adapter":
        info = export_info(source.path)
        base = Path(info.get("base_pipeline") or "")
        if not is_pipeline_folder(base):
            raise ZeroPipeError(f"the LoRA {source.path} was trained on {base}, which is no longer a pipeline folder: restore it, or draw from the run's checkpoint")
        refuse_modular(info.get("architecture"))
        pipeline = pipeline_class(info.get("architecture")).from_pretrained(str(base), torch_dtype=torch.float32)
        load_adapter_export(pipeline, source.path, info)
    else:
        architecture = export_info(source.path).get("architecture")
        refuse_modular(architecture)
        pipeline = pipeline_class(architecture).from_pretrained(str(source.path), torch_dtype=torch.float32)
    pipeline = pipeline.to(device)
    if dtype != torch.float32:  # bf16 on a GPU (export.generate.pick_dtype); the CPU draws in fp32
        pipeline = pipeline.to(dtype=dtype)
    pipeline.set_progress_bar_config(disable=True)
    return LoadedModel(pipeline, None, source, device)


def draw(loaded: LoadedModel, out_dir: Path, prompt: str, negative_prompt: str, width: int, height: int, steps: int, guidance: float, seed: int, frames: int | None,
         on_step: Any = None) -> list[dict[str, Any]]:  # fmt: skip
    """Draw one picture (or clip) and write it into ``out_dir``; returns [{file, kind, width, height, frames}].

    Arguments the pipeline does not take (a negative prompt, a frame count for an image model) are left out.
    ``on_step(step, steps)`` is called after each denoising step through the pipeline's ``callback_on_step_end``
    (the UI's progress and Cancel: an exception raised there ends the drawing).
    """
    pipeline = loaded.model
    accepted = set(inspect.signature(pipeline.__call__).parameters)
    kwargs: dict[str, Any] = {
        "prompt": prompt, "height": height, "width": width, "num_inference_steps": steps,
        "generator": torch.Generator(device="cpu").manual_seed(seed),
    }  # fmt: skip
    if "guidance_scale" in accepted:
        kwargs["guidance_scale"] = guidance
        # A per-step schedule by default (Ideogram 4's), which the pipeline refuses beside one scale: the page's scale wins. Checked by
        # drawing from the tiny Ideogram 4 pipeline once (19 s on a loaded CI core: its pipeline always encodes 2048 tokens), not in CI.
        if "guidance_schedule" in accepted:
            kwargs["guidance_schedule"] = None
    if negative_prompt and "negative_prompt" in accepted:
        kwargs["negative_prompt"] = negative_prompt
    video = "num_frames" in accepted
    if video and frames:
        kwargs["num_frames"] = frames
    if "output_type" in accepted:
        kwargs["output_type"] = "np"
    stopped: list[BaseException] = []  # what on_step raised (Cancel): passed on as it is
    if on_step is not None and "callback_on_step_end" in accepted:

        def step_end(pipe, index, timestep, tensors):
            try:
                on_step(index + 1, int(getattr(pipe, "num_timesteps", 0) or steps))
            except BaseException as err:
                stopped.append(err)
                raise
            return tensors

        kwargs["callback_on_step_end"] = step_end
    from zeropipe.families.diffusion.sampler import pipeline_call

    try:
        with torch.no_grad():  # the shared sampler's pipeline call: Draw gives the prompt string, which the pipeline encodes
            result = pipeline_call(pipeline, kwargs)
    except Exception as err:
        if stopped and err is stopped[0]:
            raise
        # The pipeline's own refusal (an edit, image-to-video or layered pipeline needs an input image; a size it does not take): one
        # message that names the pipeline and what it said, a 400 on the Draw page, not an internal error.
        raise ZeroPipeError(
            f"{type(pipeline).__name__} could not draw from a prompt alone at {width}x{height} in {steps} steps: {type(err).__name__}: {str(err)[:400]}. "
            "Draw gives a prompt, a size, steps and guidance; a model that edits or animates an input image draws in the run's samples "
            "(generate.prompts with the data's images)"
        ) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(result, "frames") or hasattr(result, "video"):
        # Cosmos3OmniPipeline returns its one clip as ``video`` (frames, height, width, 3), the others a batch of clips as ``frames``.
        clip = to_uint8(np.asarray(result.video if hasattr(result, "video") else result.frames[0]))
        from zeropipe.data.videos import write_preview, write_video

        fps = clip_frame_rate(pipeline, accepted)
        mp4 = write_video(out_dir / "clip.mp4", clip, fps)
        preview = write_preview(out_dir / "clip.webp", clip, fps)
        row = {"file": mp4.name, "preview": preview.name, "kind": "video", "width": int(clip.shape[2]), "height": int(clip.shape[1]), "frames": int(clip.shape[0])}
        waveform = getattr(result, "audio", None)
        if waveform is not None:  # a pipeline that draws the clip's sound too (LTX2Pipeline): muxed into the mp4, as training's samples are
            from zeropipe.data.audio import loudness, mux_audio

            sound = np.asarray(torch.as_tensor(waveform)[0].float().cpu())
            mux_audio(mp4, sound, audio_sample_rate(pipeline))
            level = loudness(sound)
            row["audio_dbfs"] = round(level, 2) if math.isfinite(level) else None
        return [row]
    image = to_uint8(np.asarray(result.images[0]))
    from PIL import Image

    path = out_dir / "image.png"
    Image.fromarray(image).save(path)
    return [{"file": path.name, "kind": "image", "width": int(image.shape[1]), "height": int(image.shape[0]), "frames": 1}]


def clip_frame_rate(pipeline, accepted: set[str]) -> float:
    """The frame rate the pipeline drew at: its call's ``frame_rate`` default (LTX-Video, LTX-2: the audio lasts frames / that), else its config's fps, else 16."""
    if "frame_rate" in accepted:
        default = inspect.signature(pipeline.__call__).parameters["frame_rate"].default
        if isinstance(default, (int, float)) and default > 0:
            return float(default)
    return float(getattr(getattr(pipeline, "config", None), "fps", 0) or 16.0)


def audio_sample_rate(pipeline) -> int:
    """The rate of the waveform a pipeline returns with its frames: its vocoder's output rate (LTX2Pipeline's example says so)."""
    vocoder = getattr(pipeline, "vocoder", None)
    rate = getattr(getattr(vocoder, "config", None), "output_sampling_rate", None)
    if not rate:
        raise ZeroPipeError("the pipeline drew a clip's sound but has no vocoder whose config gives its sample rate (output_sampling_rate): the sound cannot be written")
    return int(rate)


def to_uint8(array: np.ndarray) -> np.ndarray:
    if array.dtype != np.uint8:
        array = (np.clip(array.astype(np.float32), 0, 1) * 255).round().astype(np.uint8)
    return array
