"""Ownership of a run directory: one live launcher at a time, and a lost run read as lost."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zeropipe.rundir import OutsideRoots, RunDir, RunDirBusy

HOLD = """
import sys, time
from zeropipe.rundir import RunDir
RunDir(sys.argv[1]).claim()
print("claimed", flush=True)
time.sleep(60)
"""


@pytest.fixture
def other_owner(tmp_path):
    """Another process that owns tmp_path/run until the test kills it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    yield proc
    proc.kill()
    proc.wait()


def test_a_live_owner_is_named_and_keeps_the_directory(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    with pytest.raises(RunDirBusy) as caught:
        run.claim()
    assert f"launcher pid {other_owner.pid}" in str(caught.value) and "run.name" in str(caught.value)
    assert run.owner_pid() == other_owner.pid
    with pytest.raises(RunDirBusy):
        run.require_owner()


def test_the_lock_dies_with_its_owner_however_it_dies(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    other_owner.kill()  # SIGKILL: no cleanup code runs, the kernel drops the lock
    other_owner.wait()
    assert run.owner_pid() is None
    run.claim()
    try:
        assert run.owner_pid() == RunDir(tmp_path / "run").owner_pid()
        run.require_owner()
    finally:
        run.release()


def test_running_status_with_a_free_lock_reads_and_is_written_lost(tmp_path, other_owner):
    run = RunDir(tmp_path / "run")
    (run.path / "status.json").write_text(json.dumps({"state": "running", "supervisor_pid": other_owner.pid}))
    assert run.read_status()["state"] == "running"  # the owner is alive
    other_owner.kill()
    other_owner.wait()
    status = run.read_status()
    assert status["state"] == "lost" and f"pid {other_owner.pid}" in status["diagnosis"]["text"]
    assert json.loads(run.status_file.read_text())["state"] == "lost"
    assert run.owner_pid() is None  # the reader let go again


def test_claim_waits_out_a_readers_brief_hold(tmp_path, monkeypatch):
    """The holder lets go only once claim() has found the lock taken: claim waits for it instead of refusing.

    Decided by events, not by the clock: the holder releases when the first attempt has failed,
    and claim's patience is made long enough that a loaded machine cannot run it out.
    """
    import fcntl

    from zeropipe import rundir

    run = RunDir(tmp_path / "run")
    holder = HOLD.replace("time.sleep(60)", "sys.stdin.readline()")  # exits, dropping the lock, on a line from us
    proc = subprocess.Popen([sys.executable, "-c", holder, str(run.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "claimed"
    refused = []
    real_flock = fcntl.flock

    def flock(fd, operation):
        try:
            return real_flock(fd, operation)
        except BlockingIOError:
            if not refused:
                proc.stdin.write("let go\n")
                proc.stdin.flush()
            refused.append(operation)
            raise

    monkeypatch.setattr(rundir.fcntl, "flock", flock)
    monkeypatch.setattr(rundir, "CLAIM_WAIT_SECONDS", 120.0)
    try:
        run.claim()
        assert refused, "the directory was not held when claim started"
        assert run.owner_pid() == os.getpid()
    finally:
        run.release()
        proc.kill()
        proc.wait()


def test_status_on_a_full_disk_is_rewritten_in_place_and_stays_json(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = RunDir(disk / "run")
        run.path.mkdir()
        run.write_status(state="running", pids=[1, 2], supervisor_pid=3)
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with pytest.raises(OSError):
            while True:
                os.write(filler, b"\0" * 4096)
        os.close(filler)
        log_tail = "\n".join(f"  | line {i} of a long traceback" for i in range(200))
        run.write_status(state="failed", diagnosis={"rank": 0, "cause": "the disk is full", "fix": "free space", "text": f"rank 0 exited\nlast lines of rank 0's log:\n{log_tail}"})
        status = json.loads(run.status_file.read_text())
        assert status["state"] == "failed" and status["diagnosis"]["cause"] == "the disk is full"
        assert [p.name for p in run.path.iterdir() if ".tmp" in p.name] == []
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_lost_run_on_a_read_only_disk_still_reads_lost(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], check=False).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        run = RunDir(disk / "run")
        run.claim()
        run.write_status(state="running", supervisor_pid=12345)
        run.release()  # as if its launcher had been killed
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        assert run.read_status()["state"] == "lost"
        assert json.loads(run.status_file.read_text())["state"] == "running"  # nothing could be written
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


# ------------------------------------------------------------------ the one reader of a run
PACKAGE = Path(__file__).resolve().parents[2] / "src" / "zeropipe"
RUN_FILE_NAMES = ("run.json", "config.yaml")
RUN_FILE_ATTRIBUTES = {"plan_file", "config"}  # RunDir's names for them
READS = {"read_text", "read_bytes", "open"}
PARSERS = {"loads", "load", "safe_load", "full_load", "parse_yaml", "parse_yaml_text", "read_yaml"}


def names_a_run_file(node: ast.AST) -> bool:
    """``RUN.plan_file`` / ``RUN.config`` (RunDir's paths of the files), or their ``.read_text()``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READS:
        node = node.func.value
    return isinstance(node, ast.Attribute) and node.attr in RUN_FILE_ATTRIBUTES


def raw_run_file_reads(source: str) -> list[int]:
    """Lines that name run.json / config.yaml by their file name, or read or parse them without RunDir."""
    found = []
    for node in ast.walk(ast.parse(source)):
        spelled = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if spelled and (node.value in RUN_FILE_NAMES or node.value.endswith(tuple("/" + name for name in RUN_FILE_NAMES))):
            found.append(node.lineno)
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "load_saved_config":  # the typed reader of config.yaml: RunDir.read_config calls it
            found.append(node.lineno)
        elif name in READS and isinstance(func, ast.Attribute) and names_a_run_file(func.value):
            found.append(node.lineno)  # run.config.read_text()
        elif name in READS | PARSERS and any(names_a_run_file(arg) for arg in node.args):
            found.append(node.lineno)  # open(run.plan_file), json.loads(run.plan_file.read_text())
    return sorted(set(found))


def test_the_finder_sees_each_way_of_reading_a_run_file_raw():
    raw = [
        'json.loads((run_dir / "run.json").read_text())',
        'yaml.safe_load((self.run_dir / "config.yaml").read_text())',
        "json.loads(run.plan_file.read_text())",
        "yaml.safe_load(run.config.read_text())",
        "open(run.plan_file)",
        "load_saved_config(path)",
        'RUN / "stages" / "x/config.yaml"',
    ]
    for line in raw:
        assert raw_run_file_reads(line) == [1], line
    through_rundir = [
        "run.read_plan()",
        "run.read_config_fields().get('model')",
        "model.config.use_cache = True",
        "json.loads(model.config.to_json_string())",
        "RunDir(path).config.is_file()",
    ]
    for line in through_rundir:
        assert raw_run_file_reads(line) == [], line


def test_no_module_but_rundir_reads_run_json_or_config_yaml():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == "rundir.py":
            continue
        found += [f"{relative}:{line}" for line in raw_run_file_reads(path.read_text())]
    assert found == [], "read run.json / config.yaml through zeropipe.rundir.RunDir (read_plan, read_plan_fields, read_config, read_config_fields...)"


# ------------------------------------------------------------------ confined reading (the UI's)
SECRET = "hunter2-not-for-the-ui"
PLAN = {"world_size": 1, "accelerator": "cpu", "total_steps": 3, "steps_per_epoch": 3, "micro_batches_per_epoch": 3, "examples": 3,
        "micro_batch_size": 1, "gradient_accumulation_steps": 1, "zero_stage": 2}  # fmt: skip


@pytest.fixture
def linked_out(tmp_path):
    """RUNS/run whose run.json, config.yaml and status.json are symlinks to files outside the runs folder."""
    secret = tmp_path / "elsewhere"
    secret.mkdir()
    (secret / "run.json").write_text(json.dumps({**PLAN, "generate_prompts": [SECRET]}))
    (secret / "config.yaml").write_text(f"run:\n  name: {SECRET}\n")
    (secret / "status.json").write_text(json.dumps({"state": "completed", "diagnosis": {"text": SECRET}}))
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    for name in ("run.json", "config.yaml", "status.json"):
        os.symlink(secret / name, run / name)
    return run


def test_confined_reading_refuses_run_files_that_lead_out_naming_the_file_not_its_contents(linked_out):
    run = RunDir(linked_out, confined_to=linked_out.parent)
    for read, name in ((run.read_plan, "run.json"), (run.read_config_text, "config.yaml"), (run.read_config_fields, "config.yaml"), (run.read_config, "config.yaml")):
        with pytest.raises(OutsideRoots) as caught:
            read()
        message = str(caught.value)
        assert name in message and "leads outside the run directory" in message and "symlink" in message
        assert SECRET not in message
    # The lenient readers (the runs list, a run's page) read such a file as missing.
    assert run.read_plan_fields() == {} and run.read_status() == {} and run.read_json(run.plan_file) is None
    # The launcher's own, unconfined reading is unchanged.
    assert RunDir(linked_out).read_plan().generate_prompts == [SECRET]


def test_confined_reading_refuses_a_symlink_to_another_run_and_a_run_folder_that_leads_out(tmp_path):
    root = tmp_path / "runs"
    (root / "other").mkdir(parents=True)
    (root / "other" / "config.yaml").write_text(f"run:\n  name: {SECRET}\n")
    (root / "run").mkdir()
    os.symlink("../other/config.yaml", root / "run" / "config.yaml")  # inside the runs folder, but not this run's
    with pytest.raises(OutsideRoots) as caught:
        RunDir(root / "run", confined_to=root).read_config_text()
    assert SECRET not in str(caught.value)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "config.yaml").write_text(f"run:\n  name: {SECRET}\n")
    os.symlink(tmp_path / "elsewhere", root / "innocent")  # a run folder that is a symlink out of the runs folder
    with pytest.raises(OutsideRoots) as caught:
        RunDir(root / "innocent", confined_to=root).read_config_text()
    assert "not a run directory inside" in str(caught.value) and SECRET not in str(caught.value)


def test_confined_reading_follows_symlinks_that_stay_in_the_run(tmp_path):
    run = tmp_path / "runs" / "run"
    (run / "saved").mkdir(parents=True)
    (run / "saved" / "config.yaml").write_text("run:\n  name: run\n")
    os.symlink("saved/config.yaml", run / "config.yaml")
    assert RunDir(run, confined_to=run.parent).read_config_fields() == {"run": {"name": "run"}}


def test_a_fifo_under_a_run_files_name_reads_as_missing_instead_of_hanging(tmp_path):
    run = RunDir(tmp_path / "run", confined_to=tmp_path)
    run.path.mkdir()
    os.mkfifo(run.config)
    assert run.read_config_text() is None


def test_marking_a_run_lost_never_writes_through_a_symlinked_lock(tmp_path):
    run = RunDir(tmp_path / "runs" / "run", confined_to=tmp_path / "runs")
    run.path.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    os.symlink(victim, run.owner_lock)
    run.status_file.write_text(json.dumps({"state": "running", "supervisor_pid": 999_999_999}))
    assert run.read_status()["state"] == "lost"
    assert victim.read_text() == "keep me\n"
