"""diffusion-pipe (github.com/tdrussell/diffusion-pipe): the main TOML and the dataset TOML it names.

diffusion-pipe trains with DeepSpeed's pipeline engine: `pipeline_stages` splits the model
across GPUs, and `blocks_to_swap` keeps blocks in host RAM. ZeRO-Pipe uses the standard engine
instead: ZeRO-3 shards the parameters across GPUs (what pipeline stages are for) and
`offload_param` keeps them in host RAM (what block swapping is for), for LoRA and full
fine-tunes alike.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import tomllib

from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.convert.common import Conversion, ConversionError, PeerDefault, find_path, is_unset, to_float, to_int
from zeropipe.convert.diffusion_pipe_dataset import DATASET_PEER_DEFAULTS, convert_dataset
from zeropipe.families.diffusion.entries import architectures


# Every [model] type diffusion-pipe's train.py accepts (models/*.py, docs/supported_models.md), as ZeRO-Pipe's
# architecture entry, or None where ZeRO-Pipe has none. The architecture itself is read from model.path's
# model_index.json: a qwen_image type on a Qwen-Image-Edit folder trains qwen-image-edit, on a Qwen-Image-Edit-2509/2511 folder
# (QwenImageEditPlusPipeline) qwen-image-edit-plus, flux on a Kontext folder flux-kontext.
DIFFUSION_PIPE_TYPES: dict[str, str | None] = {
    "sdxl": "sdxl",
    "sd3": "sd3",
    "flux": "flux",
    "chroma": "chroma",
    "qwen_image": "qwen-image",
    "z_image": "z-image",
    "flux2": "flux2",
    "wan": "wan",
    "hunyuan-video": "hunyuan-video",
    "ltx-video": "ltx-video",
    "lumina_2": "lumina2",
    "cosmos": None,
    "cosmos_predict2": "cosmos-predict2",
    "anima": None,
    "hidream": "hidream",
    "omnigen2": None,
    "hunyuan_image": "hunyuan-image",
    "auraflow": "auraflow",
    "hunyuan_video_15": "hunyuan-video-1.5",
    "ernie_image": "ernie-image",
    "ltx2": "ltx2",
    "ideogram4": "ideogram4",
    "krea2": "krea2",
    "minimax_h3": "minimax-h3",
    "kandinsky5": "kandinsky5-t2i",
    "longcat_video": None,
    "hy_framepack": None,
    "qwen_image21": "qwen-image-2.1",
}


def trainable_architecture(kind: str) -> str | None:
    """ZeRO-Pipe's architecture entry for a diffusion-pipe [model] type, or None.

    diffusion-pipe's own spelling (qwen_image, z_image) is mapped; ZeRO-Pipe's (qwen-image) is
    accepted too, for files written by hand.
    """
    name = DIFFUSION_PIPE_TYPES.get(kind, kind)
    return name if name is not None and name in architectures() else None


# Types that are several of ZeRO-Pipe's entries, told apart as diffusion-pipe tells them: by a word in the checkpoint's path
# (its models/kandinsky5.py: "i2v", else "t2v", else "t2i" in ckpt_path). The first word found wins; none: the type's own entry.
TYPE_VARIANTS = {"kandinsky5": (("i2v", "kandinsky5-i2v"), ("t2v", "kandinsky5-t2v"))}


def model_architecture(kind: str, model: dict[str, Any] | None = None) -> str | None:
    """The entry a diffusion-pipe [model] table trains: its type's, or the variant its checkpoint path names (TYPE_VARIANTS)."""
    path = next((str(model[key]) for key in MODEL_PATH_KEYS if model and key in model), "")
    for word, name in TYPE_VARIANTS.get(kind, ()):
        if word in path and name in architectures():
            return name
    return trainable_architecture(kind)


def is_video(kind: str, model: dict[str, Any] | None = None) -> bool:
    arch = architectures().get(model_architecture(kind, model) or "")
    return arch.record.video if arch is not None else kind in VIDEO_TYPES


VIDEO_TYPES = ("wan", "hunyuan-video", "ltx-video", "hunyuan_video_15", "ltx2", "cosmos", "longcat_video", "kandinsky5", "hy_framepack", "minimax_h3")
MODEL_PATH_KEYS = ("diffusers_path", "checkpoint_path", "ckpt_path")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
ADAMW_TYPES = ("adamw", "adamw_optimi", "adamw8bit", "adamw8bitkahan", "adamw_kahan", "adamw8bit_kahan")
SCHEDULES = ("constant", "linear", "cosine")
LR_DEFAULT = 2e-5  # ZeRO-Pipe's train.lr when the file sets none
# diffusion-pipe's video_clip_mode -> data.video.clip_mode
CLIP_MODES = {"single_beginning": "start", "single_middle": "middle", "multiple_overlapping": "multiple"}
# Wan 2.2 A14B: diffusion-pipe names the expert by transformer_path (its subfolder or its ComfyUI file).
EXPERT_NAMES = {"low_noise": "low_noise", "high_noise": "high_noise"}

# diffusion-pipe's defaults that differ from ZeRO-Pipe's, where its source sets them (github.com/tdrussell/diffusion-pipe at 8f83dbf):
# a file that leaves the key out trains with these there, so the conversion writes them.
PEER_DEFAULTS = {
    **DATASET_PEER_DEFAULTS,
    "shift": PeerDefault("model.shift", None, "model.diffusion.shift", "models/wan/wan.py:354, and every flow model alike: no shift, 1.0", "flow", written=1.0),
    "lr_scheduler": PeerDefault("lr_scheduler", "constant", "train.schedule", "train.py:849"),
    "alpha": PeerDefault("adapter.alpha", "the rank", "model.lora.alpha", "train.py:122, alpha = rank", "lora"),
    "dropout": PeerDefault("adapter.dropout", 0.0, "model.lora.dropout", "train.py:128", "lora"),
}
# diffusion-pipe's schedules end at these learning rates (train.py:853-855): linear at 0, cosine at eta_min 1e-6.
SCHEDULE_END_LR = {"linear": 0.0, "cosine": 1e-6}

