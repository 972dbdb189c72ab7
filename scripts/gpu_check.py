"""What only a GPU shows, in one command: ``bash scripts/gpu-check.sh [--out DIR] [--only STEP,...]``.

Run it first on any machine with CUDA GPUs; it writes ``DIR/report.md`` and ``DIR/report.json``
(default ``gpu-check/``) with the figures BENCHMARKS.md quotes. Steps:

- ``environment``: torch, CUDA, NCCL, DeepSpeed versions and the GPUs;
- ``quickstart``: ``examples/quickstart.yaml`` on NCCL ranks (up to 2 GPUs): the loss falls;
- ``zero3_offload``: a larger model under ZeRO-3 with optimizer and parameter offload;
- ``qlora``: a 4-bit (bitsandbytes) base with LoRA, trained and exported;
- ``fp8_base``: an fp8 base (``model.quantization: fp8``) with LoRA under ZeRO-3 on NCCL ranks,
  trained and exported (the uint8 byte view gathered by NCCL, dequantized on the GPU);
- ``calibrate``: ``zeropipe calibrate`` on every GPU (the planner's measured speeds);
- ``plan_vs_measured``: three configs' planned per-GPU peak against
  ``torch.cuda.max_memory_allocated`` (metrics.jsonl's ``gpu_max_allocated_bytes``);
- ``hf_trainer``: tokens/s of ZeRO-Pipe against the Hugging Face Trainer with the same
  DeepSpeed JSON, model and token cache, on the same GPUs;
- ``llama8b_lora_zero3``: a Llama-3.1-8B-shaped model (random weights) with LoRA under ZeRO-3,
  2048-token packed sequences; ``video_dit_blocks``: Wan 2.1 14B's transformer cut to 4 blocks at
  its real width (5120, 40 heads, FFN 13824), LoRA, 33-frame clips. Each is planned (``zeropipe plan
  CONFIG --json``) against what the GPU holds: ``max_memory_reserved`` plus the CUDA context
  (``torch.cuda.mem_get_info`` in a fresh process), and timed as tokens/s and MFU against
  ``calibrate``'s bf16 peak (run ``calibrate`` first, as the default order does).

Each step is independent: a failure is recorded with its log's tail and the next step runs.
Without CUDA every step is skipped with the reason, except ``calibrate`` and
``plan_vs_measured``, which also run on CPU ranks (``--cpu``: what CI exercises).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
STEPS = ["environment", "quickstart", "zero3_offload", "qlora", "fp8_base", "calibrate", "plan_vs_measured", "hf_trainer", "llama8b_lora_zero3", "video_dit_blocks"]
CPU_STEPS = {"calibrate", "plan_vs_measured"}

# A ~0.2B Llama (random weights, built from this config): big enough that plan and GPU counters are not noise.
MEDIUM_LLAMA = {
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
}
# Llama-3.1-8B's shape (meta-llama/Llama-3.1-8B config.json), random weights: what a real-size LoRA step holds and how fast it runs.
LLAMA_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
}
# Wan 2.1 14B's transformer (Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json) at its real width, 4 of its 40 blocks,
# over the tiny preset's VAE and text encoder (the blocks are what the step measures; text_dim stays the tiny encoder's).
WAN14B_BLOCKS = {
    "pipeline": "tiny-wan",
    "transformer": {"num_attention_heads": 40, "attention_head_dim": 128, "ffn_dim": 13824, "num_layers": 4, "freq_dim": 256, "rope_max_seq_len": 1024,
                    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-06},
}
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


class Check:
    """The driver: runs steps, keeps their results, writes the report."""

    def __init__(self, out: Path, cpu: bool):
        self.out = out
        self.cpu = cpu
        self.results: dict[str, dict[str, Any]] = {}
        out.mkdir(parents=True, exist_ok=True)

    # -------------------------------------------------------------- plumbing
    def zeropipe(self, *args: str, log: str, timeout: float = 3600) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        if self.cpu:
            env.setdefault("DS_ACCELERATOR", "cpu")
        with open(self.out / log, "w") as handle:
            return subprocess.run([sys.executable, "-m", "zeropipe", *args], stdout=handle, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env, cwd=ROOT)

    def write_config(self, name: str, raw: dict[str, Any]) -> Path:
        import yaml

        raw.setdefault("run", {})
        raw["run"].update(name=name, output_dir=str(self.out / "runs"))
        path = self.out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return path

    def train(self, name: str, raw: dict[str, Any], extra: tuple[str, ...] = ()) -> dict[str, Any]:
        """Train a config; its metrics, summary and peak device memory, or the log's tail on failure."""
        path = self.write_config(name, raw)
        started = time.time()
        done = self.zeropipe("train", str(path), *extra, log=f"{name}.log")
        run_dir = self.out / "runs" / name
        result: dict[str, Any] = {"config": str(path), "run_dir": str(run_dir), "wall_s": round(time.time() - started, 1), "returncode": done.returncode}
        if done.returncode != 0:
            result["log_tail"] = (self.out / f"{name}.log").read_text()[-3000:]
            return result
        rows = read_metrics(run_dir)
        result.update(measured_figures(rows))
        summary = run_dir / "summary.json"
        if summary.is_file():
            result["summary"] = json.loads(summary.read_text())
        return result

    def run(self, steps: list[str]) -> int:
        failures = 0
        for step in steps:
            if not self.cpu and not cuda_devices() and step != "environment":
                self.results[step] = {"skipped": "no CUDA device here (use --cpu for the steps that run on CPU ranks)"}
                continue
            if self.cpu and step not in CPU_STEPS | {"environment"}:
                self.results[step] = {"skipped": "needs CUDA"}
                continue
            print(f"gpu-check: {step}...", flush=True)
            started = time.time()
            try:
                result = getattr(self, f"step_{step}")()
            except Exception as err:  # noqa: BLE001 - one step's failure is recorded; the others still run
                result = {"error": f"{type(err).__name__}: {err}"}
            result.setdefault("seconds", round(time.time() - started, 1))
            self.results[step] = result
            failed = "error" in result or result.get("returncode", 0) != 0 or result.get("ok") is False
            failures += failed
            print(f"gpu-check: {step}: {'FAILED' if failed else 'ok'} ({result['seconds']} s)", flush=True)
        (self.out / "report.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "report.md").write_text(render(self.results))
        print(f"gpu-check: report in {self.out / 'report.md'}", flush=True)
        return 1 if failures else 0

    def gpus(self, most: int) -> int:
        return max(1, min(most, len(cuda_devices()) or 1))

    # ----------------------------------------------------------------- steps
    def step_environment(self) -> dict[str, Any]:
        import torch

        facts: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda, "gpus": cuda_devices()}
        try:
            import deepspeed

            facts["deepspeed"] = deepspeed.__version__
        except ImportError as err:
            facts["deepspeed"] = f"not importable: {err}"
        if torch.cuda.is_available():
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            facts["bf16"] = torch.cuda.is_bf16_supported()
        done = self.zeropipe("doctor", "--json", "--no-build", log="doctor.log")
        facts["doctor_returncode"] = done.returncode
        return facts

    def step_quickstart(self) -> dict[str, Any]:
        import yaml

        raw = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
        raw["hardware"] = {"gpus": self.gpus(2)}
        result = self.train("quickstart", raw)
        result["ok"] = result.get("returncode") == 0 and result.get("final_loss", 1e9) < 0.5 * result.get("first_loss", 0)
        return result

    def step_zero3_offload(self) -> dict[str, Any]:
        raw = {
            "model": {"config": MEDIUM_LLAMA, "tokenizer_vocab_size": 2000},
            "data": {"synthetic": {"task": "mixed", "examples": 4000}, "max_seq_len": 512},
            "train": {"max_steps": 30, "micro_batch_size": 4, "lr": 3e-4, "warmup_steps": 5},
            "deepspeed": {"zero_stage": 3, "precision": "bf16", "offload_optimizer": "cpu", "offload_param": "cpu"},
            "hardware": {"gpus": self.gpus(4)},
        }
        result = self.train("zero3-offload", raw)
        result["ok"] = result.get("returncode") == 0 and result.get("final_loss", 1e9) < result.get("first_loss", 0)
        return result

    def step_qlora(self) -> dict[str, Any]:
        base = self.out / "qlora-base"
        build_random_model(base, {**MEDIUM_LLAMA, "vocab_size": 2000})
        raw = {
            "model": {"path": str(base), "lora": {"r": 16}, "quantization": {}},
            "data": {"synthetic": {"task": "mixed", "examples": 2000}, "max_seq_len": 256},
            "train": {"max_steps": 30, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 5},
            "deepspeed": {"zero_stage": 2, "precision": "bf16"},
            "hardware": {"gpus": self.gpus(2)},
        }
        result = self.train("qlora", raw)
        if result.get("returncode") == 0:
            done = self.zeropipe("export", result["run_dir"], "--out", str(self.out / "qlora-export"), log="qlora-export.log")
            result["export_returncode"] = done.returncode
        result["ok"] = result.get("returncode") == 0 and result.get("export_returncode") == 0
        return result

    def step_fp8_base(self) -> dict[str, Any]:
        base = self.out / "fp8-base"
        build_random_model(base, {**MEDIUM_LLAMA, "vocab_size": 2000})
        raw = {
            "model": {"path": str(base), "lora": {"r": 16}, "quantization": "fp8"},
            "data": {"synthetic": {"task": "mixed", "examples": 2000}, "max_seq_len": 256},
            "train": {"max_steps": 30, "micro_batch_size": 4, "lr": 1e-3, "warmup_steps": 5},
            "deepspeed": {"zero_stage": 3, "precision": "bf16"},
            "hardware": {"gpus": self.gpus(2)},
        }
        result = self.train("fp8-base", raw)
        if result.get("returncode") == 0:
            done = self.zeropipe("export", result["run_dir"], "--out", str(self.out / "fp8-base-export"), log="fp8-base-export.log")
            result["export_returncode"] = done.returncode
        result["ok"] = result.get("returncode") == 0 and result.get("export_returncode") == 0 and result.get("final_loss", 1e9) < result.get("first_loss", 0)
        return result

    def step_calibrate(self) -> dict[str, Any]:
        profile = self.out / "calibration.json"
        args = ["calibrate", "--profile", str(profile), "--json"] + (["--quick", "--ranks", "2"] if self.cpu else [])
        done = self.zeropipe(*args, log="calibrate.log")
        result: dict[str, Any] = {"returncode": done.returncode, "profile": str(profile)}
        if done.returncode == 0:
            result["calibration"] = json.loads(profile.read_text())
        return result

    def step_plan_vs_measured(self) -> dict[str, Any]:
        """Three configs: the planner's per-GPU peak against the peak the ranks measured."""
        model = TINY_LLAMA if self.cpu else MEDIUM_LLAMA
        seq = 64 if self.cpu else 512
        steps = 4 if self.cpu else 12
        hardware = {"gpus": 2, "accelerator": "cpu"} if self.cpu else {"gpus": self.gpus(2)}
        precision = "fp32" if self.cpu else "bf16"
        settings = {
            "zero2-full": ({"zero_stage": 2}, {}),
            "zero3-full-ckpt": ({"zero_stage": 3}, {"gradient_checkpointing": True}),
            "zero3-lora": ({"zero_stage": 3}, {"lora": {"r": 16}}),
        }
        if self.cpu:  # CI exercises the path with one config; a GPU measures all three
            settings = {"zero3-lora": settings["zero3-lora"]}
        rows = []
        for name, (deepspeed, model_extra) in settings.items():
            raw = {
                "model": {"config": model, "tokenizer_vocab_size": 300 if self.cpu else 2000, **model_extra},
                "data": {"synthetic": {"task": "mixed", "examples": 400}, "max_seq_len": seq},
                "train": {"max_steps": steps, "micro_batch_size": 4},
                "deepspeed": {"precision": precision, **deepspeed},
                "hardware": hardware,
            }
            trained = self.train(f"plan-{name}", raw)
            if trained.get("returncode") != 0:
                rows.append({"config": name, "error": trained.get("log_tail", "")[-800:]})
                continue
            done = subprocess.run(
                [sys.executable, "-m", "zeropipe", "plan", str(Path(trained["config"]).resolve()), "--json"],
                capture_output=True,
                text=True,
                cwd=ROOT,
                env=dict(os.environ, **({"DS_ACCELERATOR": "cpu"} if self.cpu else {})),
            )
            # On GPUs: the planned per-GPU peak against the largest rank's max_memory_allocated. On CPU
            # ranks there is no device memory: the planned host RAM of the node against the ranks' RSS together.
            planned = planned_peak(json.loads(done.stdout), "per_node_bytes" if self.cpu else "per_gpu_bytes") if done.returncode == 0 else None
            rows.append(compare_peaks(name, planned, trained, key="host_rss_bytes_node" if self.cpu else "gpu_max_allocated_bytes"))
        return {
            "ok": all("error" not in row and row.get("planned_over_measured") for row in rows),
            "rows": rows,
            "measured_with": "the node's planned host RAM against the CPU ranks' RSS together (no GPU here)" if self.cpu else "torch.cuda.max_memory_allocated per rank",
        }

    def step_hf_trainer(self) -> dict[str, Any]:
        """Tokens/s: ZeRO-Pipe against transformers' Trainer with the same DeepSpeed JSON, model and tokens."""
        raw = {
            "model": {"config": MEDIUM_LLAMA, "tokenizer_vocab_size": 2000},
            "data": {"synthetic": {"task": "mixed", "examples": 4000}, "max_seq_len": 512},
            "train": {"max_steps": 60, "micro_batch_size": 8, "lr": 3e-4, "warmup_steps": 5},
            "deepspeed": {"zero_stage": 2, "precision": "bf16"},
            "hardware": {"gpus": self.gpus(2)},
        }
        ours = self.train("hf-compare", raw)
        if ours.get("returncode") != 0:
            return ours
        gpus = self.gpus(2)
        script = ROOT / "scripts" / "gpu_check_hf_trainer.py"
        with open(self.out / "hf-trainer.log", "w") as handle:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={gpus}", str(script), ours["run_dir"], str(self.out / "hf-trainer.json")],
                stdout=handle,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        result = {"zeropipe_tokens_per_s": ours.get("tokens_per_s_median"), "returncode": done.returncode}
        if done.returncode == 0:
            theirs = json.loads((self.out / "hf-trainer.json").read_text())
            result.update(hf_trainer_tokens_per_s=theirs["tokens_per_s"], ratio=round(ours["tokens_per_s_median"] / theirs["tokens_per_s"], 3))
        else:
            result["log_tail"] = (self.out / "hf-trainer.log").read_text()[-3000:]
        return result


    def step_llama8b_lora_zero3(self) -> dict[str, Any]:
        """A Llama-3.1-8B-shaped LoRA under ZeRO-3 at 2048 packed tokens: planned against what the GPU holds, timed."""
        raw = llama8b_config(self.gpus(8))
        return self.real_size_step("llama8b-lora-zero3", raw, flops_per_token=llm_flops_per_token(LLAMA_8B, 2048, lora=True))

    def step_video_dit_blocks(self) -> dict[str, Any]:
        """Wan 14B's transformer at real width, 4 blocks, LoRA on 33-frame clips: planned against what the GPU holds, timed."""
        raw = video_dit_config(self.gpus(1))
        return self.real_size_step("video-dit-blocks", raw, flops_per_token=None, flops_per_sample=dit_flops_per_sample)

    def real_size_step(self, name: str, raw: dict[str, Any], flops_per_token: float | None, flops_per_sample: Callable[[str], float | None] | None = None) -> dict[str, Any]:
        trained = self.train(name, raw)
        if trained.get("returncode") != 0:
            return trained
        done = subprocess.run([sys.executable, "-m", "zeropipe", "plan", trained["config"], "--json"], capture_output=True, text=True, cwd=ROOT)
        plan = json.loads(done.stdout) if done.returncode in (0, 1) and done.stdout.strip().startswith("{") else {}
        context = cuda_context_bytes()
        result = held_against_plan(planned_peak(plan) if plan else None, trained, context)
        peak = ((self.results.get("calibrate") or {}).get("calibration") or {}).get("matmul_flops", {}).get("bf16")
        result.update(throughput(trained, flops_per_token, peak, self.gpus(8 if name.startswith("llama") else 1), flops_per_sample(trained["config"]) if flops_per_sample else None))
        result["ok"] = trained.get("final_loss", 1e9) < trained.get("first_loss", 0) * 1.5 and result.get("planned_over_held") is not None
        return result


