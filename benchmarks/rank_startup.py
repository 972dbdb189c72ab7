"""Rank start-up: from a rank's process start to its first training step, in real 2-rank `zeropipe train` runs.

    .venv/bin/python benchmarks/rank_startup.py --src src                        # this checkout
    .venv/bin/python benchmarks/rank_startup.py --src /tmp/base/src --src src    # before/after, back to back

Two tiny runs as the integration lane writes them: the causal LM of tests/integration/conftest.py's
``tiny_run_config`` (ZeRO-2, 8 steps) and tests/integration/test_image_models.py's FLUX.2 LoRA
(ZeRO-3 with the optimizer offloaded to host RAM, 10 steps, 2 samples). Each ``--src`` is put first on
PYTHONPATH (the ranks inherit it) and runs are interleaved (A B A B ...) so that drift on a shared machine
falls on both. A ``sitecustomize`` module put on the path stamps each rank process's start in its log;
the figures are rank 0's: process start -> first log line (imports, process group, data, model),
process start -> "training steps" (adds DeepSpeed initialize and a resume), the CPU seconds the rank and
the children it waited for (py-cpuinfo's, ninja) spent until then (steadier than wall time on a shared
machine), and the training itself.
TORCH_EXTENSIONS_DIR is left as set: point it at a private folder where other checkouts rebuild the ops.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAMP = """
import os, sys, time
if os.environ.get("RANK") is not None and "zeropipe.launch.rank" in " ".join(sys.orig_argv):
    print(f"rank process started {time.time():.3f}", file=sys.stderr, flush=True)
    import logging

    make_record = logging.getLogRecordFactory()

    def record(*args, **kwargs):
        made = make_record(*args, **kwargs)
        if "training steps" in str(made.msg):
            cpu = os.times()
            spent = cpu.user + cpu.system + cpu.children_user + cpu.children_system
            print(f"rank cpu seconds at training steps {spent:.2f}", file=sys.stderr, flush=True)
        return made

    logging.setLogRecordFactory(record)
"""
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", re.M)


def config(kind: str, folder: Path) -> dict:
    if kind == "llm":
        from tests.integration.conftest import tiny_run_config

        return tiny_run_config(folder, "llm", train={"max_steps": 8})
    return {
        "run": {"name": "img", "output_dir": str(folder / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-flux2"}, "lora": {"r": 8, "alpha": 16}},
        "data": {
            "synthetic": {"task": "shapes", "examples": 24}, "images": {"resolution": 32, "bucket_step": 16}, "cache": {"dir": str(folder / "cache")},
        },
        "train": {"max_steps": 10, "micro_batch_size": 4, "lr": 2e-2, "warmup_steps": 1, "log_every": 2},
        "deepspeed": {"zero_stage": 3, "offload_optimizer": "cpu", "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": ["a red circle on a blue background"], "sample_steps": 3, "sample_every": 5},
    }


def log_time(text: str) -> float:
    return datetime.datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.timezone.utc).timestamp()


def one_run(kind: str, src: Path, stamp_dir: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "run.yaml").write_text(yaml.safe_dump(config(kind, folder), sort_keys=False))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(stamp_dir), str(src)]))
        env.pop("DS_ACCELERATOR", None)
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "zeropipe", "train", "run.yaml"], cwd=folder, env=env, capture_output=True, text=True)
        command = time.perf_counter() - began
        log = (folder / "runs" / kind / "logs" / "rank0.log").read_text()
        if done.returncode != 0:
            raise SystemExit(f"{kind} with {src} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}\n{log[-3000:]}")
        started = float(re.search(r"rank process started ([\d.]+)", log).group(1))
        first = log_time(LOG_TIME.search(log).group(1))
        steps = log_time(re.search(r"^(\d{4}-\S+ \S+) .*training steps", log, re.M).group(1))
        saved = log_time(re.findall(r"^(\d{4}-\S+ \S+) .*checkpoint \S+ saved\s*$", log, re.M)[-1])
        cpu = float(re.search(r"rank cpu seconds at training steps ([\d.]+)", log).group(1))
        return {"command": command, "first_log": first - started, "to_training": steps - started, "cpu_to_training": cpu, "training": saved - steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", action="append", type=Path, required=True, help="a src/ folder to measure (repeat for before/after)")
    parser.add_argument("--kinds", default="llm,img")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as stamp:
        (Path(stamp) / "sitecustomize.py").write_text(STAMP)
        results: dict[tuple[str, Path], list[dict]] = {}
        for repeat in range(args.repeats):
            for kind in args.kinds.split(","):
                for src in args.src:
                    load = os.getloadavg()[0]
                    figures = one_run(kind, src.resolve(), Path(stamp))
                    results.setdefault((kind, src), []).append(figures)
                    shown = "  ".join(f"{k} {v:5.1f} s" for k, v in figures.items())
                    print(f"repeat {repeat + 1} {kind:3} {str(src):28} load {load:4.1f}  {shown}", flush=True)
        print("\nmedians (rank 0):")
        for (kind, src), runs in results.items():
            print(f"{kind:3} {str(src):28} " + "  ".join(f"{k} {statistics.median(r[k] for r in runs):5.1f} s" for k in runs[0]))


if __name__ == "__main__":
    main()