# Keys with no ZeRO-Pipe counterpart, and why.
NOT_MAPPED = {
    "pipeline_stages": "ZeRO-Pipe runs the standard DeepSpeed engine, not the pipeline engine: ZeRO-3 (deepspeed.zero_stage: 3) shards the "
    "parameters across the GPUs instead, which is what pipeline stages are for",
    "partition_method": "pipeline parallelism only; ZeRO partitions every parameter evenly",
    "partition_split": "pipeline parallelism only; ZeRO partitions every parameter evenly",
    # The evaluation keys _eval does not map (issue 44: the validation loss, docs/diffusion.md).
    "eval_every_n_epochs": "ZeRO-Pipe evaluates every N optimizer steps, and at the end: set train.eval_every (steps per epoch = images x repeats / global batch)",
    "eval_every_n_examples": "ZeRO-Pipe evaluates every N optimizer steps, and at the end: set train.eval_every (examples / global batch)",
    "eval_before_first_step": "the validation loss is computed every train.eval_every steps and at the end; the loss on a fixed training batch before "
    "training is in summary.json (fixed_batch_loss_start)",
    "eval_micro_batch_size_per_gpu": "the validation loss runs one held-out image per forward pass, so that no image is dropped and the figure "
    "is the same on any number of GPUs",
    "image_eval_micro_batch_size_per_gpu": "the validation loss runs one held-out image or clip per forward pass",
    "eval_gradient_accumulation_steps": "the validation loss runs one held-out image per forward pass",
    "disable_block_swap_for_eval": "no block swap and no held-out evaluation",
    "save_every_n_epochs": "ZeRO-Pipe saves every N optimizer steps: set train.save_every (a final checkpoint is always saved)",
    "save_every_n_examples": "ZeRO-Pipe saves every N optimizer steps: set train.save_every",
    "checkpoint_every_n_epochs": "ZeRO-Pipe checkpoints every train.save_every steps (a final one always); `zeropipe train FILE --resume` continues from the latest",
    "checkpoint_every_n_minutes": "ZeRO-Pipe checkpoints every train.save_every steps, not by the clock; `zeropipe train FILE --resume` continues from the latest",
    "save_dtype": "chosen at export: `zeropipe export RUN --out DIR --dtype bf16`",
    "caching_batch_size": "caches are filled by one process per node before the ranks start (8 images or clips per VAE call, 16 captions per text-encoder call)",
    "map_num_proc": "images are decoded once by the launcher; no worker pool to size",
    "compile": "torch.compile is not used",
    "steps_per_print": "rank 0 logs every train.log_every steps; metrics.jsonl has every step",
    "x_axis_examples": "metrics.jsonl records both the step and the samples per second",
    "reentrant_activation_checkpointing": "ZeRO-Pipe picks the checkpointing implementation",
    "pseudo_huber_c": "ZeRO-Pipe trains with the mean squared error",
    "force_constant_lr": "set train.lr and train.schedule: constant",
    "image_micro_batch_size_per_gpu": "one micro-batch size for clips and images alike (train.micro_batch_size); a micro-batch holds one bucket (size and length)",
    "upload_hf_from_epoch": "nothing is uploaded; export with `zeropipe export RUN --out DIR`",
    "huggingface_repo": "nothing is uploaded; export with `zeropipe export RUN --out DIR`",
}
MODEL_NOT_MAPPED = {
    "audio_vae": "the audio VAE comes from the diffusers pipeline folder (MiniMax-H3: audio_vae/)",
    "image_shift": "ZeRO-Pipe has one timestep shift for every bucket (model.diffusion.shift); diffusion-pipe's own shift for one-frame items is not kept",
    "debiased_estimation_loss": "not implemented; model.diffusion.min_snr_gamma is the loss weighting ZeRO-Pipe has",
    "text_encoder_lr": "ZeRO-Pipe trains the denoiser only; the text encoders stay frozen (and cached)",
    "text_encoder_1_lr": "ZeRO-Pipe trains the denoiser only; the text encoders stay frozen (and cached)",
    "text_encoder_2_lr": "ZeRO-Pipe trains the denoiser only; the text encoders stay frozen (and cached)",
    "llama3_path": "HiDream's Llama 3.1 comes from the diffusers pipeline folder (text_encoder_4)",
    "llama3_4bit": "the text encoders stay in deepspeed.precision; with data.cache.text (the default) Llama is loaded only while the captions are cached",
    "max_llama3_sequence_length": "HiDream's prompts are encoded at HiDreamImagePipeline's 128 tokens for every encoder",
    "max_sequence_length": "AuraFlow's prompts are encoded at AuraFlowPipeline's 256 tokens; Pony V7's 768 is not configurable yet",
    "byt5_path": "HunyuanImage's glyph ByT5 comes from the diffusers pipeline folder (text_encoder_2)",
    "text_encoder_path": "text encoders come from the diffusers pipeline folder",
    "lumina_shift": "ZeRO-Pipe's flow-matching shift is a fixed number (model.diffusion.shift), not resolution-dependent",
    "bypass_guidance_embedding": "the guidance input of Flux is fed model.diffusion.guidance, not bypassed",
    "llm_path": "text encoders come from the diffusers pipeline folder",
    "clip_path": "text encoders come from the diffusers pipeline folder",
    "vae_path": "the VAE comes from the diffusers pipeline folder",
    "t5_path": "text encoders come from the diffusers pipeline folder",
    "single_file_path": "ZeRO-Pipe loads diffusers pipeline folders; single files are not read",
    "diffusion_model": "a single-file checkpoint in ComfyUI's layout; ZeRO-Pipe reads the diffusers release of the same model: set model.path to it",
    "text_encoder": "the text encoder comes from the diffusers pipeline folder (LTX-2: its Gemma 3 12B in text_encoder/)",
    "first_frame_conditioning_p": "image-to-video is trained from an image-to-video pipeline (WanImageToVideoPipeline, always conditioned on the first frame); there is no probability to set",
}


