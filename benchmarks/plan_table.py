"""The planner's answer for the flagship models on three boxes, beside the peers' published figures (docs/plan.md).

Run: python benchmarks/plan_table.py [--models a,b] [--boxes "1x24GB:64GB,..."] > table.md

Each cell is `zeropipe plan --model M --gpus G --ram R --lora-r 32 --json` (16 for the LLMs),
run in this process; the peers' figures are quoted from their docs (PEERS below, each cited with
its repository and file) for the nearest setting they publish. The planner's search changes over
time: re-run this script after it does, and paste its output into docs/plan.md.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys

GIB = 2**30

MODELS = [
    "flux.2-dev",
    "wan2.2-t2v-a14b",
    "wan2.1-t2v-14b",
    "qwen-image",
    "hunyuan-video-1.5",
    "ltx-2",
    "z-image-turbo",
    "sdxl",
    "llama-3.1-8b",
    "qwen3-8b",
    "qwen3-32b",
]
BOXES = ["1x24GB:64GB", "5x24GB:64GB", "4x48GB:128GB"]
LLMS = {"llama-3.1-8b", "qwen3-8b", "qwen3-32b"}

# The nearest setting each peer publishes: (figure, setting, source repository and file).
PEERS = {
    "flux.2-dev": [
        ("~76 GB / ~52 GB / ~40 GB / ~22 GB VRAM", "LoRA, one GPU, Mistral-3 24B text encoder on the GPU: bf16 / int8 encoder / int8 all / int4 encoder + int8 transformer; 96 GB+ system RAM", "bghira/SimpleTuner documentation/quickstart/FLUX2.md"),
    ],
    "wan2.2-t2v-a14b": [
        ("~42 GB shared VRAM (two DiTs, fp8) and ~96 GB RAM with --offload_inactive_dit", "LoRA of both experts, fp8 base, inactive expert in host RAM", "kohya-ss/musubi-tuner docs/wan.md"),
    ],
    "wan2.1-t2v-14b": [
        ("fits in 24 GB (\"you'll have to fiddle with the settings\")", "LoRA at 832x480", "bghira/SimpleTuner documentation/quickstart/WAN.md"),
        ("720x1280 images in 24 GB", "LoRA with fp8 and block swap (images, not clips)", "kohya-ss/musubi-tuner docs/wan.md"),
    ],
    "qwen-image": [
        ("42 / 30 / 24 / 12 GB", "LoRA at 1024x1024, batch 1, bf16, checkpointing: plain / fp8 base / + 16 blocks swapped / + 45 swapped (64 GB RAM advised)", "kohya-ss/musubi-tuner docs/qwen_image.md"),
    ],
    "hunyuan-video-1.5": [
        ("none for training (~20 GB for inference, 121 frames at 720p, 51 blocks swapped)", "inference only", "kohya-ss/musubi-tuner docs/hunyuan_video_1_5.md"),
    ],
    "ltx-2": [
        ("~13 GB / ~29-30 GB / ~48 GB VRAM", "LoRA at 480p, 17 frames, batch 2: RamTorch weight streaming / int8 no offload / bf16 no offload", "bghira/SimpleTuner documentation/quickstart/LTXVIDEO2.md"),
    ],
    "z-image-turbo": [
        ("~32-40 GB / ~16-24 GB / ~10-12 GB VRAM", "LoRA: bf16 base / int8 base / NF4 base", "bghira/SimpleTuner documentation/quickstart/ZIMAGE.md"),
    ],
    "sdxl": [
        ("9237 MiB; > 24 GB without offload", "full U-Net fine-tune with DeepSpeed ZeRO-2 and optimizer offload", "bghira/SimpleTuner documentation/DEEPSPEED.md"),
    ],
    "llama-3.1-8b": [
        ("16 GB (LoRA 16-bit, 7B); 6 GB (QLoRA 4-bit); 120 GB (full, AMP)", "per-GPU estimate by method, no sequence length stated", "hiyouga/LLaMA-Factory README.md (Hardware Requirement)"),
    ],
    "qwen3-8b": [
        ("2x GB = 16.4 GB (LoRA 16-bit); x/2 = 4.1 GB (QLoRA 4-bit)", "per-GPU estimate by method", "hiyouga/LLaMA-Factory README.md (Hardware Requirement)"),
    ],
    "qwen3-32b": [
        ("64 GB (LoRA 16-bit, 30B column); 24 GB (QLoRA 4-bit)", "per-GPU estimate by method", "hiyouga/LLaMA-Factory README.md (Hardware Requirement)"),
    ],
}


def deepspeed_estimates(model: str, box: str) -> str:
    """DeepSpeed's own model-state estimators (full fine-tune, cold: no offload), for the LLMs: per GPU, GiB."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from zeropipe.plan.model_spec import spec_from_catalog

    from zeropipe.families import families


    families()  # the diffusion family registers its spec builders with the planner

    spec = spec_from_catalog(model)
    gpus = int(box.split("x")[0])
    _, zero2 = estimate_zero2_model_states_mem_needs(spec.total_params, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False)
    _, zero3, _ = estimate_zero3_model_states_mem_needs(spec.total_params, spec.largest_layer_params, num_gpus_per_node=gpus, num_nodes=1, cpu_offload=False, zero_init=True)
    return f"DeepSpeed estimator, full fine-tune: ZeRO-2 {zero2 / GIB:.0f} GiB, ZeRO-3 {zero3 / GIB:.0f} GiB per GPU"


