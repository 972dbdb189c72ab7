"""A fourth model family through the registry alone: one module, loaded as a plug-in by the launcher and both ranks."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import assert_ok, metrics, write_config, zeropipe_process as zeropipe  # plug-ins: each command in a new process, as the user runs it

pytestmark = pytest.mark.integration

PLUGINS = Path(__file__).parent / "plugins"


def toy_config(tmp_path, monkeypatch) -> dict:
    monkeypatch.setenv("ZEROPIPE_PLUGINS", "toy_family")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])))
    (tmp_path / "unused.jsonl").write_text('{"text": "the toy generates its own points"}\n')
    return {
        "run": {"name": "toy", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"model_type": "toy_regression"}},
        "data": {"path": str(tmp_path / "unused.jsonl")},
        "train": {"max_steps": 40, "micro_batch_size": 16, "lr": 2e-2, "warmup_steps": 0, "log_every": 10},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "hardware": {"gpus": 2},
    }


def test_a_plugin_family_trains_checks_and_exports(tmp_path, monkeypatch):
    # 0.05 s of work between steps (the toy's own step takes milliseconds): the step time must count it.
    monkeypatch.setenv("TOY_METRICS_DELAY_S", "0.05")
    path = write_config(tmp_path, toy_config(tmp_path, monkeypatch))
    too_big = zeropipe("check", path, "train.micro_batch_size=128")
    assert too_big.returncode != 0 and "the toy deals 512 points" in too_big.stdout + too_big.stderr

    result = zeropipe("train", path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "toy"
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["loss"] < rows[0]["loss"] / 4, [r["loss"] for r in rows]
    assert "toy: 512 generated points" in result.stderr
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["world_size"] == 2
    # samples/s (tokens/s) is what the run achieves: a step's time includes the metrics gathering
    # and logging after the step before it, as a peer's wall clock would.
    assert all(row["step_time_s"] >= 0.05 for row in rows[1:]), [row["step_time_s"] for row in rows]
    assert all(row["samples_per_s"] <= 32 / 0.05 for row in rows[1:]), [row["samples_per_s"] for row in rows]

    assert_ok(zeropipe("export", run_dir, "--out", tmp_path / "export"))
    state = torch.load(tmp_path / "export" / "toy.pt")
    model = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model.load_state_dict(state)
    x = torch.linspace(-1, 1, 9).unsqueeze(1)
    assert torch.nn.functional.mse_loss(model(x), 3 * x - 1) < 0.1

    # The toy deals its points per rank and reports no data position for the whole run: a
    # resume on another rank count would repeat or skip points, so it is refused up front.
    other = zeropipe("train", path, "--resume", "hardware.gpus=1")
    assert other.returncode == 2, other.stderr
    assert "toy_regression runs resume only on the rank count that saved them" in other.stderr and "hardware.gpus=2" in other.stderr
    assert "Traceback" not in other.stderr and not (run_dir / "checkpoints" / "universal").exists()

    # run.json names the plug-in the run was prepared with: export and a resume import it from there,
    # with neither ZEROPIPE_PLUGINS nor the plug-in's folder on PYTHONPATH.
    assert json.loads((run_dir / "run.json").read_text())["plugins"] == [{"module": "toy_family", "path": str(PLUGINS.resolve())}]
    monkeypatch.delenv("ZEROPIPE_PLUGINS")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in os.environ["PYTHONPATH"].split(os.pathsep) if p and Path(p).resolve() != PLUGINS.resolve()))
    assert_ok(zeropipe("export", run_dir, "--out", tmp_path / "export-again"))
    assert torch.equal(torch.load(tmp_path / "export-again" / "toy.pt")["0.weight"], state["0.weight"])
    resumed = zeropipe("train", path, "--resume", "--new-schedule", "train.max_steps=42")
    assert_ok(resumed)
    assert [r["step"] for r in metrics(run_dir)][-2:] == [41, 42]
    assert json.loads((run_dir / "run.json").read_text())["plugins"] == [{"module": "toy_family", "path": str(PLUGINS.resolve())}]
