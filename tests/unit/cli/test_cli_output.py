"""The launcher's console (the UI's launcher.log): the progress lines follow train.log_every."""

from __future__ import annotations

from tests.e2e.fake_runs import write_metrics
from zeropipe.cli.output import Progress
from zeropipe.rundir import RunDir


def lines(tmp_path, capsys, log_every):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    progress = Progress(run, 12, log_every)  # not a terminal here: plain lines
    write_metrics(run.metrics, 12)
    progress.update()
    return [line.split("/")[0] for line in capsys.readouterr().err.splitlines()]


def test_the_console_prints_every_log_every_steps(tmp_path, capsys):
    """log_every was ignored on the launcher console: a line every tenth of the run whatever it said."""
    assert lines(tmp_path, capsys, 3) == ["step 3", "step 6", "step 9", "step 12"]


def test_without_log_every_a_line_every_tenth_of_the_run(tmp_path, capsys):
    assert lines(tmp_path, capsys, None) == [f"step {n}" for n in range(1, 13)]  # 12 steps: a tenth is one step