def plan(model: str, box: str) -> tuple[int, dict]:
    from zeropipe.cli.main import main

    gpus, ram = box.split(":")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["plan", "--model", model, "--gpus", gpus, "--ram", ram, "--lora-r", "16" if model in LLMS else "32", "--json"])
    try:
        return code, json.loads(out.getvalue())
    except json.JSONDecodeError:
        return code, {"reason": out.getvalue().strip()[-300:]}


def describe(choice: dict) -> str:
    offload = [name for name, key in (("optimizer", "offload_optimizer"), ("params", "offload_param")) if choice.get(key)]
    parts = [f"ZeRO-{choice['zero_stage']}"]
    if offload:
        parts.append("offload " + "+".join(offload))
    if choice.get("gradient_checkpointing"):
        parts.append("checkpointing" + (" + activation offload" if choice.get("activation_offload") else ""))
    if (choice.get("sequence_parallel") or 1) > 1:
        parts.append(f"sequence parallel {choice['sequence_parallel']}")
    parts.append(f"mb {choice['micro_batch_size']}x{choice['gradient_accumulation_steps']}")
    parts.append(choice["precision"])
    for key in ("base_storage", "resolution", "frames", "cache_text", "cache_latents"):  # knobs a newer search may add
        if key in choice:
            parts.append(f"{key} {choice[key]}")
    return ", ".join(parts)


def cell(code: int, result: dict) -> str:
    best = result.get("best")
    usable = result.get("usable_gpu_bytes") or 0
    offers = result.get("offers") or []
    if not best and offers:
        # Only a quality-changing setting makes it fit: the plan offers it (never picks it), named with its price.
        offer = offers[0]
        change = " and ".join(setting["key"] for setting in offer["settings"])
        candidate = offer["candidate"]
        return (f"exit {code}, fits if you set {change}: {describe(candidate['choice'])}; {candidate['per_gpu_bytes'] / GIB:.1f} of "
                f"{usable / GIB:.1f} GiB per GPU, {candidate['per_node_bytes'] / GIB:.1f} GiB host RAM")
    if not best:
        return f"exit {code}: {(result.get('reason') or 'nothing fits')[:160]}"
    fits = "fits" if best.get("fits") else "does not fit"
    return f"exit {code}, {fits}: {describe(best['choice'])}; {best['per_gpu_bytes'] / GIB:.1f} of {usable / GIB:.1f} GiB per GPU, {best['per_node_bytes'] / GIB:.1f} GiB host RAM"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--boxes", default=",".join(BOXES))
    args = parser.parse_args(argv)
    # A catalog model is counted (and a diffusion model traced) once for all boxes.
    import zeropipe.plan.model_spec as model_spec

    counted: dict = {}
    count = model_spec.spec_from_catalog

    def once(name, lora=None):
        key = (name, None if lora is None else lora.model_dump_json())
        if key not in counted:
            counted[key] = count(name, lora)
        return counted[key]

    model_spec.spec_from_catalog = once
    print("| model | box | `zeropipe plan` (exit status, recommendation, per-GPU peak, host RAM) | peer's figure (setting; source) |")
    print("|---|---|---|---|")
    for model in args.models.split(","):
        peers = "<br>".join(f"{figure} ({setting}; {source})" for figure, setting, source in PEERS.get(model, []))
        for box in args.boxes.split(","):
            code, result = plan(model, box)
            extra = f"<br>{deepspeed_estimates(model, box.split(':')[0])}" if model in LLMS else ""
            print(f"| {model} | {box.replace(':', ' / ')} | {cell(code, result)} | {peers}{extra} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