def convert(path: Path, raw: dict[str, Any], links_dir: Path | None = None) -> Conversion:
    conversion = Conversion("diffusion-pipe", path)
    rest = dict(raw)
    conversion.set("model.family", "diffusion", "diffusion-pipe trains diffusion models")
    if "output_dir" in rest:
        conversion.set("run.output_dir", str(rest.pop("output_dir")), "from output_dir (the run is written to output_dir/run.name)")

    model = rest.pop("model", None)
    if not isinstance(model, dict) or "type" not in model:
        raise ConversionError(f"{path}: no [model] table with a type (e.g. type = 'flux'): this does not look like a diffusion-pipe config")
    _model(conversion, dict(model), path.parent, lora=isinstance(rest.get("adapter"), dict))
    video = is_video(str(model["type"]), model)
    adapter = rest.pop("adapter", None)
    if isinstance(adapter, dict):
        _adapter(conversion, dict(adapter))
    else:
        conversion.set("model.lora", None, "no [adapter] table: a full fine-tune")
    optimizer = rest.pop("optimizer", None)
    if isinstance(optimizer, dict):
        _optimizer(conversion, dict(optimizer))
    monitoring = rest.pop("monitoring", None)
    if isinstance(monitoring, dict):
        _monitoring(conversion, dict(monitoring))

    _training(conversion, rest)
    clip_mode = rest.pop("video_clip_mode", None)
    if clip_mode is not None:
        if not video:
            conversion.skip("video_clip_mode", f"{clip_mode!r}: applies to video models only")
        elif clip_mode in CLIP_MODES:
            conversion.set("data.video.clip_mode", CLIP_MODES[clip_mode], f"from video_clip_mode = {clip_mode!r}")
        else:
            conversion.skip("video_clip_mode", f"{clip_mode!r}: ZeRO-Pipe takes {', '.join(CLIP_MODES)} (data.video.clip_mode start, middle, multiple)")

    dataset = rest.pop("dataset", None)
    if not isinstance(dataset, str):
        raise ConversionError(f"{path}: no dataset = 'path/to/dataset.toml': diffusion-pipe names its dataset TOML there; add it")
    dataset_path = find_path(dataset, Path.cwd(), path.parent)
    if dataset_path is None or not dataset_path.is_file():
        raise ConversionError(
            f"{path}: dataset = {dataset!r} not found (looked relative to {Path.cwd()} and {path.parent}): fix the path"
        )
    convert_dataset(conversion, dataset_path, links_dir or dataset_path.with_name(dataset_path.stem + ".zeropipe-images"), video)
    _same_latent_frames(conversion, str(model["type"]))

    _eval(conversion, rest, path, video)

    for key, value in rest.items():
        conversion.skip(key, NOT_MAPPED.get(key, f"not a diffusion-pipe key ZeRO-Pipe knows ({value!r}): left out"))
    return conversion


