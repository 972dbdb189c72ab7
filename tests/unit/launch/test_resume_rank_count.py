"""A resume keeps the checkpoint's global batch on any rank count, and knows where the data stood."""

from __future__ import annotations

import pytest

from zeropipe.data.sampler import DataPosition
from zeropipe.errors import ZeroPipeError
from zeropipe.launch.resume import keep_global_batch, saved_batch_shape, saved_data_position


def test_the_same_shape_resumes_without_a_word():
    assert keep_global_batch((4, 3, 2), 4, 3, 2, "step_00000003") == (3, [])


@pytest.mark.parametrize("ranks, accumulation", [(1, 6), (3, 2), (6, 1)])
def test_another_rank_count_gets_the_accumulation_that_keeps_the_global_batch(ranks, accumulation):
    kept, notes = keep_global_batch((4, 3, 2), 4, 3, ranks, "step_00000003")
    assert kept == accumulation and 4 * kept * ranks == 24
    assert notes == [
        (
            f"train.gradient_accumulation_steps = {accumulation} (keeps checkpoint step_00000003's global batch of 24: "
            f"micro-batch 4 x {accumulation} x {ranks} ranks; it was trained as 4 x 3 x 2)"
        )
    ]


def test_a_smaller_micro_batch_is_made_up_by_accumulation():
    assert keep_global_batch((8, 1, 2), 4, 1, 2, "step_00000006")[0] == 2  # 16 = 4 x 2 x 2


def test_a_global_batch_that_does_not_divide_names_the_numbers_and_what_to_set():
    with pytest.raises(ZeroPipeError) as raised:
        keep_global_batch((8, 1, 2), 8, 1, 3, "step_00000006")
    message = str(raised.value)
    assert "checkpoint step_00000006 was trained with a global batch of 16 (micro-batch 8 x accumulation 1 x 2 ranks)" in message
    assert "on 3 ranks with micro-batch 8 it would need accumulation 16/24" in message
    assert "hardware.gpus set to one of 1, 2 (they keep it with micro-batch 8)" in message
    assert "no micro-batch" not in message


def test_a_smaller_micro_batch_is_offered_when_it_keeps_the_global_batch():
    with pytest.raises(ZeroPipeError) as raised:
        keep_global_batch((4, 3, 2), 4, 3, 4, "step_00000003")  # 24 over 4 ranks x 4 does not divide
    assert "keep 4 ranks with train.micro_batch_size=3 (or 2, 1)" in str(raised.value)


def test_the_shape_comes_from_the_checkpoint_then_from_the_runs_last_plan():
    plan = {"micro_batch_size": 8, "gradient_accumulation_steps": 1, "world_size": 2}
    assert saved_batch_shape({"world_size": 2, "micro_batch_size": 4, "gradient_accumulation_steps": 3}, plan) == (4, 3, 2)
    assert saved_batch_shape({"world_size": 2}, plan) == (8, 1, 2), "checkpoints written before the shape was recorded"
    assert saved_batch_shape({}, {}) is None


def test_the_data_position_is_the_checkpoints_or_counted_from_its_step():
    recorded = {"data_position": {"epoch": 1, "consumed": 48, "world_size": 3, "micro_batch_size": 4}}
    assert saved_data_position(recorded, {}, 30, (4, 2, 3)) == DataPosition(1, 48, 3, 4)
    # An older checkpoint: step 30 x accumulation 1 = micro-step 30 of 25 per epoch on 2 ranks of micro-batch 8.
    assert saved_data_position({}, {"micro_batches_per_epoch": 25}, 30, (8, 1, 2)) == DataPosition(1, 5 * 16, 2, 8)


def test_overrides_after_resume_path_are_read_as_overrides(tmp_path, capsys):
    """`zeropipe train run.yaml --resume runs/NAME hardware.gpus=N`: the count is not an unrecognized argument."""
    from tests.integration.conftest import tiny_run_config, write_config
    from zeropipe.cli.main import main

    config = write_config(tmp_path, tiny_run_config(tmp_path))
    assert main(["train", str(config), "--resume", str(tmp_path / "runs" / "tiny"), "hardware.gpus=0"]) == 2
    err = capsys.readouterr().err
    assert "hardware.gpus: must be at least 1 (you set 0)" in err, err
    assert "unrecognized arguments" not in err and not (tmp_path / "runs").exists()


def test_other_stray_arguments_are_still_refused(tmp_path, capsys):
    from zeropipe.cli.main import main

    with pytest.raises(SystemExit) as raised:
        main(["train", str(tmp_path / "run.yaml"), "--resume", "somewhere", "--frobnicate"])
    assert raised.value.code == 2 and "unrecognized arguments: --frobnicate" in capsys.readouterr().err
