"""A curriculum's launcher side without starting ranks: every stage prepared up front, stages.json, combined metrics."""

from __future__ import annotations

import json

import pytest

from zeropipe.config.load import validate_config
from zeropipe.errors import ConfigError, ZeroPipeError
from zeropipe.launch.curriculum import Curriculum

TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def curriculum_config(tmp_path, third_data=None, names=("lora", "full", "polish"), run_name="cur"):
    raw = {
        "run": {"name": run_name, "output_dir": str(tmp_path / "runs")},
        "model": {"config": TINY},
        "data": {"synthetic": {"task": "arithmetic", "examples": 64}, "max_seq_len": 32},
        "train": {"max_steps": 4, "micro_batch_size": 4},
        "hardware": {"gpus": 2, "accelerator": "cpu"},
        "stages": [
            {"name": names[0], "model": {"lora": {"r": 4}}},
            {"name": names[1], "deepspeed": {"zero_stage": 3}, "train": {"max_steps": 6}},
            {"name": names[2], "data": third_data or {"synthetic": {"task": "reverse", "examples": 64}}, "train": {"max_steps": 2}},
        ],
    }
    return validate_config(raw)


def test_every_stage_is_prepared_before_any_starts(tmp_path):
    curriculum = Curriculum.open(curriculum_config(tmp_path))
    top = tmp_path / "runs" / "cur"
    saved = json.loads((top / "stages.json").read_text())["stages"]
    assert [(s["name"], s["state"], s["total_steps"], s["step_offset"], s["zero_stage"]) for s in saved] == [
        ("lora", "pending", 4, 0, 2),
        ("full", "pending", 6, 4, 3),
        ("polish", "pending", 2, 10, 2),
    ]
    for stage in saved:
        assert (top / stage["dir"] / "ds_config.json").is_file() and (top / stage["dir"] / "cache" / "cache.json").is_file()
    # One tokenizer for all stages, trained on all their data (the last stage's reversed words included).
    assert all(stage.config.model.tokenizer == str((top / "tokenizer").resolve()) for stage in curriculum.stages)
    assert json.loads((top / "run.json").read_text())["total_steps"] == 12
    assert not (top / "status.json").exists(), "nothing was started"
    with pytest.raises(ZeroPipeError, match="already holds a run: continue it with --resume"):
        Curriculum.open(curriculum_config(tmp_path))


def test_a_bad_later_stage_stops_the_run_before_the_first_stage(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{broken\n" * 3 + '{"instruction": "a", "output": "b"}\n')
    with pytest.raises(ConfigError) as info:
        Curriculum.open(curriculum_config(tmp_path, third_data={"path": str(bad)}))
    assert [key for key, _ in info.value.problems] == ["stages[2]"]
    assert "polish" in str(info.value) and "bad.jsonl" in str(info.value)
    assert not (tmp_path / "runs" / "cur" / "stages.json").exists()


def test_metrics_are_combined_with_global_steps_and_rebuilt_after_a_resume(tmp_path):
    curriculum = Curriculum.open(curriculum_config(tmp_path))
    first, second, _ = curriculum.stages
    first.total_steps, second.total_steps = 4, 6

    def write_rows(stage, steps):
        stage.run.metrics.write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n" for s in steps))

    write_rows(first, range(1, 5))
    curriculum.rebuild_metrics(upto=first)
    write_rows(second, range(1, 4))
    with open(second.run.metrics, "a") as handle:
        handle.write('{"step": 4, "lo')  # rank 0 is writing this line right now
    curriculum.rebuild_metrics(upto=second)
    rows = curriculum.top.read_metrics()
    assert [(r["step"], r["stage"], r["stage_step"]) for r in rows] == [(s, "lora", s) for s in range(1, 5)] + [(4 + s, "full", s) for s in range(1, 4)]
    with open(second.run.metrics, "a") as handle:
        handle.write('ss": 6.0}\n')
    curriculum.mirror(second)
    assert [r["step"] for r in curriculum.top.read_metrics()][-2:] == [7, 8]
    # A resume from step 2 of the second stage drops its later rows; the combined file follows.
    write_rows(second, range(1, 3))
    curriculum.rebuild_metrics(upto=second)
    assert [r["step"] for r in curriculum.top.read_metrics()] == [1, 2, 3, 4, 5, 6]


def test_resume_needs_the_same_stages_and_something_left_to_train(tmp_path):
    Curriculum.open(curriculum_config(tmp_path))
    with pytest.raises(ZeroPipeError, match=r"are not the run's \(lora, full, polish\)"):
        Curriculum.open(curriculum_config(tmp_path, names=("lora", "all", "polish")), resume=True)
    reopened = Curriculum.open(curriculum_config(tmp_path), resume=str(tmp_path / "runs" / "cur" / "stages" / "02-full"))
    assert [stage.name for stage in reopened.remaining()] == ["lora", "full", "polish"]
    with pytest.raises(ZeroPipeError, match="holds no curriculum run"):
        Curriculum.open(curriculum_config(tmp_path, run_name="other"), resume=True)


def test_commands_given_the_curriculum_directory_use_the_latest_stage_with_a_checkpoint(tmp_path):
    from zeropipe.checkpoint.manager import mark_complete, resolve_checkpoint
    from zeropipe.errors import CheckpointError
    from zeropipe.families import resolve_source

    curriculum = Curriculum.open(curriculum_config(tmp_path))
    top = curriculum.top.path
    with pytest.raises(CheckpointError, match="none of whose stages has saved a checkpoint"):
        resolve_checkpoint(top)
    for stage, step in ((curriculum.stages[0], 4), (curriculum.stages[1], 2)):
        (stage.run.checkpoints / f"step_{step:08d}").mkdir(parents=True)
        mark_complete(stage.run.path, step, {"world_size": 2, "zero_stage": 2})
    run_dir, info = resolve_checkpoint(top)
    assert (run_dir, info.tag) == (curriculum.stages[1].run.path, "step_00000002")
    source = resolve_source(top)
    assert (source.kind, source.path, source.checkpoint.tag) == ("run", curriculum.stages[1].run.path, "step_00000002")