# ------------------------------------------------------------------ pure parts (tested on CPU)
def llama8b_config(gpus: int) -> dict[str, Any]:
    return {
        "model": {"config": LLAMA_8B, "tokenizer_vocab_size": 2000, "gradient_checkpointing": True, "lora": {"r": 16, "alpha": 32}},
        # Packed 2048-token sequences: every micro-batch is full length, as the plan assumes (short synthetic examples
        # padded to the batch's longest were what made the 0.2B plan_vs_measured rows read 6.7x).
        "data": {"synthetic": {"task": "mixed", "examples": 20000}, "max_seq_len": 2048, "packing": True},
        "train": {"max_steps": 12, "micro_batch_size": 1, "lr": 2e-4, "warmup_steps": 2},
        "deepspeed": {"zero_stage": 3, "precision": "bf16"},
        "hardware": {"gpus": gpus},
    }


def video_dit_config(gpus: int) -> dict[str, Any]:
    return {
        "model": {"config": WAN14B_BLOCKS, "gradient_checkpointing": True, "lora": {"r": 32, "alpha": 32}},
        "data": {"synthetic": {"task": "shapes", "examples": 24}, "images": {"resolution": 480, "bucket_step": 16}, "video": {"frame_buckets": [33]}},
        "train": {"max_steps": 10, "micro_batch_size": 1, "lr": 1e-4, "warmup_steps": 2},
        "deepspeed": {"zero_stage": 2, "precision": "bf16"},
        "hardware": {"gpus": gpus},
    }


