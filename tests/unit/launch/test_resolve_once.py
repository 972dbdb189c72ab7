"""A run is decided once per command, and a curriculum once per stage: a spy counts the resolves.

Every resolve starts by asking which accelerator and how many ranks
(``zeropipe.launch.resolve.detect_accelerator``); the spy counts those calls. Anything that
resolved again behind the command's back (the checks, the planner, the run's preparation,
the curriculum runner) would show up as one more.
"""

from __future__ import annotations

import pytest
import yaml

from zeropipe.launch import resolve

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def resolves(monkeypatch):
    calls: list[str] = []
    real = resolve.detect_accelerator

    def counting(config):
        calls.append(config.run.name or "run")
        return real(config)

    monkeypatch.setattr(resolve, "detect_accelerator", counting)
    return calls


def raw_config(tmp_path, stages: bool) -> dict:
    raw = {
        "run": {"name": "once", "output_dir": str(tmp_path / "runs")},
        "model": {"config": TINY},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4, "micro_batch_size": 4},
        "deepspeed": {"zero_stage": "auto"},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
    }
    if stages:
        raw["stages"] = [
            {"name": "lora", "model": {"lora": {"r": 4}}},
            {"name": "full", "deepspeed": {"zero_stage": 3}, "train": {"max_steps": 6}},
        ]
    return raw


def test_zeropipe_check_resolves_a_run_once(tmp_path, resolves, capsys):
    from zeropipe.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw_config(tmp_path, stages=False)))
    assert main(["check", str(path)]) == 0
    assert len(resolves) == 1, resolves
    # The auto stage was filled by that one resolve's plan, and the checks judged that run.
    assert "auto: deepspeed.zero_stage = " in capsys.readouterr().out


def test_a_curriculum_is_resolved_once_per_stage_from_check_to_its_last_stage(tmp_path, resolves):
    from zeropipe.check import check_config
    from zeropipe.config.load import validate_config
    from zeropipe.launch.curriculum import Curriculum
    from zeropipe.launch.resolve import resolve_stages

    config = validate_config(raw_config(tmp_path, stages=True))
    # What `zeropipe train` does with a curriculum: resolve each stage, check them, open and prepare every stage.
    stages = resolve_stages(config)
    assert not [f for f in check_config(config, resolved_stages=stages) if f.severity == "error"]
    curriculum = Curriculum.open(config, resolved_stages=stages)
    assert len(resolves) == 2, resolves
    # Starting a later stage points it at the previous stage's weights without deciding it again.
    first, second = curriculum.stages
    (first.export).mkdir(parents=True)
    (first.export / "config.json").write_text("{}")
    prepared = curriculum.start(second)
    assert len(resolves) == 2, resolves
    assert prepared.config.model.path == str(first.export.resolve()) and prepared.plan.zero_stage == 3


def test_what_data_preparation_learns_is_kept_beside_the_checked_config(tmp_path, resolves):
    """config.yaml is the config as resolved and checked; the vocabulary the tokenizer fixed is learned.json's; the run reads both."""
    import json

    from zeropipe.config.load import validate_config
    from zeropipe.launch.prepare import prepare_run
    from zeropipe.launch.resolve import resolve_run

    resolved = resolve_run(validate_config(raw_config(tmp_path, stages=False)))
    prepared = prepare_run(resolved)
    assert len(resolves) == 1, resolves
    run = prepared.run
    saved = yaml.safe_load(run.config.read_text())
    learned = json.loads(run.learned_file.read_text())["values"]
    vocab = learned["model.config.vocab_size"]
    assert isinstance(vocab, int) and vocab > 0 and "vocab_size" not in saved["model"]["config"]
    # What the checks judged is what config.yaml says (precision and auto knobs resolved, nothing added since).
    assert saved["deepspeed"]["zero_stage"] == resolved.config.deepspeed.zero_stage != "auto"
    # Every later reader (ranks, export, generate) gets the config the run ran with.
    assert run.read_config().model.config["vocab_size"] == vocab == prepared.config.model.config["vocab_size"]
    assert f"model.config.vocab_size = {vocab} (from the tokenizer)" in prepared.notes
