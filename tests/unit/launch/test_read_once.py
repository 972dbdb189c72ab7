"""What a command reads, it reads once: the user's DeepSpeed JSON and a diffusion pipeline's model_index.json.

A spy counts every read of the user's JSON file (``Path.read_text`` of that path, whoever calls it) and
every parse of a ``model_index.json`` by its one reader (``config.pipeline_index``). The resolved run
(``ResolvedRun``) carries what was read to the checks, the planner and the DeepSpeed JSON written for
the ranks; a reader that went back to the file would count twice. ``train`` is followed up to the
moment its supervisor would start the ranks (each rank is its own process, reading only the run's files).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


class RanksWouldStart(Exception):
    """Raised where ``train`` would start the ranks: the launcher's side of the command is done."""


@pytest.fixture
def file_reads(monkeypatch):
    """{file name: times its text was read} for every Path.read_text in this test."""
    reads: dict[str, int] = {}
    real = Path.read_text

    def counting(self, *args, **kwargs):
        reads[self.name] = reads.get(self.name, 0) + 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    return reads


@pytest.fixture
def no_ranks(monkeypatch):
    from zeropipe.launch import supervisor

    def start(self):
        raise RanksWouldStart

    monkeypatch.setattr(supervisor.Supervisor, "start", start)


def llm_config(tmp_path: Path) -> Path:
    ds_json = tmp_path / "user_ds.json"
    ds_json.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 2}}))
    raw = {
        "run": {"name": "once", "output_dir": str(tmp_path / "runs")},
        "model": {"config": TINY},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4},
        "deepspeed": {"config_file": str(ds_json), "precision": "fp32"},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("command", ["train", "check", "plan"])
def test_the_users_deepspeed_json_is_read_once_per_command(tmp_path, file_reads, no_ranks, command, capsys):
    from zeropipe.cli.main import main

    path = llm_config(tmp_path)
    if command == "train":
        with pytest.raises(RanksWouldStart):
            main(["train", str(path)])
        # What the ranks get is built from that one read: the JSON's stage and micro-batch.
        written = json.loads((tmp_path / "runs" / "once" / "ds_config.json").read_text())
        assert written["zero_optimization"]["stage"] == 2 and written["train_micro_batch_size_per_gpu"] == 4
    else:
        assert main([command, str(path)]) == 0, capsys.readouterr()
    assert file_reads.get("user_ds.json") == 1, f"zeropipe {command} read the user's DeepSpeed JSON {file_reads.get('user_ds.json')} times"


def test_a_confined_run_writes_the_deepspeed_json_it_checked(tmp_path):
    """A UI run's JSON is checked for paths and written for the ranks from the same read: a file changed in between changes nothing."""
    from zeropipe.config.load import load_config
    from zeropipe.confine import Confinement
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    path = llm_config(tmp_path)
    resolved = resolve_run(load_config(path), confinement=Confinement((str(tmp_path),)))
    # Rewritten after the check (a swap between the check and the write): the run is what was checked.
    (tmp_path / "user_ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "csv_monitor": {"enabled": True, "output_path": "/etc"}}))
    written = json.loads(prepare_run(resolved).run.ds_config.read_text())
    assert written["zero_optimization"]["stage"] == 2 and "csv_monitor" not in written


def test_a_resolved_run_is_frozen(tmp_path):
    import dataclasses

    from zeropipe.config.load import load_config
    from zeropipe.launch.resolve import resolve_run

    resolved = resolve_run(load_config(llm_config(tmp_path)), fill_auto_knobs=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.config = resolved.config  # type: ignore[misc]


def test_a_diffusion_train_parses_each_model_index_json_once(tmp_path, monkeypatch, no_ranks, capsys):
    """The family's detection, the model spec, the checks, the entry's choice and the data step share one parse per pipeline folder."""
    from zeropipe.cli.main import main
    from zeropipe.config import pipeline_index

    parses: list[str] = []
    real = pipeline_index._read_json_object

    def counting(file, key, what):
        if file.name == pipeline_index.INDEX_FILE:
            parses.append(str(file.parent))
        return real(file, key, what)

    monkeypatch.setattr(pipeline_index, "_read_json_object", counting)
    raw = {
        "run": {"name": "tiny-sd", "output_dir": str(tmp_path / "runs")},
        "model": {"config": {"pipeline": "tiny-sd15"}, "lora": {"r": 4}},
        "data": {"synthetic": {"task": "shapes", "examples": 10}, "images": {"resolution": 32, "bucket_step": 32}, "cache": {"dir": str(tmp_path / "cache")}},
        "train": {"max_steps": 2, "micro_batch_size": 2},
        "deepspeed": {"zero_stage": 2, "precision": "fp32"},
        "hardware": {"gpus": 1, "accelerator": "cpu"},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(RanksWouldStart):
        main(["train", str(path)])
    assert parses, "the train command never read the pipeline's model_index.json"
    repeated = {folder: parses.count(folder) for folder in set(parses) if parses.count(folder) > 1}
    assert not repeated, f"model_index.json parsed more than once per folder: {repeated}"
