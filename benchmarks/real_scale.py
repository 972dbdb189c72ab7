"""Real-size runs on CPU ranks: the planner's per-node host-RAM figure against the node's measured peak.

    nice .venv/bin/python benchmarks/real_scale.py --workdir /tmp/real_scale --cases llm-z3 llm-z2
    nice .venv/bin/python benchmarks/real_scale.py --workdir /tmp/real_scale --cases sdxl   # precision auto, 2 steps
    nice .venv/bin/python benchmarks/real_scale.py --workdir /tmp/real_scale --replan   # plan the measured runs again, no training
    nice .venv/bin/python benchmarks/real_scale.py --quick --keep-gathered deepspeed    # a 0.4B Llama with DeepSpeed's own ZeRO-3 limits

Models are built from their real configs (the planner's catalog: SDXL's UNet, Llama-3.2-1B)
with random weights, nothing downloaded, and saved the way users have them: the SDXL UNet as
a diffusers pipeline directory (its VAE and text encoders tiny but with SDXL's output widths:
the run trains from cached latents and text embeddings of SDXL's real dimensions, so the ranks
never load them), the LLM as a Hugging Face directory with sharded bf16 safetensors. Each case
is a real ``zeropipe train`` (LoRA r=16, CPU ranks, gloo) while this process samples the summed
PSS of the whole process tree (launcher and ranks: pages shared between ranks, such as a
memory-mapped checkpoint, count once) every 0.2 s. Rank 0's log splits the run into loading (up
to ``deepspeed.initialize``) and training. The same YAML is planned by ``zeropipe plan
--cpu-ranks N --json``, and the plan's node host-RAM peak is compared with the measured one
(target: within +-15%).

Cases:
  sdxl     SDXL UNet (2.57B), 5 ranks, ZeRO-3, cached latents (32 px images: 16x16 latents)
  llm-z3   Llama-3.2-1B (1.24B), 4 ranks, ZeRO-3 + optimizer offload, sequences of 128 packed tokens
  llm-z2   the same under ZeRO-2 (every rank a replica): the planner is asked about 3, 2, 1 ranks on a
           host-RAM budget of --budget; it refuses what does not fit and the largest that fits is run

The ZeRO-3 runs set stage3_max_live_parameters and stage3_max_reuse_distance to --keep-gathered
(default 0): with DeepSpeed's 1e9 a 1.24B fp32 model would keep up to 1e9 weights gathered on
each rank (docs/plan.md). Precision is ``auto`` (fp32 on CPUs without bf16 in hardware) unless
--sdxl-precision says otherwise. On a 2-core machine shared with other work the LLM cases take
about 15 minutes; SDXL in bf16 (emulated on AVX2) took 40 minutes for one step. Wall times are
what it took on the machine as it was.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import yaml

GIB = 1024**3
SAMPLE_PERIOD_S = 0.2
TOLERANCE = 0.15
REPO = Path(__file__).resolve().parents[1]
CATALOG = REPO / "src" / "zeropipe" / "plan" / "catalog"
SHARD_BYTES = 1 * GIB

# --quick: a 0.4B Llama, the shape of the run the issue measured (24 layers x 1024).
QUICK_LLM = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 1024,
    "intermediate_size": 3584,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
}


# ---------------------------------------------------------------------------- building models
def random_tensor(name: str, shape: tuple[int, ...], dtype, generator):
    """Random weights a network trains from without blowing up: N(0, 0.02) matrices, unit norms, zero biases."""
    import torch

    if name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype).normal_(0.0, 0.02, generator=generator)


def write_sharded(shapes: dict[str, tuple[int, ...]], out: Path, stem: str, dtype) -> int:
    """Write random tensors of these shapes as sharded safetensors with an index; returns the bytes written.

    One shard at a time is in memory, so the writer stays small whatever the model's size.
    """
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(0)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * max(1, int(torch.Size(shape).numel()))
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    weight_map, total = {}, 0
    ext = "safetensors"
    for index, names in enumerate(shards, start=1):
        file = f"{stem}-{index:05d}-of-{len(shards):05d}.{ext}"
        tensors = {name: random_tensor(name, shapes[name], dtype, generator) for name in names}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: file for name in names})
        del tensors
    index_name = f"{stem}.{ext}.index.json"
    (out / index_name).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def meta_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every tensor of the state dict (tied weights once), from a model built on the meta device."""
    seen, shapes = set(), {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key in seen:
            continue
        seen.add(key)
        shapes[name] = tuple(tensor.shape)
    return shapes


def build_llm_dir(config: dict, out: Path) -> int:
    """A Hugging Face model directory: config.json, sharded bf16 safetensors, a small BPE tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeropipe.data.synthetic import _pairs  # the texts the tokenizer is trained on
    from zeropipe.data.tokenizer import train_tokenizer

    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    hf_config = AutoConfig.for_model(**fields)
    hf_config.torch_dtype = "bfloat16"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    shapes = meta_shapes(model)
    if getattr(hf_config, "tie_word_embeddings", False):
        shapes.pop("lm_head.weight", None)
    write_sharded(shapes, out, "model", torch.bfloat16)
    hf_config.save_pretrained(out)
    import random

    texts = [" ".join(pair) for pair in _pairs("mixed", 2000, random.Random(0))]
    train_tokenizer(texts, 512, out)
    return sum(f.stat().st_size for f in out.glob("*.safetensors"))


def build_sdxl_dir(out: Path) -> int:
    """An SDXL pipeline directory: the real UNet (random bf16 weights, sharded) and a tiny VAE and text encoders.

    The text encoders have SDXL's output widths (768 + 1280 = the UNet's 2048-wide cross
    attention, a 1280-wide pooled embedding), so the cached embeddings have the real shapes.
    """
    import torch
    from diffusers import UNet2DConditionModel

    from zeropipe.families.diffusion.pipelines import build_tiny_pipeline

    unet_dir = out / "unet"
    if (unet_dir / "config.json").is_file() and any(unet_dir.glob("*.safetensors")):
        return sum(f.stat().st_size for f in unet_dir.glob("*.safetensors"))
    entry = json.loads((CATALOG / "sdxl.json").read_text())
    unet_config = dict(entry["trained"]["config"])
    shutil.rmtree(out, ignore_errors=True)
    build_tiny_pipeline(
        {
            "pipeline": "tiny-sdxl",
            "text_encoder": {"hidden_size": 768, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "projection_dim": 768},
            "text_encoder_2": {"hidden_size": 1280, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "projection_dim": 1280},
        },
        out,
        seed=0,
    )
    shutil.rmtree(unet_dir)
    unet_dir.mkdir()
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(unet_config)
    write_sharded(meta_shapes(unet), unet_dir, "diffusion_pytorch_model", torch.bfloat16)
    unet.register_to_config()
    (unet_dir / "config.json").write_text(json.dumps(unet_config, indent=2))
    return sum(f.stat().st_size for f in unet_dir.glob("*.safetensors"))


# ---------------------------------------------------------------------------- configs
def zero3_overrides(keep_gathered: int | None) -> dict:
    """DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance (None: DeepSpeed's defaults, 1e9 each)."""
    if keep_gathered is None:
        return {}
    return {"zero_optimization": {"stage3_max_live_parameters": keep_gathered, "stage3_max_reuse_distance": keep_gathered}}


def llm_run_config(model_dir: Path, output_dir: Path, name: str, ranks: int, stage: int, offload: bool, steps: int, keep_gathered: int | None = 0) -> dict:
    overrides = zero3_overrides(keep_gathered) if stage == 3 else {}
    return {
        "run": {"name": name, "output_dir": str(output_dir), "seed": 0},
        "model": {"path": str(model_dir), "lora": {"r": 16}},
        "data": {"synthetic": {"task": "mixed", "examples": 64 * ranks}, "max_seq_len": 128, "packing": True},
        "train": {"max_steps": steps, "micro_batch_size": 1, "gradient_accumulation_steps": 1, "lr": 1e-4, "log_every": 1, "save_every": 10**6},
        "deepspeed": {"zero_stage": stage, "offload_optimizer": "cpu" if offload else "none", "precision": "auto", "overrides": overrides},
        "hardware": {"gpus": ranks, "accelerator": "cpu"},
        "generate": {"prompts": []},
        "logging": {"tensorboard": False},
    }


def sdxl_run_config(
    pipeline_dir: Path, output_dir: Path, name: str, ranks: int, steps: int, resolution: int, keep_gathered: int | None = 0, precision: str = "auto"
) -> dict:
    return {
        "run": {"name": name, "output_dir": str(output_dir), "seed": 0},
        "model": {"path": str(pipeline_dir), "lora": {"r": 16}},
        "data": {
            "synthetic": {"task": "shapes", "examples": 8 * ranks},
            "images": {"resolution": resolution, "bucket_step": 8},
            "cache": {"latents": True, "text": True},
        },
        "train": {"max_steps": steps, "micro_batch_size": 1, "lr": 1e-4, "log_every": 1, "save_every": 10**6},
        "deepspeed": {"zero_stage": 3, "precision": precision, "overrides": zero3_overrides(keep_gathered)},
        "hardware": {"gpus": ranks, "accelerator": "cpu"},
        "generate": {"prompts": []},
        "logging": {"tensorboard": False},
    }


# ---------------------------------------------------------------------------- measuring
def pss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    import psutil

    try:
        return [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


class Sampler(threading.Thread):
    """The summed PSS of a process tree (the launcher and every rank), every SAMPLE_PERIOD_S."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int, int]] = []  # (time, summed PSS, processes)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.time()
            pids = descendants(self.pid)
            self.samples.append((started, sum(pss_of(p) for p in pids), len(pids)))
            self.stop.wait(max(0.0, SAMPLE_PERIOD_S - (time.time() - started)))


LOG_TIME = re.compile(r"^(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3}) rank0 ")


def log_events(run_dir: Path) -> dict[str, float]:
    """Times (epoch seconds) of rank 0's milestones, from its log: started, initialized (training starts), each step."""
    events: dict[str, float] = {}
    log_file = run_dir / "logs" / "rank0.log"
    if not log_file.is_file():
        return events
    for line in log_file.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if not match:
            continue
        at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        events.setdefault("rank_log_start", at)
        if "training steps" in line:
            events["initialized"] = at
        step = re.search(r" step (\d+)/\d+ loss", line)
        if step:
            events[f"step{step.group(1)}"] = at
    return events


def plan(config_file: Path, ranks: int, ram_bytes: int | None) -> dict:
    """``zeropipe plan --json`` of the run config, for CPU ranks of this machine (or one with ``ram_bytes`` of host RAM)."""
    command = [sys.executable, "-m", "zeropipe", "plan", str(config_file), "--cpu-ranks", str(ranks), "--json"]
    if ram_bytes is not None:
        command[-1:-1] = ["--ram", f"{ram_bytes}B"]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"), check=False)
    if result.returncode not in (0, 1):
        raise RuntimeError(f"zeropipe plan failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def train(config_file: Path, run_dir: Path) -> dict:
    """Run ``zeropipe train`` and sample the node's memory; returns the figures and the samples."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", TOKENIZERS_PARALLELISM="false")
    with open(run_dir.parent / f"{run_dir.name}.train.log", "w") as log:
        started = time.time()
        process = subprocess.Popen([sys.executable, "-m", "zeropipe", "train", str(config_file)], stdout=log, stderr=subprocess.STDOUT, env=env)
        sampler = Sampler(process.pid)
        sampler.start()
        code = process.wait()
        ended = time.time()
        sampler.stop.set()
        sampler.join()
    text = (run_dir.parent / f"{run_dir.name}.train.log").read_text(errors="replace")
    if code != 0:
        raise RuntimeError(f"zeropipe train {config_file} failed (exit {code}):\n{text[-4000:]}")
    (run_dir.parent / f"{run_dir.name}.samples.json").write_text(json.dumps({"samples": sampler.samples, "started": started, "ended": ended}))
    return figures_of(run_dir)


def figures_of(run_dir: Path) -> dict:
    """The figures of a finished run, from its saved samples and rank 0's log."""
    saved = json.loads((run_dir.parent / f"{run_dir.name}.samples.json").read_text())
    samples, started = saved["samples"], saved["started"]
    ended = saved.get("ended", samples[-1][0] if samples else started)
    events = log_events(run_dir)

    def peak(start: float, stop: float) -> int:
        return max((pss for t, pss, _ in samples if start <= t <= stop), default=0)

    steps = sorted(v for k, v in events.items() if k.startswith("step"))
    start = events.get("rank_log_start", started)
    initialized = events.get("initialized", start)
    return {
        "wall_s": ended - started,
        "load_s": (steps[0] if steps else ended) - start,  # ranks' start to the end of the first step
        "load_to_initialized_s": initialized - start,
        "peak": max((pss for _, pss, _ in samples), default=0),
        "peak_startup": peak(started, start),
        "peak_loading": peak(start, initialized),
        "peak_training": peak(initialized, ended),
        "settled_before_loading": min((pss for t, pss, n in samples if started + 1 < t <= start), default=0),
        "samples": len(samples),
    }


def planned_terms(plan_json: dict) -> dict:
    configured = plan_json["configured"] or plan_json["best"]
    terms = configured["per_node_terms"]
    return {
        "fits": configured["fits"],
        "why_not": configured["why_not"],
        "node_peak": configured["per_node_bytes"],
        "gpu_peak": configured["per_gpu_bytes"],
        "terms": {t["name"]: (t["bytes"], t["phase"]) for t in terms},
        "gpu_terms": {t["name"]: (t["bytes"], t["phase"]) for t in configured["per_gpu_terms"]},
        # What the loaded model itself occupies on the node: one partitioned copy (ZeRO-3) or one per rank.
        "model_bytes": plan_json["model"]["total_params"]
        * (4 if configured["choice"]["precision"] == "fp32" else 2)
        * (1 if configured["choice"]["zero_stage"] == 3 else plan_json["hardware"]["gpus_per_node"]),
        "process_bytes": configured["per_node_terms"][0]["bytes"],  # rank processes
    }


def gib(num: float) -> str:
    return f"{num / GIB:.2f}"


def report(name: str, planned: dict, measured: dict, checkpoint: int) -> dict:
    ratio = measured["peak"] / planned["node_peak"] if planned["node_peak"] else float("nan")
    loading_planned = sum(b for b, phase in planned["terms"].values() if phase in ("always", "model loading"))
    row = {
        "case": name,
        "planned_node_peak_gib": planned["node_peak"] / GIB,
        "measured_node_peak_gib": measured["peak"] / GIB,
        "measured_over_planned": ratio,
        "within_tolerance": abs(ratio - 1) <= TOLERANCE,
        "planned_loading_gib": loading_planned / GIB,
        "measured_loading_peak_gib": measured["peak_loading"] / GIB,
        "measured_training_peak_gib": measured["peak_training"] / GIB,
        "load_s": measured["load_s"],
        "wall_s": measured["wall_s"],
        "checkpoint_gib": checkpoint / GIB,
        # The loading peak above the rank processes (as planned) and the loaded model's own bytes,
        # as a multiple of the checkpoint on disk (init_ram.py's TRANSIENT, with the planned
        # processes standing in for its measured baseline).
        "loading_transient_x": (measured["peak_loading"] - planned["process_bytes"] - planned["model_bytes"]) / checkpoint,
        "loading_peak_x": measured["peak_loading"] / checkpoint,
        "planned_terms_gib": {k: round(b / GIB, 3) for k, (b, _) in planned["terms"].items()},
        "planned_rank_terms_gib": {k: round(b / GIB, 3) for k, (b, _) in planned["gpu_terms"].items()},
    }
    print(
        f"{name}: planned {gib(planned['node_peak'])} GiB, measured {gib(measured['peak'])} GiB "
        f"({ratio - 1:+.1%}, {'within' if row['within_tolerance'] else 'OUTSIDE'} +-{TOLERANCE:.0%}); "
        f"loading peak {gib(measured['peak_loading'])}, training peak {gib(measured['peak_training'])}; "
        f"start to first step {measured['load_s']:.0f} s, wall {measured['wall_s']:.0f} s",
        flush=True,
    )
    for term, (num, phase) in planned["terms"].items():
        print(f"    plan  {term:<40} {gib(num):>7} GiB  ({phase})")
    return row


RAM_MARGIN = 1.2  # --ram-margin


def free_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def wait_for_ram(needed: int, patience_s: float = 600) -> None:
    """Start a case only when this much RAM is available; other work on the machine must not be OOM-killed by us."""
    deadline = time.time() + patience_s
    while free_ram_bytes() < needed:
        if time.time() > deadline:
            raise RuntimeError(f"only {gib(free_ram_bytes())} GiB available, {gib(needed)} GiB needed: try again later")
        print(f"waiting for RAM: {gib(free_ram_bytes())} GiB available, {gib(needed)} GiB wanted", flush=True)
        time.sleep(20)


# ---------------------------------------------------------------------------- cases
def run_case(name: str, config: dict, work: Path, ranks: int, ram: int | None, checkpoint: int, replan: bool = False) -> dict:
    config_file = work / f"{name}.yaml"
    run_dir = Path(config["run"]["output_dir"]) / config["run"]["name"]
    if replan:
        # The run as it was measured, planned again (after a change to the memory model).
        planned = planned_terms(plan(config_file, ranks, ram))
        return report(name, planned, figures_of(run_dir), checkpoint)
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    planned = planned_terms(plan(config_file, ranks, ram))
    if not planned["fits"]:
        print(f"{name}: the plan says it does not fit: {planned['why_not']}", flush=True)
    shutil.rmtree(run_dir, ignore_errors=True)
    wait_for_ram(int(planned["node_peak"] * RAM_MARGIN))
    measured = train(config_file, run_dir)
    return report(name, planned, measured, checkpoint)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/real_scale"), help="models, configs, runs and logs (kept for reuse)")
    parser.add_argument("--cases", nargs="*", default=["sdxl", "llm-z3", "llm-z2"], choices=["sdxl", "llm-z3", "llm-z2"])
    parser.add_argument("--quick", action="store_true", help="a 0.4B Llama instead of Llama-3.2-1B (the LLM cases only)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    parser.add_argument(
        "--budget",
        default="16GB",
        help="llm-z2: host RAM the planner is told the ZeRO-2 runs may use (the other cases are planned for this machine's RAM)",
    )
    parser.add_argument("--resolution", type=int, default=32, help="SDXL image size in pixels (the tiny VAE's latents are half of it per side)")
    parser.add_argument(
        "--keep-gathered",
        default="0",
        help="ZeRO-3 runs: DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance (default 0: each layer released "
        "after use; 'deepspeed' for DeepSpeed's own 1e9, which keeps up to 1e9 weights gathered on every rank)",
    )
    parser.add_argument(
        "--sdxl-precision",
        default="auto",
        choices=["auto", "bf16", "fp32"],
        help="SDXL's training precision (default auto: bf16 only where the CPU runs it natively, avx512_bf16/AMX, else fp32; "
        "on AVX2-only CPUs bf16 is emulated, 18-56x slower than fp32; the UNet's 2.57B fp32 weights alone are 9.6 GiB on the node)",
    )
    parser.add_argument("--sdxl-steps", type=int, help="optimizer steps of the SDXL run (default --steps)")
    parser.add_argument("--replan", action="store_true", help="do not train: plan the runs already measured in --workdir again and compare")
    parser.add_argument("--json", type=Path, help="also write the rows to this file")
    parser.add_argument(
        "--ram-margin",
        type=float,
        default=1.2,
        help="start a case only when this multiple of its planned node peak is available (default 1.2; "
        "the fp32 SDXL case plans 19.2 GiB, so a 24 GiB machine needs about 1.05 and nothing else running)",
    )
    args = parser.parse_args(argv)
    global RAM_MARGIN
    RAM_MARGIN = args.ram_margin

    from zeropipe.plan.hardware import parse_size

    keep = None if args.keep_gathered == "deepspeed" else int(float(args.keep_gathered))
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    runs = work / "runs"
    ram = parse_size(args.budget, "--budget")
    rows = []
    if "sdxl" in args.cases:
        pipeline_dir = work / "sdxl"
        checkpoint = build_sdxl_dir(pipeline_dir)
        print(f"SDXL pipeline: {pipeline_dir} (UNet {gib(checkpoint)} GiB of bf16 safetensors)", flush=True)
        rows.append(run_case("sdxl-z3-5ranks", sdxl_run_config(pipeline_dir, runs, "sdxl-z3-5ranks", 5, args.sdxl_steps or args.steps, args.resolution, keep, args.sdxl_precision), work, 5, None, checkpoint, args.replan))
    llm_cases = [c for c in args.cases if c.startswith("llm")]
    if llm_cases:
        if args.quick:
            config, label = QUICK_LLM, "llama-0.4b"
        else:
            config, label = json.loads((CATALOG / "llama-3.2-1b.json").read_text())["config"], "llama-3.2-1b"
        model_dir = work / label
        checkpoint = build_llm_dir(config, model_dir)
        print(f"LLM: {model_dir} ({gib(checkpoint)} GiB of bf16 safetensors)", flush=True)
        if "llm-z3" in llm_cases:
            name = f"{label}-z3-offload-4ranks"
            rows.append(run_case(name, llm_run_config(model_dir, runs, name, 4, 3, True, args.steps, keep), work, 4, None, checkpoint, args.replan))
        if "llm-z2" in llm_cases:
            fitting = None
            for ranks in (3, 2, 1):
                name = f"{label}-z2-{ranks}ranks"
                config_file = work / f"{name}.yaml"
                if not args.replan:
                    config_file.write_text(yaml.safe_dump(llm_run_config(model_dir, runs, name, ranks, 2, False, args.steps), sort_keys=False))
                planned = planned_terms(plan(config_file, ranks, ram))
                verdict = "fits" if planned["fits"] else f"refused: {planned['why_not']}"
                print(f"{name}: planned {gib(planned['node_peak'])} GiB of {args.budget}: {verdict}", flush=True)
                if planned["fits"]:
                    fitting = ranks
                    break
            if fitting is not None:
                name = f"{label}-z2-{fitting}ranks"
                rows.append(run_case(name, llm_run_config(model_dir, runs, name, fitting, 2, False, args.steps), work, fitting, ram, checkpoint, args.replan))
    print()
    print(f"{'case':<32} {'plan GiB':>8} {'measured':>8} {'ratio':>6} {'load s':>6} {'wall s':>6} {'load peak':>9} {'transient':>9}")
    for row in rows:
        print(
            f"{row['case']:<32} {row['planned_node_peak_gib']:>8.2f} {row['measured_node_peak_gib']:>8.2f} "
            f"{row['measured_over_planned']:>6.2f} {row['load_s']:>6.0f} {row['wall_s']:>6.0f} "
            f"{row['loading_peak_x']:>8.2f}x {row['loading_transient_x']:>8.2f}x"
        )
    print("load s: ranks' start to the end of step 1; load peak: the node's PSS peak until deepspeed.initialize returns, as a multiple")
    print("of the checkpoint on disk; transient: that peak less the planned rank processes and the loaded model's own bytes.")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
