"""The node's setup process (a diffusion run fills its caches there): run before any rank, diagnosed like one."""

from __future__ import annotations

from pathlib import Path

from zeropipe.launch.node_setup import encoder_precision_for
from zeropipe.launch.supervisor import Supervisor
from zeropipe.rundir import RunDir, RunPlan

ROOT = Path(__file__).resolve().parents[3]


def run_with_setup(tmp_path, node_setup: str, native_precision: str = "fp32") -> RunDir:
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.logs.mkdir()
    run.errors.mkdir()
    run.claim()
    run.write_plan(RunPlan(world_size=2, accelerator="cpu", total_steps=1, steps_per_epoch=1, micro_batches_per_epoch=1, examples=2,
                           micro_batch_size=1, gradient_accumulation_steps=1, zero_stage=3, node_setup=node_setup,
                           native_precision=native_precision, native_precision_why="as the launcher decided"))
    return run


def test_a_failing_node_setup_is_named_with_its_message_and_no_rank_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # `python -m` finds tests.unit.launch from here
    run = run_with_setup(tmp_path, "tests.unit.launch.node_setups:unreadable_vae")
    supervisor = Supervisor(run, 2, "cpu")
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.state == "failed"
    # It ran on the CPU with the encoders in fp32 (the launcher decided this CPU has no native bf16) and failed before any rank existed.
    assert (run.path / "setup-ran").read_text() == "cpu torch.float32"
    text = outcome.diagnosis.render()
    assert text.startswith("the node's setup process (caching) exited with code 1"), text
    assert "vae/diffusion_pytorch_model.safetensors is truncated: download it again" in text
    assert not run.rank_log(0).exists() and not run.rank_log(1).exists()
    status = run.read_json(run.status_file)
    assert status["state"] == "failed" and status["node_setup_rss_peak_bytes"] >= 0


def test_the_node_setup_loads_encoders_in_what_the_launcher_decided_not_what_it_asks_the_cpu(tmp_path, monkeypatch):
    # run.json says the device runs bf16 natively; the CPU described to this process says it does not: run.json wins.
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("ZEROPIPE_CPU_FLAGS", "avx2")
    run = run_with_setup(tmp_path, "tests.unit.launch.node_setups:unreadable_vae", native_precision="bf16")
    supervisor = Supervisor(run, 2, "cpu")
    supervisor.start()
    assert supervisor.wait().state == "failed"
    assert (run.path / "setup-ran").read_text() == "cpu torch.bfloat16"
    assert "text encoders in bf16: as the launcher decided" in run.path.joinpath("logs", "node_setup.log").read_text()


def test_a_node_setup_killed_by_sigkill_is_diagnosed_and_no_rank_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run = run_with_setup(tmp_path, "tests.unit.launch.node_setups:killed")
    supervisor = Supervisor(run, 2, "cpu")
    supervisor.start()
    outcome = supervisor.wait()
    assert outcome.state == "failed" and outcome.diagnosis.render().startswith("the node's setup process (caching) was killed by SIGKILL")
    assert not run.rank_log(0).exists()


def test_text_encoders_load_in_bf16_only_where_the_device_runs_it():
    assert encoder_precision_for("cpu", "fp32", "this CPU has no bf16 in hardware") == ("fp32", "this CPU has no bf16 in hardware")
    assert encoder_precision_for("cpu", "bf16", "this CPU runs bf16 natively") == ("bf16", "this CPU runs bf16 natively")
    assert encoder_precision_for("cuda", "bf16", "the GPUs support bf16")[0] == "bf16"
    # A GPU without bf16 (pre-Ampere): fp32, never fp16, which T5 encoders overflow in.
    precision, why = encoder_precision_for("cuda", "fp16", "Tesla V100 has no bf16")
    assert precision == "fp32" and "overflow in fp16" in why
