"""Run directories written the way the launcher and rank 0 write them, without training.

The store, the API and the pages read only files; these let their tests show a completed,
failed, running or diffusion run in milliseconds, and a 100,000-step run without waiting
for one.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
import zlib
from pathlib import Path

import yaml

TINY_CONFIG = {
    "run": {"name": "tiny", "output_dir": "runs", "seed": 7},
    "model": {"config": {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}},
    "data": {"synthetic": {"task": "arithmetic", "examples": 400}, "max_seq_len": 32},
    "train": {"max_steps": 12, "micro_batch_size": 8, "lr": 0.01, "warmup_steps": 2, "save_every": 6},
    "deepspeed": {"zero_stage": 2, "precision": "bf16"},
    "hardware": {"gpus": 2},
}

DIAGNOSIS_TEXT = """rank 0 was killed by SIGKILL
likely cause: the kernel's OOM killer is the usual cause; host RAM peaked at 63.8 of 64.0 GiB - the node ran out of memory
fix: use deepspeed.zero_stage: 3 (partitioned loading), fewer ranks per node, or less CPU offload; `dmesg | grep -i oom` confirms an OOM kill
the other ranks were then stopped (rank 1 exited 1) - effects, not causes"""


def metric_row(step: int, total: int, world_size: int = 2, gpu: bool = False, start: float | None = None) -> dict:
    loss = 6.0 * math.exp(-3 * step / max(total, 1)) + 0.4 + 0.05 * math.sin(step)
    row = {
        "step": step,
        "epoch": 0,
        "loss": loss,
        "lr": 0.01 * min(1.0, step / 2),
        "grad_norm": 1.0 / (1 + step / 10),
        "tokens_per_s": 1500.0 + 10 * math.sin(step / 5),
        "samples_per_s": 60.0,
        "step_time_s": 0.25,
        "host_rss_bytes": [int(1.2e9 + 1e6 * step + r * 5e7) for r in range(world_size)],
        "time": (start or time.time() - total) + step,
    }
    if gpu:
        row["gpu_max_allocated_bytes"] = [int(8e9 + r * 1e8) for r in range(world_size)]
    return row


def write_metrics(path: Path, steps: int, total: int | None = None, world_size: int = 2, gpu: bool = False) -> None:
    total = total or steps
    with open(path, "w") as handle:
        for step in range(1, steps + 1):
            handle.write(json.dumps(metric_row(step, total, world_size, gpu)) + "\n")


def write_run(
    root: Path,
    name: str,
    state: str = "completed",
    steps: int = 12,
    total_steps: int | None = None,
    world_size: int = 2,
    checkpoints: tuple[int, ...] = (6, 12),
    diagnosis: str | None = None,
    supervisor_pid: int | None = None,
    gpu: bool = False,
) -> Path:
    """A run directory as `zeropipe train` leaves it in ``state``."""
    total_steps = total_steps or steps
    run = Path(root) / name
    (run / "logs").mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(TINY_CONFIG))
    config["run"].update(name=name, output_dir=str(root))
    config["train"]["max_steps"] = total_steps
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    now = time.time()
    plan = {
        "world_size": world_size, "accelerator": "cuda" if gpu else "cpu", "total_steps": total_steps, "steps_per_epoch": total_steps,
        "micro_batches_per_epoch": total_steps, "examples": 400, "micro_batch_size": 8, "gradient_accumulation_steps": 1,
        "zero_stage": 2, "resume_from": None, "generate_prompts": [], "created_at": now - steps - 5,
    }  # fmt: skip
    (run / "run.json").write_text(json.dumps(plan))
    write_metrics(run / "metrics.jsonl", steps, total_steps, world_size, gpu)
    # A running run's launcher started just now (its pid must not look reused).
    started = now if state == "running" else now - steps - 2
    status = {"state": state, "pids": [999991, 999992], "supervisor_pid": supervisor_pid or 999990, "started_at": started, "diagnosis": None}
    if state != "running":
        status["ended_at"] = now - 1
    if state == "failed":
        text = diagnosis or DIAGNOSIS_TEXT
        status["diagnosis"] = {"rank": 0, "how": "was killed by SIGKILL", "cause": text.splitlines()[1], "fix": "", "text": text, "log_tail": [], "other_ranks": []}
    (run / "status.json").write_text(json.dumps(status))
    for rank in range(world_size):
        lines = [f"==== zeropipe rank {rank}/{world_size} started ===="] + [f"step {s}/{total_steps} loss {metric_row(s, total_steps)['loss']:.4f}" for s in range(1, steps + 1) if rank == 0]
        (run / "logs" / f"rank{rank}.log").write_text("\n".join(lines) + "\n")
    for step in checkpoints:
        if step <= steps:
            tag = run / "checkpoints" / f"step_{step:08d}"
            tag.mkdir(parents=True, exist_ok=True)
            (tag / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 1024)
            (tag / "zeropipe_complete.json").write_text(json.dumps({"step": step, "saved_at": now, "world_size": world_size, "zero_stage": 2}))
            (run / "checkpoints" / "latest").write_text(tag.name)
    if state == "completed":
        (run / "summary.json").write_text(json.dumps({"steps": steps, "first_loss": metric_row(1, total_steps)["loss"], "final_loss": metric_row(steps, total_steps)["loss"]}))
        (run / "generations.jsonl").write_text(json.dumps({"prompt": "What is 1 + 2?", "output": "3", "step": steps}) + "\n")
    return run


def png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    """A solid-colour PNG, written by hand so the tests need no imaging library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    raw = b"".join(b"\0" + bytes(rgb) * width for _ in range(height))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]
COLOURS = [(200, 60, 40), (40, 90, 200), (230, 170, 30), (60, 160, 90)]


def write_samples(run: Path, steps: tuple[int, ...] = (50, 100), prompts: list[str] = PROMPTS) -> list[dict]:
    """samples/step_NNNNNNNN/*.png and samples/index.jsonl, the convention diffusion runs follow."""
    rows = []
    for si, step in enumerate(steps):
        folder = run / "samples" / f"step_{step:08d}"
        folder.mkdir(parents=True, exist_ok=True)
        for pi, prompt in enumerate(prompts):
            file = folder / f"{pi}.png"
            file.write_bytes(png(64, 64, COLOURS[(si * len(prompts) + pi) % len(COLOURS)]))
            rows.append({"step": step, "prompt": prompt, "file": f"step_{step:08d}/{pi}.png"})
    (run / "samples" / "index.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def as_diffusion_metrics(run: Path) -> Path:
    """Rewrite a run's metrics as a diffusion run writes them: images/s, no tokens, no frozen encoders loaded."""
    path = run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for row in rows:
        row.pop("tokens_per_s", None)
        row["frozen_components_loaded"] = []
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return run


def live_pid() -> int:
    """A pid that is alive for the test's duration (this process), for a 'running' status."""
    return os.getpid()