def llm_flops_per_token(config: dict[str, Any], seq: int, lora: bool) -> float:
    """Model FLOPs per trained token (recomputation not counted, as MFU is defined): the matmuls of every weight but the
    input embedding, 2 per weight forward, 2 more backward for the input gradients, 2 more for weight gradients unless
    the weights are frozen (LoRA); attention's QK^T and PV, 4·L·s·d forward, three times that in all."""
    h, i, layers, heads, kv = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads"))
    head = h // heads
    per_layer = h * heads * head + 2 * h * kv * head + heads * head * h + 3 * h * i
    weights = layers * per_layer + h * config["vocab_size"]
    return (4 if lora else 6) * weights + 12 * layers * seq * heads * head


def held_against_plan(planned: int | None, trained: dict[str, Any], context: int | None) -> dict[str, Any]:
    """What the GPU held (the busiest rank's max_memory_reserved, plus the CUDA context) against the plan's per-GPU peak."""
    reserved = trained.get("gpu_max_reserved_bytes_peak")
    held = reserved + context if reserved is not None and context is not None else None
    row: dict[str, Any] = {"planned_bytes": planned, "reserved_bytes": reserved, "context_bytes": context, "held_bytes": held, "allocated_bytes": trained.get("gpu_max_allocated_bytes_peak")}
    row["planned_over_held"] = round(planned / held, 3) if planned and held else None
    return row


