"""The planner's cost model against measured step times, on this machine's CPU ranks.

    .venv/bin/python benchmarks/cost_model.py            # 8 settings, a few minutes on 2 cores
    .venv/bin/python benchmarks/cost_model.py --quick    # 3 settings, fewer steps (smoke run)

One model, one machine, several settings the planner chooses between (ZeRO stage, micro-batch
x accumulation, gradient checkpointing). For each: the step time the planner predicts (the sum
of ``plan/cost.py``'s terms for the config's own settings, ``zeropipe plan CONFIG --json``)
with its assumed speeds and with the speeds ``zeropipe calibrate`` measured here; and the
median step time ``zeropipe train`` measures (metrics.jsonl, after a warm-up). Packed
sequences keep every row at ``max_seq_len`` tokens, as the model assumes.

Reported: each prediction's error, the Spearman rank correlation of predicted and measured
times (target >= 0.8), and whether the setting the model ranks fastest is the measured
fastest or within 5% of it. The model's constants come only from calibrate's
micro-measurements; nothing here is fitted to these step times. CPU ranks never offload, so
the offload and host-link terms are validated only by scripts/gpu-check.sh on GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

SETTINGS = [
    # name, zero stage, micro-batch, accumulation, checkpointing
    ("zero0 8x1", 0, 8, 1, False),
    ("zero1 8x1", 1, 8, 1, False),
    ("zero2 8x1", 2, 8, 1, False),
    ("zero3 8x1", 3, 8, 1, False),
    ("zero2 4x2", 2, 4, 2, False),
    ("zero2 2x4", 2, 2, 4, False),
    ("zero2 8x1 ckpt", 2, 8, 1, True),
    ("zero3 4x2 ckpt", 3, 4, 2, True),
]
QUICK = ["zero0 8x1", "zero3 8x1", "zero2 2x4"]


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, index in enumerate(order):
            out[index] = float(rank)
        return out

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry)) / (n * (n * n - 1))


def config_for(work: Path, name: str, stage: int, micro: int, accumulation: int, ckpt: bool, steps: int, hidden: int, layers: int, seq: int) -> Path:
    raw = {
        "run": {"name": name.replace(" ", "-"), "output_dir": str(work / "runs"), "seed": 1},
        "model": {
            "config": {
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": hidden * 2,
                "num_hidden_layers": layers,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": seq,
                "tie_word_embeddings": False,
            },
            "tokenizer_vocab_size": 300,
            "gradient_checkpointing": ckpt,
        },
        "data": {"synthetic": {"task": "mixed", "examples": 6000}, "max_seq_len": seq, "packing": True},
        "train": {"max_steps": steps, "micro_batch_size": micro, "gradient_accumulation_steps": accumulation, "lr": 1e-3, "warmup_steps": 2, "log_every": steps},
        "deepspeed": {"zero_stage": stage, "precision": "auto"},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
        "generate": {"prompts": []},
    }
    path = work / f"{raw['run']['name']}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def predicted_seconds(config: Path, profile: Path | None) -> float:
    env = dict(os.environ, ZEROPIPE_CALIBRATION=str(profile) if profile else "/nonexistent/calibration.json", DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-m", "zeropipe", "plan", str(config), "--json"], capture_output=True, text=True, env=env, check=True)
    plan = json.loads(done.stdout)
    return sum(plan["configured"]["seconds"].values())


def measured_seconds(config: Path, work: Path, warmup: int) -> float:
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-m", "zeropipe", "train", str(config)], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{done.stderr[-3000:]}")
    name = yaml.safe_load(config.read_text())["run"]["name"]
    rows = [json.loads(line) for line in (work / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    times = [row["step_time_s"] for row in rows if row.get("kind") is None][warmup:]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="steps per setting (default 30, 12 with --quick)")
    parser.add_argument("--warmup", type=int, default=None, help="first steps left out (default 8, 4 with --quick)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    steps = args.steps or (12 if args.quick else 30)
    warmup = args.warmup if args.warmup is not None else (4 if args.quick else 8)
    settings = [s for s in SETTINGS if not args.quick or s[0] in QUICK]
    work = Path(tempfile.mkdtemp(prefix="zeropipe-cost-model-"))
    profile = work / "calibration.json"
    started = time.time()
    print(f"cost model validation: llama hidden {args.hidden} x {args.layers} layers, {args.seq} tokens packed, 2 CPU ranks, {steps} steps per setting (first {warmup} left out)", flush=True)
    subprocess.run([sys.executable, "-m", "zeropipe", "calibrate", "--ranks", "2", "--profile", str(profile)] + (["--quick"] if args.quick else []), check=True, capture_output=True)
    print(f"calibration: {json.loads(profile.read_text())['matmul_flops']} FLOP/s; see {profile}", flush=True)
    rows = []
    for name, stage, micro, accumulation, ckpt in settings:
        config = config_for(work, name, stage, micro, accumulation, ckpt, steps, args.hidden, args.layers, args.seq)
        assumed = predicted_seconds(config, None)
        calibrated = predicted_seconds(config, profile)
        measured = measured_seconds(config, work, warmup)
        rows.append((name, assumed, calibrated, measured))
        print(f"  {name:<16} predicted {assumed * 1e3:8.1f} ms (assumed)  {calibrated * 1e3:8.1f} ms (calibrated)   measured {measured * 1e3:8.1f} ms", flush=True)

    print("\n| setting | predicted, assumed speeds | predicted, calibrated | measured | error, calibrated |")
    print("|---|---|---|---|---|")
    for name, assumed, calibrated, measured in rows:
        print(f"| {name} | {assumed * 1e3:.1f} ms | {calibrated * 1e3:.1f} ms | {measured * 1e3:.1f} ms | {100 * (calibrated - measured) / measured:+.0f}% |")
    measured = [r[3] for r in rows]
    fastest = min(measured)
    for label, column in (("assumed", 1), ("calibrated", 2)):
        predicted = [r[column] for r in rows]
        pick = min(range(len(rows)), key=lambda i: predicted[i])
        within = measured[pick] <= 1.05 * fastest
        print(
            f"{label}: Spearman {spearman(predicted, measured):.2f} (target >= 0.8); pick {rows[pick][0]} measured {measured[pick] * 1e3:.1f} ms, "
            f"fastest {rows[measured.index(fastest)][0]} {fastest * 1e3:.1f} ms: {'within 5%' if within else 'NOT within 5%'}"
        )
    print(f"total wall time {time.time() - started:.0f} s; work directory {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
