"""An fp8 frozen base vs a bf16 one under ZeRO-3 on 2 CPU ranks: host RAM, bytes gathered, and the loss.

    PYTHONPATH=src python benchmarks/quantized_base.py [--layers 2] [--steps 3] [--loss-steps 50]
    PYTHONPATH=src python benchmarks/quantized_base.py --plans     # docs/plan.md's table, arithmetic only
    PYTHONPATH=src python benchmarks/quantized_base.py --loss [--models wan,qwen-image,flux,llm] [--loss-steps 50]

Part 1, at a real size: Qwen-Image's transformer config (catalog qwen-image.json: 3072 wide, 24
heads, 3584-wide text input) with its 60 blocks cut to ``--layers``, random bf16 weights written
as safetensors, loaded by each rank with ``models.loading.load_pretrained`` (ZeRO-3, each rank
quantizing its own rows for fp8), LoRA r=16 on the attention projections, ``--steps`` steps in
bf16. Measured on each rank: the peak RSS while loading and during the forward/backward steps
(VmHWM, reset with /proc/self/clear_refs before each phase), the bytes of its ZeRO-3 partitions,
and the bytes DeepSpeed's all-gathers moved during the steps (DeepSpeed's own comms logger, a
hook on every collective it issues). Beside them, the planner's figures for the same model
(``plan.memory.per_gpu_terms``: the rank's share of the stored weights).

Part 2, the loss: the tiny Wan preset (plan: 2 blocks, 32 wide) loaded from a bf16 checkpoint as
fp8 and as bf16, LoRA trained for ``--loss-steps`` steps on the same seeded noise and targets in
fp32 compute on 2 ranks (ZeRO-3): the mean loss over the steps of each, and their ratio.

``--loss``, issue 32's tolerance through the real launcher: for each of Wan, Qwen-Image, FLUX.1
(their tiny presets) and a tiny Llama, ``zeropipe train`` on 2 CPU ranks runs the same config
four times, ``--loss-steps`` steps, the same seed, in bf16: a bf16 base and an fp8 base
(``model.quantization: fp8``), each under ZeRO-3 and under ZeRO-2. Printed: the mean of the
logged losses over steps 1-N of each run and each fp8 run's ratio to the bf16 run of its ZeRO
stage; the exit status is 1 when a ratio is off by more than 2%.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def status(field: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS


# ---------------------------------------------------------------------------------------------- one rank
def rank_main(args) -> None:
    import deepspeed
    import torch
    from peft import LoraConfig
    from transformers.integrations import HfDeepSpeedConfig

    from zeropipe.families.diffusion.entries import architecture_named
    from zeropipe.models.loading import load_pretrained
    from zeropipe.models.quantized import QuantizedStorage

    deepspeed.init_distributed(dist_backend="gloo")
    rank = int(os.environ["RANK"])
    arch = architecture_named(args.arch)
    cls = arch.model_class()
    bf16 = args.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    ds_config = {
        "train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": args.lr}},
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
    }
    if bf16:
        ds_config["bf16"] = {"enabled": True}
    alive = HfDeepSpeedConfig(ds_config)  # noqa: F841
    reset_peak()
    model = load_pretrained(
        lambda: cls.from_config(cls.load_config(args.checkpoint)), args.checkpoint, dtype=dtype, zero_stage=3, ds_config=ds_config,
        stem="diffusion_pytorch_model", quantize=QuantizedStorage("fp8") if args.storage == "fp8" else None,
    )
    load_peak = status("VmHWM")
    partition_bytes = sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    model.requires_grad_(False)
    torch.manual_seed(0)  # the same adapters in both runs
    model.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian", target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(dtype)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
    torch.manual_seed(1000 + rank)
    with torch.device("cpu"):
        inputs = arch.call.trace_inputs(model.config, args.latent, 1, args.text_tokens, dtype)
    batches = []
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(step * 2 + rank)
        noisy = {k: (torch.randn(v.shape, generator=generator).to(dtype) if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 1 else v) for k, v in inputs.items()}
        batches.append(noisy)
    from deepspeed.comm import comms_logger

    comms_logger.comms_dict.clear()
    before_steps = status("VmRSS")
    reset_peak()
    losses = []
    for step, batch in enumerate(batches):
        out = engine(**batch, return_dict=False)[0]
        target = torch.randn(out.shape, generator=torch.Generator().manual_seed(7 + rank)).to(out.dtype)
        loss = torch.nn.functional.mse_loss(out.float(), target.float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    train_peak = status("VmHWM")
    gathered = {name: sum(size * record[0] for size, record in sizes.items()) for name, sizes in comms_logger.comms_dict.items() if "gather" in name}
    result = {
        "storage": args.storage, "rank": rank, "load_peak": load_peak, "train_peak": train_peak, "before_steps": before_steps, "partition_bytes": partition_bytes,
        "gathered": gathered, "losses": losses,
    }
    Path(args.out).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- launcher
def write_checkpoint(arch_name: str, config: dict, folder: Path) -> None:
    import torch

    from zeropipe.families.diffusion.entries import architecture_named

    cls = architecture_named(arch_name).model_class()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        torch.manual_seed(0)
        model = cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(folder)
    del model


def run_ranks(args, storage: str, checkpoint: Path, work: Path, steps: int, precision: str, arch: str, latent: int, text_tokens: int) -> list[dict]:
    outs = [work / f"{storage}-{arch}-rank{r}.json" for r in range(2)]
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)), PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), __file__, "--rank-mode",
               "--storage", storage, "--checkpoint", str(checkpoint), "--steps", str(steps), "--precision", precision, "--arch", arch,
               "--latent", str(latent), "--text-tokens", str(text_tokens), "--lr", str(args.lr), "--out", str(work / f"{storage}-{arch}-rank%d.json")]
    # Each rank writes its own file: the %d is filled below through the environment's RANK.
    command[-1] = str(work / f"{storage}-{arch}-rank{{rank}}.json")
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-6000:])
        raise SystemExit(f"{storage} run failed")
    return [json.loads(path.read_text()) for path in outs]


def planned(config: dict, storage: str) -> dict[str, int]:
    """The planner's per-rank figures for this model (ZeRO-3, 2 CPU ranks, bf16, LoRA r=16)."""
    from zeropipe.config.schema import LoraSection
    from zeropipe.plan.hardware import GIB, Hardware
    from zeropipe.plan.memory import Choice
    from zeropipe.plan.totals import per_gpu_terms
    from zeropipe.families.diffusion.plan_specs import _diffusion_spec

    entry = {"name": "qwen-image (cut)", "family": "diffusion_transformer", "resolution": 256, "architecture": "qwen-image",
             "trained": {"name": "transformer", "library": "diffusers", "class": "QwenImageTransformer2DModel", "config": config}}
    spec = _diffusion_spec(entry, LoraSection(r=16, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    if storage == "fp8":
        spec = spec.with_fp8_base()
    hardware = Hardware(gpus_per_node=2, gpu_memory_bytes=8 * GIB, nodes=1, host_ram_bytes=16 * GIB, gpu_name=None, accelerator="cpu")
    terms = {t.name: t.bytes for t in per_gpu_terms(spec, hardware, Choice(zero_stage=3, precision="bf16", gradient_checkpointing=False))}
    stored = sum(b for name, b in terms.items() if name.startswith(("frozen", "LoRA")) and "dequantized" not in name)
    return {"stored_per_rank": stored, "total_params": spec.total_params}


PLANNED = (("wan2.1-t2v-14b", 512, 81), ("qwen-image", 1024, 1), ("flux.2-dev", 1024, 1))


def plan_table() -> None:
    """docs/plan.md's table: LoRA r=32 on 5 x 24 GB and 1 x 24 GB with 64 GB of RAM, bf16 vs fp8 base, latents and text cached (the default)."""
    from dataclasses import replace

    from zeropipe.config.schema import LoraSection
    from zeropipe.plan import parse_hardware, recommend
    from zeropipe.families.diffusion.plan_specs import _diffusion_spec
    from zeropipe.plan.model_spec import CATALOG_DIR

    print("| model | GPUs / RAM | base | fits | the fastest that fits (else the least host RAM) | per GPU GiB | host RAM GiB |")
    print("|---|---|---|---|---|---|---|")
    for name, resolution, frames in PLANNED:
        entry = {**json.loads((CATALOG_DIR / f"{name}.json").read_text()), "resolution": resolution, "frames": frames}
        spec = _diffusion_spec(entry, LoraSection(r=32))
        # As a run with data.cache.latents and data.cache.text on (the defaults): the ranks never load the encoders.
        spec = replace(spec, frozen_models=(), cached_models=spec.frozen_models)
        for gpus in ("5x24GB", "1x24GB"):
            hardware = parse_hardware(gpus, "64GB")
            for label, planned_spec in (("bf16", spec), ("fp8", spec.with_fp8_base())):
                result = recommend(planned_spec, hardware)
                best = result.best or min(result.candidates, key=lambda c: c.per_node_bytes)
                size = f"{resolution}px" + (f" x {frames} frames" if frames > 1 else "")
                print(f"| {name} ({size}) | {gpus} / 64 GB | {label} | {'yes' if result.best else 'no'} | {best.choice.describe()} | "
                      f"{best.per_gpu_bytes / 2**30:.1f} | {best.per_node_bytes / 2**30:.1f} |")


# ---------------------------------------------------------------------------------------------- --loss
LOSS_MODELS = {"wan": "tiny-wan", "qwen-image": "tiny-qwen-image", "flux": "tiny-flux", "llm": None}
LOSS_RUNS = (("bf16", 3), ("fp8", 3), ("bf16", 2), ("fp8", 2))  # (base storage, ZeRO stage); each fp8 run is compared with the bf16 run of its stage
TOLERANCE = 0.02


def llm_base(folder: Path) -> tuple[Path, Path]:
    """A tiny Llama saved in bf16 with its tokenizer, and the arithmetic data it trains on (as tests/integration/test_quantized_base.py)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from zeropipe.data.synthetic import generate_dataset
    from zeropipe.data.tokenizer import train_tokenizer

    data = generate_dataset("arithmetic", 400, 0, folder / "corpus.jsonl")
    texts = [v for line in data.read_text().splitlines() for v in json.loads(line).values()]
    base = folder / "llm-base"
    tokenizer = train_tokenizer(texts, 300, base)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(base)
    return base, data


def loss_config(work: Path, model: str, storage: str, stage: int, steps: int, llm: tuple[Path, Path] | None) -> dict:
    name = f"{model}-{storage}-zero{stage}"
    config = {
        "run": {"name": name, "output_dir": str(work / "runs"), "seed": 3},
        "train": {"max_steps": steps, "lr": 1e-2, "schedule": "constant", "log_every": 1, "save_every": 10 * steps},
        "deepspeed": {"zero_stage": stage, "precision": "bf16"},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
        "generate": {"prompts": []},
    }
    if llm is None:
        config["model"] = {"config": {"pipeline": LOSS_MODELS[model]}, "lora": {"r": 8, "alpha": 16}}
        config["data"] = {"synthetic": {"task": "shapes", "examples": 16}, "images": {"resolution": 32, "bucket_step": 16},
                          "cache": {"dir": str(work / f"cache-{model}")}}
        config["train"]["micro_batch_size"] = 2
    else:
        base, data = llm
        config["model"] = {"config": None, "path": str(base), "lora": {"r": 8, "alpha": 16}}
        config["data"] = {"path": str(data), "max_seq_len": 32}
        config["train"]["micro_batch_size"] = 8
    if storage == "fp8":
        config["model"]["quantization"] = "fp8"
    return config


def train_losses(work: Path, config: dict, steps: int) -> tuple[list[float], float]:
    """`zeropipe train CONFIG` (2 CPU ranks); the loss of each step from the run's metrics.jsonl, and the run's wall time."""
    import time

    import yaml

    path = work / f"{config['run']['name']}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("DS_ACCELERATOR", None)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "zeropipe", "train", str(path)], env=env, capture_output=True, text=True, timeout=3600, check=False)
    elapsed = time.monotonic() - started
    run_dir = work / "runs" / config["run"]["name"]
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-6000:])
        raise SystemExit(f"{config['run']['name']}: zeropipe train failed (exit {result.returncode}); its logs: {run_dir / 'logs'}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["loss"] for row in rows if "loss" in row and "step" in row}
    missing = [step for step in range(1, steps + 1) if step not in losses]
    if missing:
        raise SystemExit(f"{config['run']['name']}: no logged loss at steps {missing[:5]}")
    if config["model"].get("quantization"):
        log = (run_dir / "logs" / "rank0.log").read_text()
        if "stored as fp8" not in log:
            raise SystemExit(f"{config['run']['name']}: rank 0's log does not say the base was stored as fp8")
    return [losses[step] for step in range(1, steps + 1)], elapsed


def loss_table(models: list[str], steps: int) -> int:
    """Issue 32's tolerance: each fp8 run's mean loss over steps 1-N within 2% of the bf16-base run's; 1 when one is not."""
    unknown = [m for m in models if m not in LOSS_MODELS]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(LOSS_MODELS)}")
    print(f"zeropipe train, 2 CPU ranks, bf16, LoRA r=8, lr 1e-2 constant, seed 3, {steps} steps; mean of the logged loss over steps 1-{steps}")
    print(f"| model | base | ZeRO | loss step 1 | loss step {steps} | mean loss 1-{steps} | fp8 / bf16 | within 2% | wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for model in models:
            llm = llm_base(work) if LOSS_MODELS[model] is None else None
            reference: dict[int, float] = {}
            for storage, stage in LOSS_RUNS:
                losses, elapsed = train_losses(work, loss_config(work, model, storage, stage, steps, llm), steps)
                mean = sum(losses) / len(losses)
                if storage == "bf16":
                    reference[stage], ratio, verdict = mean, "", ""
                else:
                    within = abs(mean / reference[stage] - 1) <= TOLERANCE
                    failed += not within
                    ratio, verdict = f"{mean / reference[stage]:.4f}", "yes" if within else "**no**"
                label = "FLUX.1" if model == "flux" else ("Llama (tiny)" if model == "llm" else model)
                print(f"| {label} | {storage} | {stage} | {losses[0]:.4f} | {losses[-1]:.4f} | {mean:.5f} | {ratio} | {verdict} | {elapsed:.0f} |", flush=True)
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--loss-steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rank-mode", action="store_true")
    parser.add_argument("--loss", action="store_true", help="the 50-step mean-loss comparison through `zeropipe train` (bf16 vs fp8 base) and exit")
    parser.add_argument("--models", default=",".join(LOSS_MODELS), help="--loss: which of " + ", ".join(LOSS_MODELS))
    parser.add_argument("--plans", action="store_true", help="print docs/plan.md's bf16-vs-fp8 table (planner arithmetic only) and exit")
    parser.add_argument("--storage"), parser.add_argument("--checkpoint"), parser.add_argument("--out"), parser.add_argument("--precision", default="bf16")
    parser.add_argument("--arch", default="qwen-image"), parser.add_argument("--latent", type=int, default=16), parser.add_argument("--text-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.rank_mode:
        args.out = args.out.format(rank=os.environ["RANK"])
        rank_main(args)
        return

    sys.path.insert(0, str(ROOT / "src"))
    if args.plans:
        plan_table()
        return
    if args.loss:
        raise SystemExit(loss_table(args.models.split(","), args.loss_steps))
    catalog = json.loads((ROOT / "src/zeropipe/plan/catalog/qwen-image.json").read_text())
    config = {**catalog["trained"]["config"], "num_layers": args.layers}
    gib = 2**30
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        checkpoint = work / "qwen-image-cut"
        write_checkpoint("qwen-image", config, checkpoint)
        print(f"Part 1: Qwen-Image transformer, real widths, {args.layers} of 60 blocks, random bf16 weights "
              f"({sum(f.stat().st_size for f in checkpoint.glob('*.safetensors')) / gib:.2f} GiB on disk); ZeRO-3, 2 CPU ranks, bf16, LoRA r=16, {args.steps} steps")
        rows = {}
        for storage in ("bf16", "fp8"):
            ranks = run_ranks(args, storage, checkpoint, work, args.steps, "bf16", "qwen-image", 16, 16)
            plan = planned(config, storage)
            rows[storage] = (ranks, plan)
        header = (f"{'base':5} {'partition/rank (measured)':>26} {'(plan)':>9} {'gathered/step/rank':>19} {'load peak RSS/rank':>19} "
                  f"{'fwd/bwd peak RSS/rank':>22} {'(above the RSS before the steps)':>33}")
        print(header)
        for storage, (ranks, plan) in rows.items():
            part = max(r["partition_bytes"] for r in ranks)
            gathered = max(sum(r["gathered"].values()) for r in ranks) / args.steps
            load = max(r["load_peak"] for r in ranks)
            train = max(r["train_peak"] for r in ranks)
            above = max(r["train_peak"] - r["before_steps"] for r in ranks)
            print(f"{storage:5} {part / gib:>24.3f} G {plan['stored_per_rank'] / gib:>7.3f} G {gathered / gib:>17.3f} G {load / gib:>17.3f} G "
                  f"{train / gib:>20.3f} G {above / gib:>31.3f} G")
        b, f = (rows[s][0] for s in ("bf16", "fp8"))
        ratio = lambda key: max(r[key] for r in f) / max(r[key] for r in b)
        print(f"fp8 / bf16: partitions {ratio('partition_bytes'):.3f}, gathered "
              f"{max(sum(r['gathered'].values()) for r in f) / max(sum(r['gathered'].values()) for r in b):.3f}, "
              f"load peak {ratio('load_peak'):.3f}, fwd/bwd peak {ratio('train_peak'):.3f}")
        for storage, (ranks, plan) in rows.items():
            measured = max(r["partition_bytes"] for r in ranks)
            print(f"{storage}: measured partition / plan = {measured / plan['stored_per_rank']:.3f}")

        print(f"\nPart 2: tiny Wan, bf16 checkpoint, ZeRO-3, 2 CPU ranks, fp32 compute, LoRA r=16, {args.loss_steps} steps, same seed")
        from zeropipe.families.diffusion.entries import architecture_named

        wan = work / "tiny-wan"
        write_checkpoint("wan", architecture_named("wan").preset["transformer"], wan)
        means = {}
        for storage in ("bf16", "fp8"):
            ranks = run_ranks(args, storage, wan, work, args.loss_steps, "fp32", "wan", 8, 8)
            losses = [sum(r["losses"][i] for r in ranks) / 2 for i in range(args.loss_steps)]
            means[storage] = sum(losses) / len(losses)
            print(f"{storage}: loss step 1 {losses[0]:.4f}, step {args.loss_steps} {losses[-1]:.4f}, mean over steps 1-{args.loss_steps} {means[storage]:.5f}")
        print(f"mean loss fp8 / bf16 = {means['fp8'] / means['bf16']:.4f} (tolerance: within 2%)")


if __name__ == "__main__":
    main()