def dit_flops_per_sample(config: str) -> float | None:
    """A LoRA step's model FLOPs per clip: the forward the planner traces (meta device, at the config's resolution and frames),
    and once more for the backward's input gradients (the frozen base gets no weight gradients)."""
    from zeropipe.config.load import load_config
    from zeropipe.families import model_spec

    trace = model_spec(load_config(config)).activation_trace
    return 2.0 * trace.forward_flops if trace is not None else None


def throughput(trained: dict[str, Any], flops_per_token: float | None, peak: float | None, gpus: int, flops_per_sample: float | None = None) -> dict[str, Any]:
    tokens = trained.get("tokens_per_s_median")
    samples = trained.get("samples_per_s_median")
    out: dict[str, Any] = {"tokens_per_s": tokens, "samples_per_s": samples, "bf16_peak_flops": peak}
    if tokens and flops_per_token and peak:
        out["mfu"] = round(tokens * flops_per_token / (peak * gpus), 4)
    elif samples and flops_per_sample and peak:
        out["mfu"] = round(samples * flops_per_sample / (peak * gpus), 4)
    elif not peak:
        out["mfu"] = "no calibrate result in this run: run the calibrate step first"
    return out


def cuda_context_bytes() -> int | None:
    """Device memory a fresh CUDA process holds outside PyTorch's allocator (context, cuBLAS handle): mem_get_info's used less reserved."""
    code = (
        "import torch; x = torch.ones(1024, 1024, device='cuda', dtype=torch.bfloat16); (x @ x).sum().item(); "
        "free, total = torch.cuda.mem_get_info(); print(total - free - torch.cuda.memory_reserved())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return int(done.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None



def cuda_devices() -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [row for row in (json.loads(line) for line in path.read_text().splitlines() if line.strip()) if row.get("kind") is None]


def measured_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last loss, median throughput and the peak memory the ranks reported."""
    if not rows:
        return {}
    figures: dict[str, Any] = {"steps": len(rows), "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"]}
    later = rows[len(rows) // 4 :] or rows
    for key in ("tokens_per_s", "samples_per_s", "step_time_s"):
        values = sorted(row[key] for row in later if key in row)
        if values:
            figures[f"{key}_median"] = values[len(values) // 2]
    for key in ("gpu_max_allocated_bytes", "gpu_max_reserved_bytes", "host_rss_bytes"):
        values = [max(row[key]) for row in rows if row.get(key)]
        if values:
            figures[f"{key}_peak"] = max(values)
    node = [sum(row["host_rss_bytes"]) for row in rows if row.get("host_rss_bytes")]
    if node:
        figures["host_rss_bytes_node_peak"] = max(node)  # all ranks of the node together: what host RAM must hold
    return figures


def planned_peak(plan: dict[str, Any], key: str = "per_gpu_bytes") -> int | None:
    """The peak the planner gives the config's own settings (``configured``), else its pick: per GPU, or per node (host RAM)."""
    chosen = plan.get("configured") or plan.get("best")
    return int(chosen[key]) if chosen else None


def compare_peaks(name: str, planned: int | None, trained: dict[str, Any], key: str) -> dict[str, Any]:
    measured = trained.get(f"{key}_peak")
    row: dict[str, Any] = {"config": name, "planned_bytes": planned, "measured_bytes": measured}
    if trained.get("gpu_max_reserved_bytes_peak"):
        row["reserved_bytes"] = trained["gpu_max_reserved_bytes_peak"]  # what the allocator held: allocated plus its cache
    if planned and measured:
        row["planned_over_measured"] = round(planned / measured, 3)
    return row


def build_random_model(path: Path, config: dict[str, Any]) -> None:
    """A causal LM with random weights saved as safetensors, with a tokenizer: what QLoRA and the fp8 base load and quantize."""
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    from zeropipe.data.tokenizer import train_tokenizer

    fields = dict(config)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.save_pretrained(path)
    # model.path names the tokenizer too (as a published folder does): one trained here on the synthetic task's words.
    words = ["add", "the", "numbers", "sum", "is", "reverse", "copy", "sort", "answer", "question"]
    texts = (f"{words[i % 10]} {i} {words[(i * 7) % 10]} {i * 13 % 997} = {i * 31 % 1009}" for i in range(20000))
    train_tokenizer(texts, config["vocab_size"], path)


def render(results: dict[str, dict[str, Any]]) -> str:
    lines = ["# gpu-check report", ""]
    for step, result in results.items():
        lines.append(f"## {step}")
        if "skipped" in result:
            lines += [f"skipped: {result['skipped']}", ""]
            continue
        if step == "plan_vs_measured":
            lines += [f"measured with {result.get('measured_with')}", "", "| config | planned | measured | planned / measured |", "|---|---|---|---|"]
            for row in result.get("rows", []):
                if "error" in row:
                    lines.append(f"| {row['config']} | failed | | |")
                    continue
                gib: Callable[[Any], str] = lambda v: f"{v / 2**30:.2f} GiB" if v else "-"  # noqa: E731
                lines.append(f"| {row['config']} | {gib(row['planned_bytes'])} | {gib(row['measured_bytes'])} | {row.get('planned_over_measured', '-')} |")
            lines.append("")
            continue
        shown = {k: v for k, v in result.items() if k not in ("log_tail", "summary", "calibration")}
        lines += [f"- {key}: {value}" for key, value in shown.items()]
        if "calibration" in result:
            lines.append(f"- profile: {json.dumps(result['calibration'])}")
        if "log_tail" in result:
            lines += ["", "```", result["log_tail"][-1500:], "```"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    parser.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps (default all): {', '.join(STEPS)}")
    parser.add_argument("--cpu", action="store_true", help="run the steps that also run on CPU ranks, on CPU ranks (what CI exercises)")
    args = parser.parse_args(argv)
    steps = [step.strip() for step in args.only.split(",") if step.strip()]
    unknown = [step for step in steps if step not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {', '.join(STEPS)}")
    if args.out.exists() and (args.out / "runs").exists():
        shutil.rmtree(args.out / "runs")
    return Check(args.out, args.cpu).run(steps)


if __name__ == "__main__":
    sys.exit(main())
