"""A new kind of condition through the registry alone: a plug-in entry (tests/integration/plugins/toy_condition.py) trains on 2 ranks, samples and exports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from tests.integration.conftest import assert_ok, metrics, zeropipe_process as zeropipe  # plug-ins: each command in a new process, as the user runs it
from zeropipe.data.images import generate_shapes_dataset

pytestmark = pytest.mark.integration

PLUGINS = Path(__file__).parent / "plugins"


def test_a_plugin_condition_kind_trains_under_zero_samples_and_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROPIPE_PLUGINS", "toy_condition")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(PLUGINS), os.environ.get("PYTHONPATH")])))
    data = generate_shapes_dataset(tmp_path / "data", 8, seed=4, resolution=32)
    for number in range(8):
        (data / "1_shapes" / f"{number:05d}.loudness").write_text(f"{number / 8}\n")
    config = {
        "run": {"name": "loud", "output_dir": str(tmp_path / "runs"), "seed": 3},
        "model": {"config": {"pipeline": "tiny-toy-loud-unet"}, "lora": {"r": 4, "alpha": 8}},
        "data": {"path": str(data), "images": {"resolution": 32, "bucket_step": 16, "bucketing": False}, "cache": {"dir": str(tmp_path / "cache")}},
        "train": {"max_steps": 3, "micro_batch_size": 2, "lr": 1e-3, "warmup_steps": 0, "log_every": 1},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "hardware": {"gpus": 2},
        "generate": {"prompts": ["a red circle on a blue background"], "sample_steps": 2},
    }
    path = tmp_path / "loud.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    result = zeropipe("train", path, cwd=tmp_path)
    assert_ok(result)
    run_dir = tmp_path / "runs" / "loud"
    plan = json.loads((run_dir / "data" / "diffusion.json").read_text())
    assert plan["architecture"] == "toy-loud-unet"
    assert [row["step"] for row in metrics(run_dir)] == [1, 2, 3]
    # The node's setup process encoded the loudness into every item's latent cache entry, which the ranks read.
    entry = load_file(str(Path(plan["cache_dir"]) / "latents" / plan["latent_keys"][0][0][:2] / f"{plan['latent_keys'][0][0]}.safetensors"))
    assert entry["loudness"].shape == (32,)
    samples = [json.loads(line) for line in (run_dir / "samples" / "index.jsonl").read_text().splitlines()]
    assert samples and samples[-1]["loudness"] == 0.0 and (run_dir / "samples" / samples[-1]["file"]).is_file()

    assert_ok(zeropipe("export", run_dir, "--out", tmp_path / "export", cwd=tmp_path))
    assert any(name.endswith(".safetensors") for name in os.listdir(tmp_path / "export"))
