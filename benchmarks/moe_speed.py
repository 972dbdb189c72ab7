"""A tiny mixture of experts on 2 CPU ranks: ZeRO-3 with leaf blocks vs without, vs ZeRO-2, grouped matmul vs per-expert loops.

    .venv/bin/python benchmarks/moe_speed.py                  # 5 runs of 2 ranks (~5 min on 2 shared cores)
    .venv/bin/python benchmarks/moe_speed.py --steps 20 --timeout 900

Every run is ``zeropipe train`` of the same tiny Qwen3-MoE (the real ``Qwen3MoeForCausalLM``: 4 layers,
hidden 64, 32 experts, 4 per token), full fine-tuning in fp32 on the same synthetic data, on 2 CPU ranks
(gloo). The figure is the median step time of the steps after the first two (start-up excluded); each
variant is given as a ratio to the baseline measured in the same invocation, ZeRO-3 with leaf blocks and
transformers' grouped matmul (the default). A run that does not finish within --timeout is reported as
such (ZeRO-3 without leaves can hang when experts are separate modules; transformers 5's experts are one
module, so it should finish). Exit code 0 whatever the figures.
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

MODEL = {
    "model_type": "qwen3_moe",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}

VARIANTS = {
    "zero3 leaves grouped_mm (baseline)": {"zero_stage": 3, "leaves": True, "experts": "grouped_mm"},
    "zero3 no leaves grouped_mm": {"zero_stage": 3, "leaves": False, "experts": "grouped_mm"},
    "zero2 grouped_mm": {"zero_stage": 2, "leaves": True, "experts": "grouped_mm"},
    "zero3 leaves eager (per-expert loop)": {"zero_stage": 3, "leaves": True, "experts": "eager"},
    "zero2 eager (per-expert loop)": {"zero_stage": 2, "leaves": True, "experts": "eager"},
}


def run_variant(workdir: Path, name: str, variant: dict, steps: int, timeout: float) -> dict:
    slug = name.split(" (")[0].replace(" ", "-")
    config = {
        "run": {"name": slug, "output_dir": str(workdir / "runs"), "seed": 7},
        "model": {
            "config": dict(MODEL),
            "tokenizer_vocab_size": 300,
            "experts_implementation": variant["experts"],
            "zero3_leaf_blocks": variant["leaves"],
        },
        "data": {"synthetic": {"task": "arithmetic", "examples": 2000}, "max_seq_len": 64},
        "train": {"max_steps": steps, "micro_batch_size": 8, "lr": 1e-3, "warmup_steps": 1, "log_every": steps},
        "deepspeed": {"zero_stage": variant["zero_stage"], "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": []},
    }
    path = workdir / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {key: value for key, value in os.environ.items() if key != "DS_ACCELERATOR"}
    started = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, "-m", "zeropipe", "train", str(path)], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "outcome": f"did not finish in {timeout:.0f} s"}
    wall = time.perf_counter() - started
    if result.returncode != 0:
        return {"name": name, "outcome": f"failed (exit {result.returncode}): {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}"}
    rows = [json.loads(line) for line in (workdir / "runs" / slug / "metrics.jsonl").read_text().splitlines()]
    times = [row["step_time_s"] for row in rows if row.get("kind") is None][2:]
    return {"name": name, "outcome": "ok", "median_step_s": statistics.median(times), "final_loss": rows[-1]["loss"], "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--only", nargs="*", help="variant names (substrings) to run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="moe-speed-") as tmp:
        results = []
        for name, variant in VARIANTS.items():
            if args.only and not any(part in name for part in args.only):
                continue
            results.append(run_variant(Path(tmp), name, variant, args.steps, args.timeout))
            print(json.dumps(results[-1]), flush=True)
    base = next((r for r in results if "baseline" in r["name"] and r["outcome"] == "ok"), None)
    print(f"\n{'variant':<40} {'median step':>12} {'vs baseline':>12} {'final loss':>11}")
    for r in results:
        if r["outcome"] != "ok":
            print(f"{r['name']:<40} {r['outcome']}")
            continue
        ratio = f"{r['median_step_s'] / base['median_step_s']:.2f}x" if base else "-"
        print(f"{r['name']:<40} {r['median_step_s']:>10.3f} s {ratio:>12} {r['final_loss']:>11.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
