"""scripts/gpu-check.sh: what only a GPU shows, run on the GPUs when there are some, and its CPU-runnable parts here.

On a machine with CUDA the whole check runs (a few minutes) and must pass. Everywhere, the
steps that also run on CPU ranks run through the same driver: ``zeropipe calibrate`` and a
planned per-rank peak set against the peak the ranks measured, rendered in the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


@pytest.mark.skipif(not has_cuda(), reason="no CUDA device on this machine: the GPU steps of gpu-check need one (run scripts/gpu-check.sh there)")
def test_gpu_check_passes_on_this_gpu_machine(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True, timeout=3600)
    report = json.loads((tmp_path / "report.json").read_text())
    assert done.returncode == 0, (tmp_path / "report.md").read_text()
    assert report["quickstart"]["final_loss"] < 0.5 * report["quickstart"]["first_loss"]
    assert all(0.5 < row["planned_over_measured"] < 2.0 for row in report["plan_vs_measured"]["rows"])


def test_gpu_check_cpu_steps_measure_and_compare_the_plan(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--only", "environment,calibrate,plan_vs_measured,quickstart", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["quickstart"] == {"skipped": "needs CUDA"}
    calibration = report["calibrate"]["calibration"]
    assert calibration["accelerator"] == "cpu" and calibration["all_gather_bytes_per_second"] > 0
    (row,) = report["plan_vs_measured"]["rows"]
    assert row["config"] == "zero3-lora" and row["planned_bytes"] > 0 and row["measured_bytes"] > 0 and row["planned_over_measured"] > 0
    text = (tmp_path / "report.md").read_text()
    assert "| zero3-lora |" in text and "GiB" in text and "RSS" in text


def test_gpu_check_names_an_unknown_step(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--only", "quickstrat", "--out", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 2 and "unknown steps ['quickstrat']" in done.stderr


def test_every_config_a_gpu_step_trains_is_one_zeropipe_accepts(tmp_path, monkeypatch):
    """The GPU steps run only where CUDA is, so their configs are checked here: each one the schema
    accepts, and each model folder it names loads its tokenizer (a first H200 run found both broken)."""
    from transformers import AutoTokenizer

    from zeropipe.config.load import load_config

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    monkeypatch.setattr(gpu_check, "MEDIUM_LLAMA", gpu_check.TINY_LLAMA)  # the same configs at a size that builds in a second
    trained: dict[str, Path] = {}

    class DryRun(gpu_check.Check):
        def train(self, name, raw, extra=()):
            trained[name] = self.write_config(name, raw)
            return {"returncode": 1, "log_tail": "dry run"}  # stops each step after its first config

    check = DryRun(tmp_path, cpu=False)
    for step in ["quickstart", "zero3_offload", "qlora", "fp8_base", "plan_vs_measured", "hf_trainer", "llama8b_lora_zero3", "video_dit_blocks"]:
        getattr(check, f"step_{step}")()
    assert {"quickstart", "zero3-offload", "qlora", "fp8-base", "plan-zero2-full", "plan-zero3-full-ckpt", "plan-zero3-lora", "hf-compare"} <= set(trained)
    assert {"llama8b-lora-zero3", "video-dit-blocks"} <= set(trained)
    for name, path in trained.items():
        config = load_config(path)
        if config.model.path:
            assert len(AutoTokenizer.from_pretrained(config.model.path)) > 256, name


def test_the_real_size_steps_plan_what_they_train(monkeypatch):
    """The 8B-shaped LoRA and the 14B DiT blocks: their configs load, name the real shapes, and plan (on the meta device, as the GPU step does)."""
    from zeropipe.config.load import validate_config
    from zeropipe.families import model_spec

    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import gpu_check

    llama = validate_config(gpu_check.llama8b_config(1))
    assert llama.data.packing and llama.data.max_seq_len == 2048 and llama.deepspeed.zero_stage == 3 and llama.model.lora is not None
    spec = model_spec(llama)
    assert spec.layers == 32 and spec.hidden_size == 4096 and spec.total_params > 8.0e9
    # 4·N (LoRA: no weight gradients for the frozen base) plus attention: about 33 GFLOP per token at 2048.
    assert 3.0e10 < gpu_check.llm_flops_per_token(gpu_check.LLAMA_8B, 2048, lora=True) < 3.6e10
    video = validate_config(gpu_check.video_dit_config(1))
    assert video.model.config["transformer"]["num_attention_heads"] * video.model.config["transformer"]["attention_head_dim"] == 5120
    row = gpu_check.held_against_plan(10 * 2**30, {"gpu_max_reserved_bytes_peak": 8 * 2**30, "gpu_max_allocated_bytes_peak": 7 * 2**30}, 2**29)
    assert row["held_bytes"] == 8.5 * 2**30 and row["planned_over_held"] == round(10 / 8.5, 3)
    assert gpu_check.throughput({"tokens_per_s_median": 1000.0}, 3e10, 6e14, 1)["mfu"] == 0.05
    assert gpu_check.throughput({"samples_per_s_median": 2.0}, None, 6e14, 1, flops_per_sample=3e13)["mfu"] == 0.1
