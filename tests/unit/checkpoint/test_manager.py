from zeropipe.checkpoint import manager


def fake_save(run_dir, step, complete=True):
    tag_dir = manager.checkpoints_dir(run_dir) / manager.tag_for(step)
    tag_dir.mkdir(parents=True)
    (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x" * 10)
    if complete:
        manager.mark_complete(run_dir, step, {"world_size": 2})
    return tag_dir


def test_interrupted_save_keeps_previous_checkpoint_as_latest(tmp_path):
    fake_save(tmp_path, 10)
    fake_save(tmp_path, 20, complete=False)  # killed halfway through writing
    assert (manager.checkpoints_dir(tmp_path) / "latest").read_text() == "step_00000010"
    assert manager.latest_checkpoint(tmp_path).step == 10
    # The half-written tag is not trusted even when named explicitly.
    try:
        manager.resolve_checkpoint(manager.checkpoints_dir(tmp_path) / "step_00000020")
    except manager.CheckpointError as err:
        assert "not a complete checkpoint" in str(err)
    else:
        raise AssertionError("an incomplete checkpoint was accepted")


def test_latest_pointer_to_missing_tag_falls_back_to_newest_complete(tmp_path):
    fake_save(tmp_path, 10)
    fake_save(tmp_path, 20)
    (manager.checkpoints_dir(tmp_path) / "latest").write_text("step_00000099")
    assert manager.latest_checkpoint(tmp_path).step == 20


def test_prune_keeps_last_k_and_only_after_a_newer_one_is_complete(tmp_path):
    for step in (10, 20, 30):
        fake_save(tmp_path, step)
    in_progress = fake_save(tmp_path, 40, complete=False)
    removed = manager.prune(tmp_path, keep_last=2)
    assert removed == ["step_00000010"]
    assert [info.step for info in manager.list_checkpoints(tmp_path)] == [20, 30]
    assert in_progress.exists(), "a save in progress (newer than every complete one) must not be touched"


def test_resolve_accepts_run_dir_and_checkpoints_folder(tmp_path):
    fake_save(tmp_path, 5)
    for path in (tmp_path, manager.checkpoints_dir(tmp_path)):
        run_dir, info = manager.resolve_checkpoint(path)
        assert run_dir == tmp_path and info.tag == "step_00000005"


def test_no_checkpoint_is_a_clear_error(tmp_path):
    try:
        manager.resolve_checkpoint(tmp_path)
    except manager.CheckpointError as err:
        assert "has no complete checkpoint" in str(err)
    else:
        raise AssertionError("expected CheckpointError")


def test_set_aside_checkpoints_go_once_the_resumed_run_has_overtaken_them(tmp_path):
    for step in (10, 20, 30, 40):
        fake_save(tmp_path, step)
    # A resume from step 20 set 30 and 40 aside (launch.prepare.set_aside_future).
    aside = manager.checkpoints_dir(tmp_path) / "superseded-20261124-101500"
    aside.mkdir()
    for step in (30, 40):
        (manager.checkpoints_dir(tmp_path) / manager.tag_for(step)).rename(aside / manager.tag_for(step))
    fake_save(tmp_path, 30)
    assert "superseded-20261124-101500" not in manager.prune(tmp_path, keep_last=2)
    assert aside.is_dir(), "the abandoned step 40 is still ahead of the resumed run"
    fake_save(tmp_path, 40)
    assert "superseded-20261124-101500" in manager.prune(tmp_path, keep_last=2)
    assert not aside.exists()
    assert [info.step for info in manager.list_checkpoints(tmp_path)] == [30, 40]
