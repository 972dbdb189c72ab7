"""Host RAM while a video run fills its caches, with 1, 2 and 4 ranks: does the peak grow with the ranks?

    .venv/bin/python benchmarks/caching_ram.py                 # 1, 2 and 4 ranks, a 340M-parameter UMT5 (~5 min on 2 cores)
    .venv/bin/python benchmarks/caching_ram.py --ranks 1 2     # fewer runs

diffusion-pipe loads the text encoder and the VAE in every GPU's process while it caches, so
its caching peak grows with the GPUs (its maintainer measured 62 GB for Wan 1.3B on 4 GPUs;
UMT5-XXL alone is about 11 GB in bf16). ZeRO-Pipe fills the caches in one process per node
(``zeropipe.launch.node_setup`` running ``families.diffusion.prepare.fill_caches``), which ends before the
node's ranks start: the node holds one VAE and one text encoder whatever its number of GPUs,
and no rank's own baseline (Python, torch, DeepSpeed) is resident meanwhile.

Each run is ``zeropipe train`` on the tiny Wan pipeline (``tiny-wan``) with its UMT5 text
encoder enlarged to about 340M parameters (1.3 GiB in fp32, the dtype this CPU without
native bf16 loads it in), so that the encoder is a visible share of the node's memory, 16
generated clips, an empty cache folder (everything is encoded), 2 training steps, CPU ranks.
This script samples the PSS (``/proc/PID/smaps_rollup``: pages several processes share,
such as the libraries they all map, count once across them) of every process the launcher
started (the caching process, the ranks) every SAMPLE_SECONDS and sums it, as the earlier
version of this benchmark summed the ranks; the caching figure is the peak of that sum from
the launcher's start to the caching process's "caches filled" line. The launcher's own PSS
(the same whatever the ranks: it reads the data and writes the plan) is printed beside it. The ratio 4-rank / 1-rank is the headline (target <= 1.25). The peak of
the whole run (the ranks loading the transformer and training) is printed beside it: that
part grows with the ranks by design (one process per GPU), and is not caching. Exit code 0
whether or not the target is met.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diffusion_cache import smaps_rollup  # the PSS reader the diffusion cache benchmark uses

ROOT = Path(__file__).resolve().parents[1]
TEXT_ENCODER = {"d_model": 1024, "d_kv": 64, "d_ff": 2816, "num_layers": 24, "num_heads": 16, "vocab_size": 32128}


def run_config(folder: Path, ranks: int) -> Path:
    config = {
        "run": {"name": f"caching-{ranks}", "output_dir": str(folder / "runs"), "seed": 1, "accept_warnings": ["ZP012"]},
        "model": {"config": {"pipeline": "tiny-wan", "text_encoder": TEXT_ENCODER, "transformer": {"text_dim": TEXT_ENCODER["d_model"]}}},
        "data": {
            "synthetic": {"task": "shapes", "examples": 16}, "images": {"resolution": 32, "bucket_step": 16},
            "video": {"frame_buckets": [1, 9]}, "cache": {"dir": str(folder / f"cache-{ranks}")},
        },
        "train": {"max_steps": 2, "micro_batch_size": 1, "lr": 1e-4, "warmup_steps": 1, "log_every": 1},
        "deepspeed": {"zero_stage": 3, "precision": "fp32"},
        "hardware": {"gpus": ranks},
        "generate": {"prompts": []},
    }
    path = folder / f"caching-{ranks}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


SAMPLE_SECONDS = 0.2


class NodeMemory:
    """Samples the summed PSS of a launcher's processes (caching process, ranks) and the launcher's own, in a thread."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid
        self.samples: list[tuple[float, int, int, int]] = []  # (time, summed PSS of its processes, launcher's PSS, number of ranks)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stopped.set()
        self.thread.join()

    def loop(self) -> None:
        import psutil

        while not self.stopped.is_set():
            try:
                launcher = psutil.Process(self.launcher_pid)
                processes = launcher.children(recursive=True)
                ranks = sum(1 for p in processes if "zeropipe.launch.rank" in " ".join(p.cmdline()))
            except psutil.Error:
                processes, ranks = [], 0
            total = sum((smaps_rollup(p.pid) or {}).get("Pss", 0) for p in processes)
            if total:
                self.samples.append((time.time(), total, (smaps_rollup(self.launcher_pid) or {}).get("Pss", 0), ranks))
            self.stopped.wait(SAMPLE_SECONDS)