# Types whose clip lengths diffusion-pipe counts otherwise than the diffusers pipeline ZeRO-Pipe's entry follows, and the length
# with the same latent frames. MiniMax-H3: diffusion-pipe rounds a clip down to whole 17-frame VAE chunks (models/minimax_h3.py,
# PreprocessMediaFileMinimax.align_frames: 17k frames, the VAE's 3 dropped latent frames leaving 5k-3, under 17 frames one frame);
# diffusers' pipeline takes 17k+5 frames (5k+2 latent frames): 17(k-1)+5 = 17k-12 frames give diffusion-pipe's 5k-3.
SAME_LATENT_FRAMES = {"minimax_h3": lambda frames: 1 if frames < 17 else 17 * (frames // 17) - 12}


def _same_latent_frames(conversion: Conversion, kind: str) -> None:
    """data.video.frame_buckets in the entry's own clip lengths, where diffusion-pipe counts them otherwise (SAME_LATENT_FRAMES)."""
    entry = conversion.entries.get("data.video.frame_buckets")
    if kind not in SAME_LATENT_FRAMES or entry is None:
        return
    theirs = list(entry.value)
    ours = sorted({SAME_LATENT_FRAMES[kind](frames) for frames in theirs})
    if ours != theirs:
        conversion.set(
            "data.video.frame_buckets", ours,
            f"{entry.comment}; diffusion-pipe's {theirs} frames, rounded down to whole 17-frame chunks (17k: 5k-3 latent frames), are "
            f"{ours} in the 17k+5 frames diffusers' MiniMax-H3 pipeline takes (the same latent frames)",
        )


def _eval(conversion: Conversion, rest: dict[str, Any], path: Path, video: bool) -> None:
    """eval_datasets (diffusion-pipe's held-out datasets, train.py) as data.eval_path, and eval_every_n_steps as train.eval_every.

    diffusion-pipe evaluates each eval dataset at the timestep quantiles 0.1-0.9 (TIMESTEP_QUANTILES_FOR_EVAL); so does
    ZeRO-Pipe's validation loss, with the noise fixed per image (families/diffusion/validation.py).
    """
    datasets = rest.pop("eval_datasets", None)
    folder = None
    if isinstance(datasets, list) and datasets:
        first = datasets[0] if isinstance(datasets[0], dict) else {}
        if len(datasets) > 1:
            conversion.skip("eval_datasets", f"{len(datasets)} eval datasets: ZeRO-Pipe evaluates one held-out folder (data.eval_path); the first is used")
        name = first.get("config")
        dataset_path = find_path(name, Path.cwd(), path.parent) if isinstance(name, str) else None
        if dataset_path is None or not dataset_path.is_file():
            conversion.skip("eval_datasets[0].config", f"{name!r} not found (looked relative to {Path.cwd()} and {path.parent}): set data.eval_path to the held-out images' folder")
        else:
            try:
                directories = tomllib.loads(dataset_path.read_text(encoding="utf-8", errors="replace")).get("directory") or []
            except tomllib.TOMLDecodeError as err:
                raise ConversionError(f"{dataset_path} (an eval dataset TOML) is not valid TOML: {err}; fix the syntax") from None
            folders = [d.get("path") for d in directories if isinstance(d, dict) and isinstance(d.get("path"), str)]
            if not folders:
                conversion.skip("eval_datasets[0]", f"{dataset_path} has no [[directory]] path: set data.eval_path to the held-out images' folder")
            else:
                found = find_path(folders[0], Path.cwd(), dataset_path.parent)
                folder = found if found is not None else Path(folders[0]).expanduser()
                conversion.set("data.eval_path", str(folder), f"from eval_datasets[0] ({first.get('name', dataset_path.stem)}): its [[directory]] path, the held-out {'clips' if video else 'images'}")
                if len(folders) > 1:
                    conversion.skip(f"eval_datasets[0] ({dataset_path.name})", f"{len(folders)} [[directory]] entries: data.eval_path is one folder; the first is used")
    steps = rest.pop("eval_every_n_steps", None)
    if steps is not None:
        if folder is not None:
            conversion.set("train.eval_every", to_int(steps, "eval_every_n_steps"), "from eval_every_n_steps: the validation loss at fixed timesteps and noise")
        else:
            conversion.skip("eval_every_n_steps", f"{steps}: no eval_datasets, so no held-out images to evaluate on: set data.eval_path (or data.eval_fraction) and train.eval_every")
    if folder is None and "eval_every_n_epochs" in rest:
        conversion.skip("eval_every_n_epochs", f"{rest.pop('eval_every_n_epochs')}: no eval_datasets, so no held-out images to evaluate on: set data.eval_path (or data.eval_fraction) and train.eval_every")


def _model(conversion: Conversion, model: dict[str, Any], base: Path, lora: bool = True) -> None:
    kind = str(model.pop("type"))
    arch = model_architecture(kind, model)
    if arch is None:
        what = "a video model" if kind in VIDEO_TYPES else "an image architecture"
        trained = sorted(name for name, ours in DIFFUSION_PIPE_TYPES.items() if ours is not None)
        reason = (
            f"[model] type = {kind!r} is {what} ZeRO-Pipe does not train yet (of diffusion-pipe's types it trains {', '.join(trained)}); "
            "the rest of this file is converted so that it runs once the architecture is added"
        )
        conversion.blocking.append(reason)
        conversion.skip("model.type", reason)
    elif kind == "cosmos_predict2" and "llm_path" in model:
        # diffusion-pipe trains Anima (Cosmos-Predict2's transformer with an LLM adapter and Qwen3 prompts) under this type when llm_path is set.
        reason = (
            f"[model] type = 'cosmos_predict2' with llm_path = {model['llm_path']!r} is Anima (Cosmos-Predict2 with an LLM adapter and Qwen3 prompts), "
            "which ZeRO-Pipe does not train yet; without llm_path (t5_path) it is Cosmos-Predict2, which it trains"
        )
        conversion.blocking.append(reason)
        conversion.skip("model.type", reason)
    else:
        conversion.already.append(f"[model] type = {kind!r} (ZeRO-Pipe's {arch}; the architecture is read from model.path's model_index.json)")
    dtype = model.pop("dtype", None)
    if dtype is not None:
        if dtype in DTYPES:
            conversion.set("deepspeed.precision", DTYPES[dtype], f"from [model] dtype = {dtype!r}")
        else:
            conversion.skip("model.dtype", f"{dtype!r} is not bfloat16, float16 or float32")

    named = [key for key in MODEL_PATH_KEYS if key in model]
    if not named and kind in COMFY_RELEASES and "diffusion_model" in model:
        # diffusion-pipe's ComfyUI-backed types name single files (diffusion_model, vae, text_encoders), not a folder.
        release = COMFY_RELEASES[kind]
        for key in ("diffusion_model", "vae", "audio_vae", "text_encoders", "text_encoder"):
            if key in model:
                conversion.skip(f"model.{key}", f"{model.pop(key)!r} is a ComfyUI file; ZeRO-Pipe reads the diffusers release of the same model ({release}): set model.path to it")
    elif not named:
        release = f" ({FOLDER_RELEASES[kind]})" if kind in FOLDER_RELEASES else ""
        conversion.skip("model", f"no {' / '.join(MODEL_PATH_KEYS)}: set model.path to a diffusers pipeline folder{release}")
    else:
        key = named[0]
        value = str(model.pop(key))
        found = find_path(value, Path.cwd(), base)
        if found is not None and is_pipeline_folder(found):
            conversion.set("model.path", str(found), f"from [model] {key} (a diffusers pipeline folder)")
        else:
            conversion.set("model.path", value, f"from [model] {key}: see the list above")
            if found is not None and found.is_file():
                cls = architectures()[arch].record.pipeline_class if arch else "DiffusionPipeline"
                why = (
                    f"{value} is a single-file checkpoint; ZeRO-Pipe loads diffusers pipeline folders: "
                    f"`python -c \"import diffusers; diffusers.{cls}.from_single_file('{value}').save_pretrained('DIR')\"`, then set model.path: DIR"
                )
            elif kind in DIFFUSERS_RELEASES:
                releases, fallback = DIFFUSERS_RELEASES[kind]
                name = Path(value).name
                example = next((template.format(name=name) for pattern, template in releases if re.fullmatch(pattern, name)), fallback)
                why = (
                    f"{value} is not a diffusers pipeline folder (no model_index.json there): ZeRO-Pipe reads the model from the diffusers "
                    f"release of the same model ({example}): point model.path at it"
                )
            else:
                why = f"{value} is not a diffusers pipeline folder (no model_index.json there): point model.path at one"
            conversion.skip(f"model.{key}", why)
        for other in named[1:]:
            conversion.skip(f"model.{other}", f"model.path is taken from {key}; {other} = {model.pop(other)!r} is not used")
    if "transformer_path" in model:
        value = str(model.pop("transformer_path"))
        if kind in TRANSFORMER_PATHS:
            TRANSFORMER_PATHS[kind](conversion, value, base)
        elif kind == "chroma":
            # diffusion-pipe loads Chroma's transformer file over a FLUX.1 diffusers folder (for its VAE and T5); ZeRO-Pipe takes the
            # architecture from model.path, so that folder would train FLUX.1 with Chroma's weights renamed as FLUX's.
            conversion.blocking.append(
                f"[model] transformer_path = {value!r} is Chroma's transformer over a FLUX.1 diffusers folder; ZeRO-Pipe reads Chroma from a ChromaPipeline "
                "diffusers folder (e.g. lodestones/Chroma1-HD converted by diffusers): point model.path at one (no transformer_path needed)"
            )
            conversion.skip("model.transformer_path", "Chroma over a FLUX.1 folder (see CANNOT TRAIN YET above)")
        elif arch is not None and (Path(value).suffix == ".safetensors" or (find_path(value, Path.cwd(), base) or Path(value)).is_file()):
            found = find_path(value, Path.cwd(), base)
            conversion.set(
                "model.diffusion.denoiser_file", str(found or value),
                f"from [model] transformer_path = {value!r}: a single-file transformer (original or ComfyUI layout) loaded over model.path's",
            )
            marker, note = TRANSFORMER_FILE_NOTES.get(kind, ("", ""))
            if marker and marker in Path(value).name.lower():
                conversion.skip(f"model.transformer_path ({marker})", note)
        else:
            conversion.skip("model.transformer_path", f"{value!r}: not a .safetensors file ZeRO-Pipe can read over model.path; the denoiser comes from model.path")
    for key in ("transformer_dtype", "diffusion_model_dtype"):
        if key in model:
            _base_storage(conversion, key, str(model.pop(key)), lora)
    for bound in ("min_t", "max_t"):
        if bound in model:
            conversion.set(f"model.diffusion.{bound}", to_float(model.pop(bound), f"model.{bound}"), f"from [model] {bound} (the training timestep range, 0 no noise, 1 pure noise)")

    _shift(conversion, model, arch)
    _cfg(conversion, model, arch)
    scale = model.pop("sigmoid_scale", None)
    if scale is not None:
        # utils/common.py:142-144 (get_t_distribution): t = sigmoid(sigmoid_scale x N(0, 1)), a logit-normal of that std.
        conversion.set("model.diffusion.logit_std", to_float(scale, "model.sigmoid_scale"), "from [model] sigmoid_scale (the std of the logit-normal timesteps)")
    sampling = model.pop("timestep_sample_method", None)
    if sampling is not None:
        if sampling in ("logit_normal", "uniform"):
            conversion.set("model.diffusion.timestep_sampling", sampling, f"from [model] timestep_sample_method = {sampling!r}")
        else:
            conversion.skip("model.timestep_sample_method", f"{sampling!r}: ZeRO-Pipe samples timesteps uniform or logit_normal")
    if model.pop("v_pred", False):
        conversion.set("model.diffusion.prediction_type", "v_prediction", "from [model] v_pred = true")
    gamma = model.pop("min_snr_gamma", None)
    if gamma is not None:
        conversion.set("model.diffusion.min_snr_gamma", to_float(gamma, "model.min_snr_gamma"), "from [model] min_snr_gamma")
    unet_lr = model.pop("unet_lr", None)
    if unet_lr is not None:
        conversion.set("train.lr", to_float(unet_lr, "model.unet_lr"), "from [model] unet_lr (the UNet is what trains)")
    for key, value in model.items():
        why = MODEL_NOT_MAPPED.get(key, f"{value!r}: no ZeRO-Pipe equivalent, left out")
        if key == "diffusion_model" and kind in COMFY_RELEASES:
            why = f"{why} ({COMFY_RELEASES[kind]})"
        conversion.skip(f"model.{key}", why)


# diffusion-pipe shifts its training timesteps only when [model] shift is set, in every flow model alike
# (models/wan/wan.py:354-355 at 8f83dbf, `if shift := self.model_config.get('shift', None): t = (t * shift) / (1 + (shift - 1) * t)`;
# models/flux.py:362, models/qwen_image.py:445, models/z_image.py:82, models/hunyuan_video.py:451, models/flux2.py:162 the same).
# Unset (or 0) is no shift, 1.0 (PEER_DEFAULTS["shift"]); ZeRO-Pipe's model.diffusion.shift: auto would take the scheduler's (Wan 3.0/5.0,
# HunyuanVideo 7.0...).


def _shift(conversion: Conversion, model: dict[str, Any], arch: str | None) -> None:
    """[model] shift, or diffusion-pipe's default of none, as model.diffusion.shift (flow-matching entries only)."""
    shift = model.pop("shift", None)
    flux_shift = model.pop("flux_shift", None)
    entry = architectures().get(arch or "")
    if entry is not None and entry.record.objective != "flow":
        if shift is not None:
            conversion.skip("model.shift", f"{shift!r}: a timestep shift applies to flow-matching models; {arch} trains on a DDPM schedule")
        if flux_shift:
            conversion.skip("model.flux_shift", "a timestep shift applies to flow-matching models only")
        return
    if shift:
        conversion.set("model.diffusion.shift", to_float(shift, "model.shift"), "from [model] shift (diffusion-pipe: t = shift*t / (1 + (shift-1)*t))")
        if flux_shift:
            conversion.skip("model.flux_shift", "[model] shift is set, which diffusion-pipe applies instead of flux_shift (models/flux.py:362-364)")
        return
    if flux_shift:
        # A shift by the image's token count (sd-scripts' flux_shift); ZeRO-Pipe's is one number for every bucket.
        conversion.set(
            "model.diffusion.shift", "auto",
            "from [model] flux_shift = true: diffusion-pipe shifts by each bucket's token count (e^mu, mu 0.5 at 256 tokens to 1.15 at 4096, "
            "utils/common.py:118); ZeRO-Pipe's shift is one number: auto takes the scheduler's (FLUX.1: 3.0, near e^1.15 = 3.16 at 1024 px)",
        )
        return
    conversion.default(PEER_DEFAULTS["shift"])


def _cfg(conversion: Conversion, model: dict[str, Any], arch: str | None) -> None:
    """[model] cfg (diffusion-pipe's CFG-augmented training of MiniMax-H3, models/minimax_h3.py) as model.diffusion.guidance_preserving."""
    from zeropipe.families.diffusion.parts.guidance import KEY

    cfg = model.pop("cfg", None)
    if cfg is None:
        return
    scale = to_float(cfg, "model.cfg")
    entry = architectures().get(arch or "")
    if scale <= 1.0:
        conversion.skip("model.cfg", f"{cfg!r}: diffusion-pipe trains plain flow matching at 1 or below (no unconditional branch), as ZeRO-Pipe does without {KEY}")
    elif entry is None or KEY not in entry.record.text.config_keys():
        conversion.skip("model.cfg", f"{cfg!r}: the {arch} entry does not offer the guidance-preserving objective")
    else:
        conversion.set(KEY, scale, "from [model] cfg: diffusion-pipe's CFG-augmented training (the raw velocity recovered with the model's own unconditional one is fitted)")


# diffusion-pipe's storage dtypes of the frozen denoiser -> model.quantization.format.
BASE_STORAGE = {"float8": "fp8", "float8_e4m3fn": "fp8", "fp8": "fp8", "float8_e5m2": "fp8_e5m2"}


def _base_storage(conversion: Conversion, key: str, value: str, lora: bool) -> None:
    """[model] transformer_dtype / diffusion_model_dtype: the frozen denoiser's storage, fp8 kept as model.quantization."""
    if value in BASE_STORAGE and not lora:
        conversion.skip(f"model.{key}", f"{value!r}: a quantized base trains adapters only, and this file has no [adapter]: the full fine-tune holds the base in deepspeed.precision")
    elif value in BASE_STORAGE:
        conversion.set(
            "model.quantization.format", BASE_STORAGE[value],
            f"from [model] {key} = {value!r}: the denoiser's block linears stored in {BASE_STORAGE[value]} for LoRA (ZeRO-3 partitions the bytes); "
            "with a float32 scale per output channel where diffusion-pipe casts without a scale (model.quantization.scale: tensor for one per tensor)",
        )
    elif value == "nf4" and lora:
        conversion.set(
            "model.quantization.format", "nf4",
            f"from [model] {key} = 'nf4': the denoiser's block linears in bitsandbytes' nf4 for LoRA; every rank holds the 4-bit base (ZeRO-0..2)",
        )
    elif value in DTYPES:
        conversion.already.append(f"[model] {key} = {value!r} (the base is held in deepspeed.precision)")
    else:
        conversion.skip(
            f"model.{key}", f"{value!r}: ZeRO-Pipe stores a diffusion base for LoRA in fp8 (float8 / float8_e5m2) or nf4; "
            "set model.quantization: fp8 for an 8-bit base"
        )


def _wan_transformer(conversion: Conversion, value: str, base: Path) -> None:
    """diffusion-pipe's Wan transformer_path: a ComfyUI/original single file, or Wan 2.2 A14B's expert subfolder."""
    found = find_path(value, Path.cwd(), base)
    expert = next((name for marker, name in EXPERT_NAMES.items() if marker in Path(value).name.lower()), None)
    if expert is not None:
        conversion.set(
            "model.diffusion.expert", expert,
            f"from [model] transformer_path = {value!r}: Wan 2.2 A14B's {expert.replace('_', '-')} expert "
            f"({'transformer_2' if expert == 'low_noise' else 'transformer'}/ of the diffusers pipeline; min_t/max_t default to its side of the boundary)",
        )
    if (found is not None and found.is_file()) or Path(value).suffix == ".safetensors":
        conversion.set("model.diffusion.denoiser_file", str(found or value), f"from [model] transformer_path = {value!r}: a single-file transformer (original or ComfyUI layout) loaded over model.path's")
    elif expert is None:
        conversion.skip("model.transformer_path", f"{value!r}: neither a .safetensors file nor an expert subfolder (low_noise_model / high_noise_model): the transformer comes from model.path")


# [model] types whose transformer_path ZeRO-Pipe reads, and how; types whose original checkpoint
# folders have a diffusers release of their own on the Hub (the name it goes by there).
TRANSFORMER_PATHS = {"wan": _wan_transformer}
# type -> (a word in a transformer_path file name, what loading that file over model.path's folder means)
TRANSFORMER_FILE_NOTES = {
    "flux": ("kontext", "a FLUX.1 Kontext file over a FLUX.1 folder trains as text-to-image FLUX.1; for edit pairs (control_path) point model.path at a "
                        "FluxKontextPipeline diffusers folder instead"),
}
# diffusion-pipe types that load ComfyUI files, and the diffusers release ZeRO-Pipe reads instead.
# type -> the diffusers release for model.path, for types whose diffusion-pipe config names single files and no folder.
FOLDER_RELEASES = {
    "cosmos_predict2": "nvidia/Cosmos-Predict2-2B-Text2Image or nvidia/Cosmos-Predict2-14B-Text2Image, the repository of transformer_path's model.pt, "
                       "holds the diffusers folder too; diffusion-pipe trains its text-to-image variants",
}
COMFY_RELEASES = {
    "hunyuan_video_15": "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v, or -480p_i2v for image-to-video",
    # diffusion-pipe's docs/supported_models.md (at 8f83dbf) configures these types with ComfyUI files only (diffusion_model, vae, text_encoders).
    "ltx2": "Lightricks/LTX-2 (its ComfyUI file holds the transformer, both VAEs and the vocoder)",
    "minimax_h3": "MiniMaxAI/MiniMax-H3 (diffusers' modular release: modular_model_index.json with transformer/, vae/, audio_vae/, text_encoder/)",
    "z_image": "Tongyi-MAI/Z-Image-Turbo, or the Z-Image base release the file was made from (a ZImagePipeline folder)",
    "flux2": "black-forest-labs/FLUX.2-dev, or for a klein file the FLUX.2 [klein] release of the same size (a Flux2KleinPipeline folder)",
    "krea2": "the diffusers release of Krea 2 (a folder with model_index.json)",
    "ernie_image": "baidu/ERNIE-Image",
    "ideogram4": "the diffusers release of Ideogram 4 (a folder with model_index.json)",
}
# type -> ((an original release's folder name, its diffusers release on the Hub), ...), what to say for any other folder name
DIFFUSERS_RELEASES = {
    "wan": (
        ((r"Wan2\.[12]-(T2V|I2V|TI2V|FLF2V|VACE)-[\d.]+B(-\d+P)?", "Wan-AI/{name}-Diffusers"), (r"SkyReels-V2-(T2V|I2V)-[\d.]+B-\d+P", "Skywork/{name}-Diffusers")),
        "the Wan-AI/Wan2.x-...-Diffusers (or Skywork/SkyReels-V2-...-Diffusers) repository of the same size and task",
    ),
    # diffusion-pipe reads Kandinsky 5's original files (kandinsky5lite_t2v_sft_5s.safetensors ...); diffusers' docstrings name the releases.
    "kandinsky5": (
        (),
        "the kandinskylab/Kandinsky-5.0-...-Diffusers repository of the same model and task, e.g. kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers, "
        "kandinskylab/Kandinsky-5.0-I2V-Pro-sft-5s-Diffusers or kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers",
    ),
}


def _adapter(conversion: Conversion, adapter: dict[str, Any]) -> None:
    kind = adapter.pop("type", "lora")
    rank = to_int(adapter.pop("rank"), "adapter.rank") if "rank" in adapter else 16
    if kind == "lokr":
        # diffusion-pipe's "very high rank" (1e6) means full-matrix Kronecker factors; peft's LoKr builds full
        # factors too wherever r is at least half a factor's side, so the rank carries over as it is.
        conversion.set("model.lora.kind", "lokr", "from [adapter] type = 'lokr' (peft's LoKr)")
        if "decompose_factor" in adapter:
            conversion.set("model.lora.factor", to_int(adapter.pop("decompose_factor"), "adapter.decompose_factor"), "from [adapter] decompose_factor")
    elif kind != "lora":
        rank = 16 if rank > 1024 else rank
        conversion.skip("adapter.type", f"{kind!r}: ZeRO-Pipe trains lora, dora, lokr and loha adapters; converted as LoRA of rank {rank}: check model.lora")
    conversion.set("model.lora.r", rank, "from [adapter] rank")
    alpha = adapter.pop("alpha", None)
    if alpha is not None:
        conversion.set("model.lora.alpha", to_float(alpha, "adapter.alpha"), "from [adapter] alpha")
    else:
        conversion.default(PEER_DEFAULTS["alpha"], float(rank))
    dropout = adapter.pop("dropout", None)
    if kind == "lokr" and dropout:
        conversion.skip("adapter.dropout", f"{dropout!r}: peft's LoKr has no dropout on its input; trained without")
        dropout = None
    if dropout is not None:
        conversion.set("model.lora.dropout", to_float(dropout, "adapter.dropout"), "from [adapter] dropout")
    else:
        conversion.default(PEER_DEFAULTS["dropout"])
    conversion.skip(
        "adapter (target modules)",
        "diffusion-pipe adapts every linear layer of the transformer blocks; model.lora.target_modules: auto adapts the attention "
        "projections (to_q, to_k, to_v, to_out.0): list more module names there to match",
    )
    if "dtype" in adapter:
        conversion.skip("adapter.dtype", f"{adapter.pop('dtype')!r}: adapters train in deepspeed.precision with fp32 master weights")
    if "init_from_existing" in adapter:
        conversion.skip("adapter.init_from_existing", "starting from a saved LoRA is not supported: fuse it into the pipeline first, or start fresh")
    for key, value in adapter.items():
        conversion.skip(f"adapter.{key}", f"{value!r}: no ZeRO-Pipe equivalent, left out")


# diffusion-pipe's optimizer types -> train.optimizer. Its Kahan-summation types stay DeepSpeed's AdamW (as before): Kahan
# summation makes up for stepping bf16 weights in place, which DeepSpeed's fp32 master weights already do.
OPTIMIZER_TYPES = {"adamw8bit": "adamw8bit", "prodigy": "prodigy"}


def _optimizer(conversion: Conversion, optimizer: dict[str, Any]) -> None:
    kind = str(optimizer.pop("type", "adamw"))
    if kind.lower() in OPTIMIZER_TYPES:
        chosen = OPTIMIZER_TYPES[kind.lower()]
        conversion.set(
            "train.optimizer", chosen,
            f"from [optimizer] type {kind!r}" + (" (bitsandbytes' AdamW8bit)" if chosen == "adamw8bit" else " (prodigyopt; lr is its multiplier; ZeRO-0)")
            + ": docs/optimizers.md",
        )
        if chosen == "prodigy":
            for key in [k for k in optimizer if k not in ("lr", "betas", "weight_decay", "eps")]:
                conversion.skip(f"optimizer.{key}", f"{optimizer.pop(key)!r}: ZeRO-Pipe builds Prodigy with its lr, betas, weight_decay and eps; prodigyopt's default is used for {key}")
    if kind.lower() not in ADAMW_TYPES and kind.lower() not in OPTIMIZER_TYPES:
        conversion.skip(
            "optimizer.type",
            f"{kind!r}: ZeRO-Pipe lets DeepSpeed build AdamW; its lr and betas are left at ZeRO-Pipe's defaults because {kind}'s do not carry over",
        )
        for key in list(optimizer):
            conversion.skip(f"optimizer.{key}", f"belongs to {kind}, not used")
        return
    if "lr" in optimizer and "train.lr" not in conversion.entries:
        conversion.set("train.lr", to_float(optimizer.pop("lr"), "optimizer.lr"), f"from [optimizer] lr" + ("" if kind.lower() in OPTIMIZER_TYPES else f"; type {kind!r} becomes DeepSpeed's AdamW (its Kahan-summation variant is not used)"))
    elif "lr" in optimizer:
        conversion.skip("optimizer.lr", f"{optimizer.pop('lr')!r}: [model] unet_lr is used instead")
    betas = optimizer.pop("betas", None)
    if isinstance(betas, list) and len(betas) == 2:
        conversion.set("train.adam_beta1", to_float(betas[0], "optimizer.betas"), "from [optimizer] betas")
        conversion.set("train.adam_beta2", to_float(betas[1], "optimizer.betas"), "from [optimizer] betas")
    if "weight_decay" in optimizer:
        conversion.set("train.weight_decay", to_float(optimizer.pop("weight_decay"), "optimizer.weight_decay"), "from [optimizer] weight_decay")
    if "eps" in optimizer:
        conversion.set("train.adam_eps", to_float(optimizer.pop("eps"), "optimizer.eps"), "from [optimizer] eps")
    for key, value in optimizer.items():
        conversion.skip(f"optimizer.{key}", f"{value!r}: not an AdamW setting ZeRO-Pipe has (gradient release and 8-bit states are not used)")


def _monitoring(conversion: Conversion, monitoring: dict[str, Any]) -> None:
    if monitoring.get("enable_wandb") is False:
        conversion.already.append("[monitoring] enable_wandb = false (logging.wandb is off unless set)")
    if monitoring.pop("enable_wandb", False):
        conversion.set("logging.wandb", True, "from [monitoring] enable_wandb")
        if monitoring.get("wandb_tracker_name"):
            conversion.set("logging.wandb_project", str(monitoring.pop("wandb_tracker_name")), "from [monitoring] wandb_tracker_name")
    if monitoring.get("wandb_api_key"):
        conversion.skip("monitoring.wandb_api_key", "not written into run configs: export WANDB_API_KEY instead")
    monitoring.pop("wandb_api_key", None)
    if monitoring.get("wandb_run_name"):
        conversion.skip("monitoring.wandb_run_name", "the W&B run is named after run.name")
    for key, value in monitoring.items():
        if value not in ("", None, False) and key not in ("wandb_run_name",):
            conversion.skip(f"monitoring.{key}", f"{value!r}: no ZeRO-Pipe equivalent")


def _training(conversion: Conversion, rest: dict[str, Any]) -> None:
    if "epochs" in rest:
        conversion.set("train.epochs", to_float(rest.pop("epochs"), "epochs"), "from epochs")
    if "max_steps" in rest:
        conversion.set("train.max_steps", to_int(rest.pop("max_steps"), "max_steps"), "from max_steps (wins over train.epochs)")
    micro = rest.pop("micro_batch_size_per_gpu", None)
    if isinstance(micro, int):
        conversion.set("train.micro_batch_size", micro, "from micro_batch_size_per_gpu")
    elif isinstance(micro, list) and micro and isinstance(micro[0], list) and len(micro[0]) == 2:
        first = micro[0]
        conversion.set("train.micro_batch_size", to_int(first[1], "micro_batch_size_per_gpu"), f"from micro_batch_size_per_gpu (the first entry, {first})")
        conversion.skip("micro_batch_size_per_gpu", f"{micro}: one micro-batch size per resolution is not supported; the first entry is used")
    elif micro is not None:
        raise ConversionError(f"micro_batch_size_per_gpu = {micro!r} is neither a number nor [[resolution, size], ...]: fix it in the source file")
    if "gradient_accumulation_steps" in rest:
        conversion.set("train.gradient_accumulation_steps", to_int(rest.pop("gradient_accumulation_steps"), "gradient_accumulation_steps"), "from gradient_accumulation_steps")
    if "gradient_clipping" in rest:
        conversion.set("train.grad_clip", to_float(rest.pop("gradient_clipping"), "gradient_clipping"), "from gradient_clipping")
    if "warmup_steps" in rest:
        conversion.set("train.warmup_steps", to_int(rest.pop("warmup_steps"), "warmup_steps"), "from warmup_steps")
    given = "lr_scheduler" in rest
    schedule = rest.pop("lr_scheduler", "constant")
    if schedule in SCHEDULES:
        if given:
            conversion.set("train.schedule", schedule, "from lr_scheduler")
        else:
            conversion.default(PEER_DEFAULTS["lr_scheduler"])
        eta_given = not is_unset(rest.get("lr_scheduler_eta_min"))
        eta_min = to_float(rest.pop("lr_scheduler_eta_min"), "lr_scheduler_eta_min") if eta_given else SCHEDULE_END_LR.get(schedule, 0.0)
        rest.pop("lr_scheduler_eta_min", None)
        if schedule != "constant":
            lr = conversion.entries["train.lr"].value if "train.lr" in conversion.entries else LR_DEFAULT
            why = f"from lr_scheduler_eta_min = {eta_min}" if eta_given else f"diffusion-pipe's {schedule} schedule ends at {eta_min} (train.py:853-855)"
            conversion.set("train.min_lr_ratio", min(eta_min / lr, 1.0), f"{why}: {eta_min} / lr {lr}")
    else:
        conversion.skip("lr_scheduler", f"{schedule!r}: ZeRO-Pipe has constant, linear and cosine")
    if "save_every_n_steps" in rest:
        conversion.set("train.save_every", to_int(rest.pop("save_every_n_steps"), "save_every_n_steps"), "from save_every_n_steps")

    activation = rest.pop("activation_checkpointing", None)
    if activation is not None:
        conversion.set("model.gradient_checkpointing", bool(activation), f"from activation_checkpointing = {str(activation).lower()}")
        if activation == "unsloth":
            conversion.skip("activation_checkpointing", "'unsloth' (checkpoints offloaded to RAM) is not supported: plain gradient checkpointing is used")

    stages = rest.pop("pipeline_stages", 1)
    swap = rest.pop("blocks_to_swap", None)
    if swap:
        conversion.set("deepspeed.zero_stage", 3, f"blocks_to_swap = {swap}: parameters offloaded to host RAM need ZeRO-3")
        conversion.set("deepspeed.offload_param", "cpu", f"from blocks_to_swap = {swap}: every block lives in host RAM between uses")
        conversion.skip(
            "blocks_to_swap",
            f"{swap}: ZeRO-Pipe does not swap a count of blocks; deepspeed.offload_param: cpu keeps all parameters in host RAM and streams them "
            "in per layer (ZeRO-3), for LoRA and full fine-tunes and any number of GPUs. `zeropipe plan FILE` says whether it is needed at all",
        )
    elif isinstance(stages, int) and stages > 1:
        conversion.set("deepspeed.zero_stage", 3, f"from pipeline_stages = {stages}: ZeRO-3 spreads the parameters over the GPUs instead")
    if isinstance(stages, int) and stages > 1:
        conversion.skip("pipeline_stages", f"{stages}: {NOT_MAPPED['pipeline_stages']}")
    elif swap:
        conversion.already.append(f"pipeline_stages = {stages} (one stage is data parallel, as every ZeRO-Pipe run)")
    elif not swap:
        conversion.set("deepspeed.zero_stage", 2, "pipeline_stages = 1 is data parallel: ZeRO-2 also shards gradients and optimizer states")
    quant = conversion.entries.get("model.quantization.format")
    stage = conversion.entries.get("deepspeed.zero_stage")
    if quant is not None and quant.value == "nf4" and stage is not None and stage.value == 3:
        # bitsandbytes' nf4 keeps its state beside each weight tensor, which ZeRO-3 does not partition (models.bnb_base).
        conversion.set(
            "model.quantization.format", "fp8",
            f"{quant.comment}; but ZeRO-3 (needed here: {stage.comment}) cannot partition an nf4 base, so it is stored in fp8 instead "
            "(8 bits, a scale per output channel, partitioned by ZeRO-3)",
        )












