"""Ctrl-C, resume equality, and refusing bad input before any rank starts (a killed rank: test_faults.py)."""

from __future__ import annotations

import json
import re
import signal
import time

import psutil
import pytest

from tests.integration.conftest import RESUME_STEPS, SAVE_EVERY, assert_ok, metrics, start_zeropipe, zeropipe

pytestmark = pytest.mark.integration


def wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def rank_pids(run_dir) -> list[int]:
    status = json.loads((run_dir / "status.json").read_text())
    return status["pids"]


@pytest.mark.parametrize("stage", [2, 3])
def test_ctrl_c_then_resume_continues_exactly(uninterrupted, tmp_path, stage):
    # LoRA-free, dropout-free model in fp32: on CPU the resumed losses must equal the uninterrupted
    # ones. The uninterrupted run is the session's reference (conftest.py), which the exact-resume
    # tests of test_faults.py continue from each checkpoint; this one is stopped by a Ctrl-C.
    config, reference_dir = uninterrupted(stage)
    reference = {r["step"]: r for r in metrics(reference_dir)}
    elsewhere = ("run.name=cut", f"run.output_dir={tmp_path / 'runs'}")

    run_dir = tmp_path / "runs" / "cut"
    proc = start_zeropipe("train", config, *elsewhere)
    first = f"step_{SAVE_EVERY:08d}"
    wait_for(lambda: (run_dir / "checkpoints" / first / "zeropipe_complete.json").exists(), 600, f"checkpoint {first}")
    pids = rank_pids(run_dir)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "stopped; all ranks ended" in output and "--resume" in output
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    stopped_at = max(r["step"] for r in metrics(run_dir))
    assert stopped_at < RESUME_STEPS, "the run finished before Ctrl-C; the test proves nothing"

    result = zeropipe("train", config, *elsewhere, "--resume")
    assert_ok(result)
    assert "resuming" in result.stderr
    # The newest complete checkpoint: the first (step 10) unless the run got to the next before the Ctrl-C landed.
    resumed_from = int(re.search(r"from step_\d+ \(step (\d+)\)", result.stderr)[1])
    assert resumed_from % SAVE_EVERY == 0 and SAVE_EVERY <= resumed_from <= stopped_at, (resumed_from, stopped_at)
    resumed = metrics(run_dir)
    assert [r["step"] for r in resumed] == list(range(1, RESUME_STEPS + 1)), "metrics must have each step once"
    for row in resumed[:resumed_from]:
        expected = reference[row["step"]]
        assert row["loss"] == pytest.approx(expected["loss"], rel=1e-6, abs=1e-6), (row["step"], row["loss"], expected["loss"])
        assert row["lr"] == pytest.approx(expected["lr"], rel=1e-9)
    for row in resumed[resumed_from:]:
        # As test_faults.py's resumes from the later checkpoints: CPU ranks, fp32, no dropout: nothing but lost state can make these differ.
        expected = reference[row["step"]]
        assert (row["loss"], row["lr"], row["grad_norm"]) == (expected["loss"], expected["lr"], expected["grad_norm"]), row["step"]


def test_existing_run_is_not_overwritten(uninterrupted):
    """A second `train` of a config whose run directory holds a finished run is refused and changes nothing."""
    config, run_dir = uninterrupted(2)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir()), (run_dir / "metrics.jsonl").read_text()
    result = zeropipe("train", config)
    assert result.returncode == 2
    assert "already holds a run: continue it with --resume" in result.stderr
    assert (sorted(p.name for p in (run_dir / "checkpoints").iterdir()), (run_dir / "metrics.jsonl").read_text()) == before


def test_config_error_names_every_key_and_starts_nothing(tmp_run):
    tmp_path, make = tmp_run
    config = make("bad", train={"micro_batchsize": 2}, deepspeed={"zero_stage": 1, "offload_param": "cpu"})
    result = zeropipe("train", config)
    assert result.returncode == 2
    assert "train.micro_batchsize: unknown key; did you mean 'micro_batch_size'?" in result.stderr
    assert "deepspeed.offload_param: needs zero_stage 3 (you set 1)" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "bad").exists()


def test_too_many_malformed_lines_refuse_to_start(tmp_run):
    tmp_path, make = tmp_run
    data = tmp_path / "broken.jsonl"
    good = json.dumps({"instruction": "What is 1 + 1?", "output": "2"})
    data.write_text("\n".join([good] * 20 + ["{not json", good, '{"instruction": "x"}'] + [good] * 5) + "\n")
    config = make("broken", data={"synthetic": None, "path": str(data)})
    result = zeropipe("train", config)
    assert result.returncode == 2, result.stderr
    assert "broken.jsonl" in result.stderr and "line 21" in result.stderr and "max_bad_fraction" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs" / "broken" / "logs" / "rank0.log").exists()


def test_few_malformed_lines_are_skipped_and_reported(tmp_run):
    """Skipping and reporting malformed lines is the launcher's data step: run here, in-process, as `train` runs it.

    The ranks read the token cache that step writes (the good records only), whatever was skipped; that
    they train on it is every run's, and that the launcher prints its data step's notes is checked by
    real runs (test_diffusion.py's "skipped 2 unusable image(s)"). A 3-step run of its own cost a launch.
    """
    from zeropipe.config.load import load_config
    from zeropipe.families import family_of
    from zeropipe.rundir import RunDir

    tmp_path, make = tmp_run
    data = tmp_path / "mostly_good.jsonl"
    lines = [json.dumps({"instruction": f"What is {i % 9} + 1?", "output": str(i % 9 + 1)}) for i in range(60)]
    lines.insert(10, "{broken")
    data.write_text("\n".join(lines) + "\n")
    config = make("skips", data={"synthetic": None, "path": str(data), "max_bad_fraction": 0.05}, train={"max_steps": 3})
    run = RunDir(tmp_path / "prepared")
    run.path.mkdir(parents=True)
    loaded = load_config(config)
    prepared = family_of(loaded.model).prepare_data(loaded, run, reuse=False)
    notes = " ".join(prepared.notes)
    assert "skipped 1 malformed record(s)" in notes and "line 11" in notes, prepared.notes
    # The 60 good records, and only they, are in the cache the ranks read.
    cache = json.loads((run.cache / "cache.json").read_text())
    assert prepared.examples == cache["examples"] == 60, (prepared.examples, cache)
