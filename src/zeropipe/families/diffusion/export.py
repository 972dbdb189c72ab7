"""Export a diffusion run: a full fine-tune as a diffusers pipeline directory, LoRA as a diffusers LoRA file.

- Full fine-tune: the run's pipeline directory (VAE, text encoders, tokenizers, scheduler)
  with the trained UNet/transformer in place of the original one;
  ``DiffusionPipeline.from_pretrained(OUT)`` loads it.
- LoRA: ``OUT/pytorch_lora_weights.safetensors`` in the diffusers key layout, written by the
  pipeline class's own ``save_lora_weights``, so ``pipeline.load_lora_weights(OUT)`` of the
  base pipeline accepts it (and so do ComfyUI-style loaders that read diffusers LoRAs).
  Architectures with an original layout of their own (Wan) also get
  ``OUT/lora_comfyui.safetensors`` in it (``diffusion_model.blocks.0.self_attn.q.lora_A.weight``),
  the file ComfyUI users load; diffusers loads it too, through its converter for such LoRAs.
  With ``merge`` the adapter is fused into the denoiser and a full pipeline is written.

As for language models, the directory is written under a temporary name and renamed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from zeropipe.checkpoint.consolidate import load_checked
from zeropipe.config.pipeline_index import is_pipeline_folder
from zeropipe.families.diffusion.entries import architecture_named
from zeropipe.errors import CheckpointError
from zeropipe.export.hf import ExportJob
from zeropipe.families.diffusion.prepare import read_plan
from zeropipe.models.adapters import adapter_name, is_adapter_parameter, peft_adapter_config
from zeropipe.models.common import resolve_lora_targets
from zeropipe.models.bnb_base import bnb_state_keys
from zeropipe.models.quantized import FP8_FORMAT_OF_DTYPE, SCALE_KEY, QuantizedStorage, dequantize_model

ORIGINAL_LORA_FILE = "lora_comfyui.safetensors"


def base_denoiser(arch, folder: Path, single_file: str | None, storage: QuantizedStorage | None = None):
    """The run's starting denoiser in fp32: the pipeline folder's (``transformer``, Wan 2.2's ``transformer_2``...), or a single-file checkpoint's weights with the folder's config.

    A single file stored in fp8 (ComfyUI's fp8 / fp8_scaled, trained with ``model.quantization``) is
    the only base there is: its weights are read as stored and dequantized (fp8 times scale) into fp32.
    """
    cls = arch.model_class()
    if not single_file:
        return cls.from_pretrained(str(folder), torch_dtype=torch.float32)
    from zeropipe.families.diffusion.pipelines import single_file_renamer
    from zeropipe.models.checkpoint_index import CheckpointIndex
    from zeropipe.models.loading import load_pretrained

    weights = Path(single_file).expanduser()
    stored_fp8 = storage is not None and any(entry.dtype in FP8_FORMAT_OF_DTYPE for entry in CheckpointIndex(weights).entries.values())
    denoiser = load_pretrained(
        lambda: cls.from_config(cls.load_config(str(folder))), weights, dtype=torch.float32, zero_stage=0, device="cpu",
        rename=single_file_renamer(arch.record.denoiser_class, weights), quantize=storage if stored_fp8 else None,
    )
    dequantize_model(denoiser)
    return denoiser


def fp8_storage(config) -> QuantizedStorage | None:
    """The run's fp8 base storage (model.quantization), or None."""
    quant = config.model.quantization
    return QuantizedStorage(quant.storage, quant.scale) if quant is not None and quant.is_fp8 else None


def write_original_lora(arch, denoiser, alpha: float, dtype: torch.dtype, folder: Path) -> None:
    """The LoRA again in the architecture's original key layout (Wan: what ComfyUI and diffusion-pipe use), when it has one."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    layers = {key: value.to(dtype) for key, value in get_peft_model_state_dict(denoiser).items()}
    try:
        original = arch.layouts.original_lora_layout(layers, alpha)
    except ValueError as err:
        raise CheckpointError(f"cannot write the {arch.record.name} LoRA in its original key layout: {err}; the diffusers LoRA is unaffected, export without it is not offered yet") from None
    if original is not None:
        save_file(original, str(folder / ORIGINAL_LORA_FILE), metadata={"format": "pt"})


def write_original_lokr(arch, layers: dict[str, torch.Tensor], scaling: float, folder: Path) -> bool:
    """A LoKr adapter again in the architecture's original key layout, where the entry has one; whether it was written."""
    from safetensors.torch import save_file

    original = arch.layouts.original_lokr_layout(layers, scaling)
    if original is None:
        return False
    save_file(original, str(folder / ORIGINAL_LORA_FILE), metadata={"format": "pt"})
    return True


def write_diffusers_lora(arch, denoiser, lora, dtype: torch.dtype, folder: Path) -> dict[str, torch.Tensor]:
    """``folder/pytorch_lora_weights.safetensors``: the adapter in diffusers' layout, as the pipeline's own ``save_lora_weights`` writes it; returns its layers."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(denoiser)
    if arch.record.denoiser == "unet" and lora.kind == "lora":
        # UNets: the attention-processor names their training scripts write. Transformers keep
        # peft's lora_A/lora_B names, which every transformer loader reads (Qwen-Image's reads no other).
        layers = convert_state_dict_to_diffusers(layers)
    layers = {key: value.to(dtype) for key, value in layers.items()}
    # The adapter's config (alpha in particular) goes into the file's metadata: without it
    # load_lora_weights assumes alpha = r and the adapter acts at the wrong strength.
    # Dropout is written as 0: the adapter layers load_lora_weights adds are in training
    # mode, and dropout would make every image random.
    metadata = denoiser.peft_config["default"].to_dict()
    if "lora_dropout" in metadata:
        metadata["lora_dropout"] = 0.0
    pipeline_cls = arch.pipeline()
    if hasattr(pipeline_cls, "save_lora_weights"):
        pipeline_cls.save_lora_weights(str(folder), **{f"{arch.record.denoiser}_lora_layers": layers, f"{arch.record.denoiser}_lora_adapter_metadata": metadata})
    else:
        # A pipeline without a LoRA loader in diffusers 0.42 (HunyuanImage, HunyuanVideo 1.5): the same file, written by the
        # loaders' common base as every pipeline's save_lora_weights writes it, which the denoiser's
        # load_lora_adapter reads (draw.load_adapter_export).
        from diffusers.loaders.lora_base import LoraBaseMixin

        LoraBaseMixin._save_lora_weights(str(folder), lora_layers={arch.record.denoiser: layers}, lora_metadata={arch.record.denoiser: metadata})
    return layers


def trained_denoiser(run, config, info, state: dict[str, torch.Tensor]):
    """(architecture, the run's data plan, its pipeline folder, the denoiser with the checkpoint's weights): what an export writes and Draw draws with.

    Raises:
        CheckpointError: the run's pipeline folder is gone, or the checkpoint does not match the denoiser.
    """
    plan = read_plan(run)
    arch = architecture_named(plan.architecture)
    pipeline_dir = Path(plan.pipeline_dir)
    if not is_pipeline_folder(pipeline_dir):
        raise CheckpointError(f"the run's pipeline {pipeline_dir} is gone: its VAE, text encoders and scheduler are needed; restore it there")
    storage = fp8_storage(config)
    denoiser = base_denoiser(arch, pipeline_dir / plan.denoiser, config.model.diffusion.denoiser_file, storage)
    lora = config.model.lora
    if lora is not None:
        denoiser.add_adapter(peft_adapter_config(lora, resolve_lora_targets(lora, arch.record.lora_targets)))
    if config.model.quantization is not None:
        # The checkpoint holds the frozen base as fp8 bytes and scales (or bitsandbytes' packed bytes and their
        # quantization state); the export's base is the pipeline's own full-precision weights (copied in below),
        # the adapters the checkpoint's.
        own = denoiser.state_dict()
        state = {
            name: (own[name] if value.dtype in (torch.uint8, torch.int8) and name in own else value)
            for name, value in state.items()
            if not name.endswith("." + SCALE_KEY) and not bnb_state_keys(name)
        }
    load_checked(denoiser, state, info, what="denoiser")
    if lora is not None:
        # The frozen base never changed, but a bf16 run's checkpoint holds it rounded to
        # bf16: keep the pipeline's own weights and take only the adapters from the checkpoint.
        base = base_denoiser(arch, pipeline_dir / plan.denoiser, config.model.diffusion.denoiser_file, storage).state_dict()
        with torch.no_grad():
            for name, tensor in denoiser.named_parameters():
                original = name.replace(".base_layer.", ".")
                if not is_adapter_parameter(name) and original in base:
                    tensor.copy_(base[original])
    return arch, plan, pipeline_dir, denoiser


def export_diffusion(job: ExportJob) -> Path:
    run, config, info, out, merge, dtype = job.run, job.config, job.info, job.out, job.merge, job.dtype
    arch, plan, pipeline_dir, denoiser = trained_denoiser(run, config, info, job.state_dict())
    lora = config.model.lora
    notes: list[str] = []

    tmp = out.with_name(f".{out.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if lora is not None and not merge and lora.kind == "loha":
        # diffusers 0.42 reads LoRA, DoRA and LoKr files, no LoHa (its loaders check for lora/lokr keys).
        raise CheckpointError(
            f"diffusers has no loader for a LoHa adapter, so no {arch.record.name} LoHa file would load in it: export with --merge "
            "(a full pipeline folder, the adapter merged into the denoiser), or train kind: lokr or dora, which diffusers loads"
        )
    if lora is not None and not merge:
        tmp.mkdir(parents=True)
        layers = write_diffusers_lora(arch, denoiser, lora, dtype, tmp)
        if lora.kind == "lora":
            write_original_lora(arch, denoiser, lora.alpha, dtype, tmp)
        elif lora.kind == "lokr" and write_original_lokr(arch, layers, lora.alpha / lora.r, tmp):
            notes.append(f"LoKr: {ORIGINAL_LORA_FILE} holds it in {arch.record.name}'s original key layout (ComfyUI's)")
        else:
            # The entries' original (ComfyUI) layouts are LoRA's down/up pairs; a DoRA magnitude or
            # LoKr factors would be dropped or misread there: the diffusers file alone is written.
            notes.append(f"{adapter_name(lora)}: no original (ComfyUI) key layout is written for a {arch.record.name} {adapter_name(lora)}; the diffusers file is pytorch_lora_weights.safetensors")
        kind = lora.kind
    else:
        if lora is not None:
            denoiser.fuse_lora(lora_scale=1.0)
            denoiser.unload_lora()
        # The trained folder replaced; for a Wan 2.2 expert the other expert is copied as it was.
        shutil.copytree(pipeline_dir, tmp, ignore=lambda folder, names: [plan.denoiser] if Path(folder) == pipeline_dir else [])
        denoiser.to(dtype).save_pretrained(str(tmp / plan.denoiser), safe_serialization=True)
        kind = "merged" if lora is not None else "full"
    (tmp / "zeropipe_export.json").write_text(
        json.dumps(
            {"run": str(run.path.resolve()), "checkpoint": info.tag, "step": info.step, "kind": kind, "architecture": arch.record.name,
             "base_pipeline": str(pipeline_dir), "dtype": str(dtype).replace("torch.", ""), "denoiser": plan.denoiser, **({"notes": notes} if notes else {}),
             **({"expert": config.model.diffusion.expert} if config.model.diffusion.expert else {})},
            indent=2,
        )
    )
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