def caches_filled_at(log: Path) -> float | None:
    """Time of the caching process's "caches filled" line (its log's own timestamps, local time)."""
    for line in log.read_text().splitlines():
        if "caches filled" in line:
            stamp = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d+)", line)
            if stamp:
                when = dt.datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S").timestamp()
                return when + int(stamp[2]) / 1000
    return None


def measure(folder: Path, ranks: int) -> dict:
    config = run_config(folder, ranks)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("DS_ACCELERATOR", None)
    started = time.time()
    process = subprocess.Popen([sys.executable, "-m", "zeropipe", "train", str(config)], cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with NodeMemory(process.pid) as memory:
        output, _ = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"{ranks}-rank run failed:\n{output[-3000:]}")
    logs = folder / "runs" / f"caching-{ranks}" / "logs"
    filled = caches_filled_at(logs / "node_setup.log") if (logs / "node_setup.log").is_file() else None
    if filled is None:
        raise SystemExit(f"{ranks}-rank run logged no 'caches filled' line: nothing was encoded?\n{output[-2000:]}")
    caching = [sample for sample in memory.samples if sample[0] <= filled]
    return {
        "ranks": ranks,
        "caching_pss_peak": max((pss for _, pss, _, _ in caching), default=0),
        "launcher_pss": max((launcher for _, _, launcher, _ in caching), default=0),
        "ranks_during_caching": max((count for _, _, _, count in caching), default=0),
        "run_pss_peak": max((pss for _, pss, _, _ in memory.samples), default=0),
        "samples": len(caching),
        "seconds": round(time.time() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = (args.workdir or Path(tmp)).resolve()
        folder.mkdir(parents=True, exist_ok=True)
        results = [measure(folder, ranks) for ranks in args.ranks]
    encoder_bytes = 4 * (TEXT_ENCODER["vocab_size"] * TEXT_ENCODER["d_model"] + TEXT_ENCODER["num_layers"] * (
        4 * TEXT_ENCODER["d_model"] * TEXT_ENCODER["num_heads"] * TEXT_ENCODER["d_kv"] + 3 * TEXT_ENCODER["d_model"] * TEXT_ENCODER["d_ff"]))
    mib = 1024**2
    print(f"text encoder: UMT5, {encoder_bytes / 4 / 1e6:.0f}M parameters, {encoder_bytes / mib:,.0f} MiB in fp32 (the dtype a CPU without native bf16 loads it in)")
    print("summed PSS of the processes the launcher started (the caching process, the ranks); the launcher's own beside it:")
    print(f"{'ranks':>5}  {'caching peak':>13}  {'ranks alive while caching':>25}  {'whole run peak':>15}  {'launcher':>9}  {'samples':>7}  {'run s':>6}")
    for r in results:
        print(
            f"{r['ranks']:>5}  {r['caching_pss_peak'] / mib:>9,.0f} MiB  {r['ranks_during_caching']:>25}  {r['run_pss_peak'] / mib:>11,.0f} MiB  "
            f"{r['launcher_pss'] / mib:>5,.0f} MiB  {r['samples']:>7}  {r['seconds']:>6}"
        )
    by_ranks = {r["ranks"]: r for r in results}
    if 1 in by_ranks:
        one = by_ranks[1]["caching_pss_peak"]
        for r in results:
            if r["ranks"] > 1:
                print(f"ratio {r['ranks']}-rank / 1-rank caching peak: {r['caching_pss_peak'] / one:.2f}x (target <= 1.25 for 4 ranks)")
        # What a design with one encoder per rank (diffusion-pipe's) would add: one more encoder per extra rank.
        for r in results:
            if r["ranks"] > 1:
                estimate = (r["caching_pss_peak"] + (r["ranks"] - 1) * encoder_bytes) / one
                print(f"  with one text encoder per rank it would be at least {estimate:.2f}x (+{r['ranks'] - 1} x {encoder_bytes / mib:,.0f} MiB, not counting their baselines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
