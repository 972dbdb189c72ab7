"""The universal copy of a checkpoint: trusted only when finished, never at the original's expense, pruned once overtaken."""

from __future__ import annotations

import hashlib
import json

import pytest

from zeropipe.checkpoint import manager
from zeropipe.checkpoint.universal import LOG_NAME, convert_to_universal, has_partitioned_state, universal_copy
from zeropipe.errors import CheckpointError


def saved(run_dir, step, shard=b"not a tensor file"):
    tag_dir = manager.checkpoints_dir(run_dir) / manager.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(shard)
    manager.mark_complete(run_dir, step, {"world_size": 2})
    return manager.CheckpointInfo(tag_dir.name, step, tag_dir)


def fingerprint(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_only_zero_shards_need_a_universal_copy(tmp_path):
    info = saved(tmp_path, 10)
    assert has_partitioned_state(info.path)
    (info.path / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert not has_partitioned_state(info.path), "stage 0 in fp32: the whole optimizer state is in the model-state file"


def test_an_unfinished_copy_is_not_trusted_and_a_failed_conversion_leaves_no_copy_and_the_original_intact(tmp_path):
    info = saved(tmp_path, 10)
    universal = manager.universal_dir(tmp_path)
    # What a conversion killed half-way leaves: its work folder, and (from a rename that never
    # happened with a marker) a copy without one.
    (universal / ".converting-step_00000010-4242" / "step_00000010" / "zero").mkdir(parents=True)
    (universal / "step_00000010" / "zero").mkdir(parents=True)
    assert universal_copy(tmp_path, "step_00000010") is None
    before = fingerprint(info.path)
    with pytest.raises(CheckpointError) as raised:
        convert_to_universal(tmp_path, info, tmp_path / "logs")
    message = str(raised.value)
    assert "converting checkpoint step_00000010 to a universal checkpoint" in message and "is unchanged" in message
    assert str(tmp_path / "logs" / LOG_NAME) in message
    assert sorted(p.name for p in universal.iterdir()) == [], "nothing half-written stays where a resume would look"
    assert fingerprint(info.path) == before
    assert manager.latest_checkpoint(tmp_path).tag == "step_00000010"


def test_a_finished_copy_is_reused_without_converting_again(tmp_path):
    info = saved(tmp_path, 10)
    copy = manager.universal_dir(tmp_path) / info.tag
    copy.mkdir(parents=True)
    (copy / manager.UNIVERSAL_MARKER).write_text(json.dumps({"step": 10}))
    assert convert_to_universal(tmp_path, info, tmp_path / "logs") == (copy, False)
    assert not (tmp_path / "logs" / LOG_NAME).exists()


def test_copies_go_once_the_run_has_a_newer_checkpoint_of_its_own(tmp_path):
    saved(tmp_path, 10)
    universal = manager.universal_dir(tmp_path)
    for name in ("step_00000010", ".converting-step_00000010-4242"):
        (universal / name).mkdir(parents=True)
    # No conversion runs while ranks train (the launcher converts before starting them): a work folder is a leftover.
    assert manager.prune(tmp_path, keep_last=3) == ["universal/.converting-step_00000010-4242"]
    assert (universal / "step_00000010").is_dir(), "the copy a resume is reading is kept"
    saved(tmp_path, 20)
    assert manager.prune(tmp_path, keep_last=3) == ["universal/step_00000010"]
    assert [info.step for info in manager.list_checkpoints(tmp_path)] == [10, 20], "the originals are kept"
