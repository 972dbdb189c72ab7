"""The store indexes run directories: CLI runs appear, states are read, dead launchers are noticed."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e.fake_runs import live_pid, write_metrics, write_run, write_samples
from zeropipe.store import ActionRefused, Roots, RunNotFound, RunStore
from zeropipe.store.index import metrics_glance


@pytest.fixture
def store(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], data=[tmp_path / "data"], base=tmp_path)
    store = RunStore(roots)
    yield store
    store.close()


def test_runs_written_by_the_cli_appear_with_state_progress_and_loss(store):
    root = store.roots.primary_runs
    write_run(root, "done", steps=12)
    write_run(root, "oom", state="failed", steps=5, total_steps=12, checkpoints=())
    (root / "not-a-run").mkdir()
    store.refresh()
    runs = {run["name"]: run for run in store.runs()}
    assert set(runs) == {"done", "oom"}
    done, oom = runs["done"], runs["oom"]
    assert done["state"] == "completed" and done["step"] == 12 and done["total_steps"] == 12 and done["progress"] == 1.0
    assert done["origin"] == "cli" and done["world_size"] == 2 and done["zero_stage"] == 2
    assert done["last_loss"] < done["first_loss"]
    assert len(done["loss_preview"][0]) == 12
    assert oom["state"] == "failed" and "killed by SIGKILL" in oom["diagnosis"]["text"]
    assert store.runs(state="failed") == [oom]
    assert [r["name"] for r in store.runs(search="DON")] == ["done"]


def test_a_running_run_has_an_eta_and_is_lost_when_its_launcher_is_gone(store):
    root = store.roots.primary_runs
    write_run(root, "live", state="running", steps=10, total_steps=110, supervisor_pid=live_pid())
    write_run(root, "orphan", state="running", steps=10, total_steps=110, supervisor_pid=dead_pid())
    store.refresh()
    live, orphan = store.run("live"), store.run("orphan")
    assert live["state"] == "running"
    assert live["eta_s"] == pytest.approx(100 * 0.25)
    assert orphan["state"] == "lost" and orphan["eta_s"] is None
    assert "never recorded how the run ended" in orphan["diagnosis"]["text"]


def test_a_reused_pid_does_not_count_as_the_launcher(store):
    run = write_run(store.roots.primary_runs, "old", state="running", supervisor_pid=live_pid())
    status = json.loads((run / "status.json").read_text())
    status["started_at"] = 1_000_000.0  # long before this process (which now holds the pid) started
    (run / "status.json").write_text(json.dumps(status))
    store.refresh()
    assert store.run("old")["state"] == "lost"


def test_state_follows_the_files_and_a_deleted_run_disappears(store):
    run = write_run(store.roots.primary_runs, "r", state="running", steps=3, total_steps=12, supervisor_pid=live_pid())
    store.refresh()
    assert store.run("r")["state"] == "running"
    write_metrics(run / "metrics.jsonl", 12, 12)
    status = json.loads((run / "status.json").read_text())
    (run / "status.json").write_text(json.dumps({**status, "state": "completed", "ended_at": time.time()}))
    store.refresh()
    assert store.run("r")["state"] == "completed" and store.run("r")["step"] == 12
    import shutil

    shutil.rmtree(run)
    store.refresh()
    assert store.runs() == []
    with pytest.raises(RunNotFound):
        store.run("r")


def test_runs_are_found_by_id_name_or_path_and_ambiguous_names_say_so(tmp_path):
    roots = Roots(runs=[tmp_path / "a", tmp_path / "b"], base=tmp_path)
    store = RunStore(roots)
    write_run(roots.runs[0], "same")
    write_run(roots.runs[1], "same")
    write_run(roots.runs[0], "unique")
    store.refresh()
    unique = store.run("unique")
    assert store.run(unique["id"]) == unique == store.run(str(unique["id"])) == store.run(unique["path"])
    with pytest.raises(RunNotFound, match="2 runs are named 'same': use the id"):
        store.run("same")
    with pytest.raises(RunNotFound, match="zeropipe runs ls"):
        store.run("nothing")


def test_a_restarted_store_reattaches_to_the_same_rows(tmp_path):
    roots = Roots(runs=[tmp_path / "runs"], base=tmp_path)
    write_run(roots.primary_runs, "kept")
    first = RunStore(roots)
    first.refresh()
    run_id = first.run("kept")["id"]
    first.close()
    second = RunStore(roots)
    second.refresh()
    assert second.run("kept")["id"] == run_id and len(second.runs()) == 1


def test_the_glance_reads_a_long_metrics_file_without_reading_it_all(tmp_path, monkeypatch):
    import io

    from zeropipe.store import index

    path = tmp_path / "metrics.jsonl"
    write_metrics(path, 20_000)
    read = []

    class CountingFile(io.FileIO):
        """The bytes that really come off the disk (what the buffered reader asks of the file)."""

        def readinto(self, buffer):
            count = super().readinto(buffer)
            read.append(count or 0)
            return count

        def readall(self):
            data = super().readall()
            read.append(len(data))
            return data

    monkeypatch.setattr(index, "open", lambda file, mode="r": io.BufferedReader(CountingFile(file, "rb")), raising=False)
    glance = metrics_glance(path)
    assert glance["first"]["step"] == 1 and glance["last"]["step"] == 20_000
    steps = [row["step"] for row in glance["rows"]]
    assert steps == sorted(steps) and 55 <= len(steps) <= 62 and steps[-1] == 20_000
    # About 60 seeks of one buffer each and the last 16 KiB: a small part of a file of several MB.
    assert read and sum(read) < path.stat().st_size / 4, (sum(read), path.stat().st_size)


def test_logs_checkpoints_generations_and_samples(store):
    run_path = write_run(store.roots.primary_runs, "sd", steps=100, checkpoints=(50, 100))
    rows = write_samples(run_path)
    (run_path / "samples" / "index.jsonl").open("a").write('{"step": 1, "prompt": "x", "file": "../../../etc/passwd"}\nnot json\n')
    store.refresh()
    run = store.run("sd")
    assert run["has_samples"]
    assert store.log_names(run) == ["rank0", "rank1"]
    assert store.read_log(run, "rank0", 2)[-1].startswith("step 100/100")
    # A diffusion run's caching process, run before the ranks, has a log of its own.
    (run_path / "logs" / "node_setup.log").write_text("caches filled: 16 clip(s) and 18 caption(s) encoded on cpu\n")
    assert store.log_names(run) == ["node_setup", "rank0", "rank1"]
    assert store.read_log(run, "node_setup", 5) == ["caches filled: 16 clip(s) and 18 caption(s) encoded on cpu"]
    with pytest.raises(RunNotFound):
        store.read_log(run, "../../status", 10)
    tags = [c["tag"] for c in store.checkpoints(run)]
    assert tags == ["step_00000100", "step_00000050"] and store.checkpoints(run)[0]["latest"]
    assert store.generations(run)[0]["output"] == "3"
    samples = store.samples(run)
    assert [(s["step"], s["prompt"], s["file"]) for s in samples] == [(r["step"], r["prompt"], r["file"]) for r in rows]  # the traversal line is dropped
    assert store.sample_file(run, samples[0]["file"]).read_bytes().startswith(b"\x89PNG")


def test_stop_refuses_runs_that_are_not_running_and_pids_that_are_not_zeropipe(store):
    root = store.roots.primary_runs
    write_run(root, "done")
    # A "running" status whose supervisor pid is this test process: it is alive, but it is not
    # `zeropipe train`, so it must never be signalled.
    write_run(root, "impostor", state="running", supervisor_pid=live_pid())
    store.refresh()
    with pytest.raises(ActionRefused, match="is completed, not running"):
        store.stop("done")
    with pytest.raises(ActionRefused, match="no live launcher"):
        store.stop("impostor")


def test_resume_and_export_refuse_what_cannot_work(store):
    root = store.roots.primary_runs
    write_run(root, "nockpt", state="stopped", steps=5, total_steps=12, checkpoints=())
    write_run(root, "finished", steps=12, checkpoints=(12,))
    write_run(root, "live", state="running", supervisor_pid=live_pid())
    store.refresh()
    with pytest.raises(ActionRefused, match="no complete checkpoint"):
        store.resume("nockpt")
    with pytest.raises(ActionRefused, match="nothing left to train"):
        store.resume("finished")
    with pytest.raises(ActionRefused, match="stop it before resuming"):
        store.resume("live")
    with pytest.raises(ActionRefused, match="not a checkpoint name"):
        store.export("finished", checkpoint="../../etc")
    with pytest.raises(ActionRefused, match="cannot be a folder name"):
        store.export("finished", name="../outside")
    with pytest.raises(ActionRefused, match="dtype"):
        store.export("finished", dtype="int3")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_launcher_that_recorded_its_end_does_not_block_a_resume(store):
    """Between writing "stopped" and exiting, a launcher is not busy: Resume waits for it, then starts."""
    run_path = write_run(store.roots.primary_runs, "r", state="stopped", steps=6, total_steps=12, checkpoints=(6,))
    store.refresh()
    run = store.run("r")
    exiting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    store.db.insert_launch(run_id=run["id"], action="train", pid=exiting.pid, command=[], log_path=str(run_path / "logs" / "launcher.log"), started_at=time.time())
    status = json.loads((run_path / "status.json").read_text())
    (run_path / "status.json").write_text(json.dumps({**status, "started_at": time.time() + 0.01}))  # written by that launcher
    started = time.time()
    assert store.busy_launch(run) is None
    assert exiting.poll() is not None, "busy_launch returned while the old launcher was still alive"
    assert time.time() - started < 14  # it waited for the exit, not its whole 15 s of patience

    # A launcher whose run has not recorded an end since it started is busy.
    working = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        store.db.insert_launch(run_id=run["id"], action="resume", pid=working.pid, command=[], log_path=str(run_path / "logs" / "launcher.log"), started_at=time.time())
        assert store.busy_launch(run)["pid"] == working.pid
        with pytest.raises(ActionRefused, match="is starting: stop it before resuming"):
            store.resume("r")
    finally:
        working.kill()
        working.wait()


def test_an_eval_row_last_in_the_file_does_not_hide_the_loss(store):
    root = store.roots.primary_runs
    run_path = write_run(root, "evaluated", steps=12)
    (run_path / "summary.json").unlink(missing_ok=True)  # still running: no summary to fall back on
    with open(run_path / "metrics.jsonl", "a") as handle:
        handle.write(json.dumps({"kind": "eval", "step": 12, "eval_loss": 2.0, "eval_perplexity": 7.4, "time": time.time()}) + "\n")
    store.refresh()
    run = store.run("evaluated")
    assert run["step"] == 12 and run["last_loss"] is not None and run["last_loss"] < run["first_loss"]
    assert len(run["loss_preview"][0]) == 12
